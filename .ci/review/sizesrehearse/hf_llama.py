"""HF Llama (small config, random weights, no network) under capture_sizes at decode sizes
[8, 4, 2, 1] of (B, 1) input_ids, use_cache=False: lending on and off, each compared bitwise
with a hand-made CUDA graph of an eager twin (logits), the sizes graphed and the rehearsals counted. ``python
hf_llama.py`` (DEV=cpu: CPU double)."""
import copy
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CPU, DEV, check, info, lending, skip  # noqa: E402

import torch  # noqa: E402

import cudagraphify as cg  # noqa: E402

try:
    import transformers
except Exception as e:  # noqa: BLE001
    skip("hf llama", f"transformers not importable: {type(e).__name__}: {e}")
    sys.exit(0)

SIZES = [8, 4, 2, 1]


def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=128, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval().to(DEV)


def floor(model, x):
    """The logits of a hand-made torch.cuda.graph of ``model`` on ``x`` (eager's on the CPU
    double): the path HF takes while captured applies the mask that eager skips, which in fp32
    differs from eager by about 1e-7 (.ci/diag/llama_bitwise.py, H200: the hand graph as much
    as graphify's replays). A graph must give what that floor gives, bitwise."""
    if CPU:
        return model(input_ids=x.clone(), use_cache=False).logits
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        model(input_ids=x.clone(), use_cache=False)
    torch.cuda.current_stream().wait_stream(s)
    g, static = torch.cuda.CUDAGraph(), x.clone()
    with torch.cuda.graph(g):
        out = model(input_ids=static, use_cache=False).logits
    g.replay()
    return out.clone()


def one(on: bool):
    model = llama()
    ref = copy.deepcopy(model)
    g = cg.graphify(model, max_graphs=16)
    gen = torch.Generator().manual_seed(1)

    def ids(b):
        return torch.randint(0, 128, (b, 1), generator=gen).to(DEV)

    made = []

    def inputs(b):
        made.append(ids(b))
        return {"input_ids": made[-1].clone(), "use_cache": False}

    t0 = time.perf_counter()
    with torch.no_grad(), lending(on) as n:
        done = cg.capture_sizes(g, inputs, SIZES, progress=False)
        rehearsals = len(n)
        seconds = time.perf_counter() - t0
        same = True
        for x in made:  # (the eager twin makes capture_sizes' calls too)
            ref(input_ids=x.clone(), use_cache=False)
        for b in sorted(SIZES) * 2:
            x = ids(b)
            got = g(input_ids=x.clone(), use_cache=False).logits
            want = floor(ref, x)
            same &= bool(torch.equal(got, want))
    s = cg.stats(g)
    return done, rehearsals, same, s, seconds


if __name__ == "__main__":
    info(f"device {DEV}{' (CPU double)' if CPU else ''}, torch {torch.__version__}, "
         f"transformers {transformers.__version__}")
    runs = {}
    for on in (True, False):
        label = "lending on" if on else "lending off"
        try:
            done, reh, same, s, sec = one(on)
        except Exception as e:  # noqa: BLE001
            check(False, f"[control] HF llama decode sizes, {label}",
                  f"{type(e).__name__}: {str(e)[:300]}")
            continue
        runs[on] = (done.graphed, sorted(done.eager), s.captures, s.replays, s.eager)
        info(f"HF llama {label}: graphed {done.graphed}, eager {sorted(done.eager)}, "
             f"rehearsals {reh}, captures {s.captures}, replays {s.replays}, eager calls "
             f"{s.eager}, capture_sizes {sec:.2f} s")
        check(same, f"[control] HF llama decode sizes {SIZES}, {label}: logits bitwise = a hand graph's")
        runs[(on, "reh")] = reh
    if True in runs and False in runs:
        check(runs[True] == runs[False], "[control] HF llama: lending decides as without it",
              f"{runs[True]} vs {runs[False]}")
        check(runs[(True, "reh")] <= runs[(False, "reh")],
              "[control] HF llama: lending rehearses no more",
              f"{runs[(True, 'reh')]} vs {runs[(False, 'reh')]}")
