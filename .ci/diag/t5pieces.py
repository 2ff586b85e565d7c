"""T5 static-cache generate under graphify: which graphed piece's output is not eager's.

t5diff.py (run 4, H100) found every decode step's logits up to 1e-6 from eager's, tokens
equal. Here every module with graphs gets a forward hook that runs its plain class forward on
the same inputs (after the graphed call) and compares the two bitwise: a piece whose graph runs
another kernel differs by rounding on every call; a stale replay differs by more, or only
after some calls. Prints per module class: calls, calls that differ, largest difference."""
import collections
import copy
import warnings

import torch
import transformers

import cudagraphify as cg

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":  # (the CPU double: tests/conftest.py's SimBackend, to try the script)
    import sys
    sys.path.insert(0, "tests")
    from conftest import SimBackend
    from cudagraphify import _capture
    _capture.set_backend(SimBackend())
warnings.simplefilter("ignore")
torch.manual_seed(0)
cfg = transformers.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                            num_decoder_layers=2, num_heads=4, pad_token_id=0,
                            decoder_start_token_id=0, eos_token_id=1)
model = transformers.T5ForConditionalGeneration(cfg).to(DEV).eval()
ref = copy.deepcopy(model)
g = cg.graphify(model)
gen = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0,
           cache_implementation="static")
seen = collections.defaultdict(lambda: [0, 0, 0.0])  # class -> calls, differing, max diff
checking = [False]


def check(module, args, kwargs, out):
    if checking[0] or not isinstance(out, torch.Tensor):
        return
    checking[0] = True
    try:
        with torch.no_grad(), cg.graph_region(enabled=False):
            want = type(module).forward(module, *args, **kwargs)
    finally:
        checking[0] = False
    row = seen[f"{type(module).__name__}"]
    row[0] += 1
    if isinstance(want, torch.Tensor) and want.shape == out.shape and not torch.equal(
            want.view(torch.int32) if want.dtype == torch.float32 else want,
            out.view(torch.int32) if out.dtype == torch.float32 else out):
        row[1] += 1
        row[2] = max(row[2], float((want.float() - out.float()).abs().max()))


with torch.no_grad():
    ids = torch.randint(4, 256, (1, 5), device=DEV)
    g.generate(ids, **gen)  # (captures)
    g.generate(ids, **gen)
    hooked = 0
    for name, m in g.named_modules():
        st = m.__dict__.get("_cudagraphify_state")
        if st is not None and cg.stats(m).graphs:
            m.register_forward_hook(check, with_kwargs=True)
            hooked += 1
    a, b = ref.generate(ids, **gen), g.generate(ids, **gen)
    print(f"T5 pieces hooked {hooked}; tokens equal {torch.equal(a, b)}")
    for cls, (calls, bad, diff) in sorted(seen.items()):
        print(f"  {cls}: calls {calls}, not bitwise {bad}, max|diff| {diff:.3e}")
