"""GPU diagnosis (run through .ci/gpu, SCRIPTS=.ci/diag/region_moves.py): HF Llama (8 layers,
hidden 512, bf16) ``generate()`` with its DynamicCache, 64 tokens, ``graphify(model)``: tokens
against eager's, tokens/s (no eager timing), the aliases its implicit region moved to copies
in one generate (``Slot.move``, by shape), its graphs with and without temporaries
(``CapturedGraph.scratch``, ``frees``). Then the hazard a graph with temporaries is protected
against: a ``Linear`` captured after an MLP into one region, its output held across the MLP's
replays, with the MLP's protection switched off (``scratch = False``): how many of 4 held
outputs were overwritten."""
import copy, time, warnings, collections
import torch, transformers
import cudagraphify as cg
from cudagraphify import _region
warnings.simplefilter("ignore")
N = 64
cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                               num_attention_heads=8, num_key_value_heads=4, vocab_size=32000,
                               max_position_embeddings=32 + N + 8)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
prompt = torch.randint(0, cfg.vocab_size, (1, 32), device="cuda")
greedy = dict(max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0,
              disable_compile=True)
g = cg.graphify(copy.deepcopy(model))
moves = collections.Counter()
orig = _region.Slot.move
def move(self, extra):
    moves[tuple(self.tensor.shape)] += 1
    return orig(self, extra)
_region.Slot.move = move
with torch.no_grad():
    want = model.generate(prompt, **greedy)
    for _ in range(3):
        got = g.generate(prompt, **greedy)
    moves.clear()
    root = g._cudagraphify_state
    ch = root._chain
    m0 = ch.moved_outputs if ch else 0
    torch.cuda.synchronize(); t0 = time.perf_counter()
    got = g.generate(prompt, **greedy)
    torch.cuda.synchronize(); dt = time.perf_counter() - t0
    print("tokens equal:", torch.equal(got, want), f"{N / dt:.0f} tok/s")
    print("moves per generate:", dict(moves), "region moved_outputs delta",
          (ch.moved_outputs - m0) if ch else None)
    given = sum(1 for m in g.modules()
                if getattr(m.__dict__.get("_cudagraphify_state"), "given_back", None))
    print("pieces given back:", given)
    caches = [ch.cache_for(m._cudagraphify_state) for m in g.modules()
              if m.__dict__.get("_cudagraphify_state") is not None]
    entries = [e for c in caches for e in c.graphs()]
    print("region graphs:", len(entries),
          "scratch-free:", sum(1 for e in entries if not e.scratch),
          "(allocs, frees):", collections.Counter((e.allocs, e.frees) for e in entries))

# the hazard the scratch flag guards: an output captured after a graph with temporaries, held
# across its replay, with that graph's protection switched off
import sys
sys.path.insert(0, "tests")
from test_gpu_aliases import _Mlp, _entry
from torch import nn
torch.manual_seed(0)
mlp, up = _Mlp().cuda().eval(), nn.Linear(16, 4096).cuda().eval()
gm, gu = cg.graphify(copy.deepcopy(mlp)), cg.graphify(copy.deepcopy(up))
with torch.no_grad(), cg.graph_region() as region:
    gm(torch.randn(4, 16, device="cuda")); gu(torch.randn(4, 16, device="cuda"))
    m, u = _entry(region, gm), _entry(region, gu)
    print("mlp allocs", m.allocs, "frees", m.frees, "scratch", m.scratch,
          "| linear allocs", u.allocs, "frees", u.frees, "scratch", u.scratch)
    m.scratch = False  # (protection off: the hazard shows, or the allocator kept them apart)
    bad = 0
    for _ in range(4):
        x1, x2 = torch.randn(4, 16, device="cuda"), torch.randn(4, 16, device="cuda")
        y = gu(x1); gm(x2)
        bad += not torch.equal(y, up(x1))
    print("hazard real (later output overwritten with protection off):", bad, "of 4")
