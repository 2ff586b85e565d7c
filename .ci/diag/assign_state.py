"""#16's differential GPT-2 step ``load_state_dict(assign=True)``: why graphify runs slower
than eager after it (1.31x on an H100, 2026-12-05, while every step before it was 0.83-0.87x).
Runs the differential script's steps up to it on HF GPT-2 (eager twin beside), then prints
µs per call of both, the counters of the calls, ``explain()``, and a cProfile of 30 graphified
calls (top functions by own time and by cumulative time); the same for the grad mode step
(1.15x: a backward is pending, the pieces' calls run eagerly)."""
import copy
import cProfile
import io
import pstats
import time

import torch

import cudagraphify as cg
from cudagraphify.bench.differential import MODELS, apply_step, path_taken, steps


def per_call(fn, x, n=30):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


PROFILE = ("load_state_dict(assign=True)", "grad mode")


def profile(step, x, ctx):
    print(cg.explain(graphed), flush=True)
    before = cg.stats(graphed)
    prof = cProfile.Profile()
    with ctx():
        prof.enable()
        for _ in range(30):
            graphed(x)
        torch.cuda.synchronize()
        prof.disable()
    print(f"{step}: 30 calls:", path_taken(before, cg.stats(graphed))[:400], flush=True)
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(22)
        print(s.getvalue()[:5000], flush=True)


torch.manual_seed(0)
ref, make, pick = MODELS["gpt2"]("cuda")
ref = ref.cuda().eval()
graphed = cg.graphify(copy.deepcopy(ref))
for step, change, kwargs, ctx in steps("cuda"):
    x = apply_step(step, change, make, kwargs, ref, graphed)
    before = cg.stats(graphed)
    with ctx():
        for _ in range(6):  # the last outputs stay referenced, as in the bench
            kept = (graphed(x), ref(x))
            assert torch.equal(pick(kept[0]), pick(kept[1]))
        e, g = per_call(ref, x), per_call(graphed, x)
    print(f"{step:<30} eager {e:7.0f} µs graphify {g:7.0f} µs  "
          f"{path_taken(before, cg.stats(graphed))[:200]}", flush=True)
    if step in PROFILE:
        profile(step, x, ctx)
    if step == PROFILE[-1]:
        break
