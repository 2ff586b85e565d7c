"""#16's differential script on the CPU double (tests/conftest.py's SimBackend, its replay a
no-op, timed with the host clock): per step of ``cudagraphify.bench.differential.steps``, µs
per call of eager and graphify (best of 7 rounds of 30 calls after 26 settling calls), and per
forward in 20 calls after them: the pieces' calls that took the slow path, replays, eager
calls, and the outputs the root's implicit region moved to copies. Host time only; the ratio
is not the GPU's (eager computes for real here). It showed HF Llama's apply_rotary_pos_emb
piece running eagerly for good after the fourth signature or parameter change (fixed in
303c3a0), and outputs moved to copies every forward after a partial recapture (open).
Usage: ``python .ci/diag/differential_cpu.py [llama|gpt2|bert|ours]`` (needs transformers)."""
import collections
import copy
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from conftest import SimBackend, SimGraph  # noqa: E402

import cudagraphify as cg  # noqa: E402
from cudagraphify import _capture, _engine  # noqa: E402
from cudagraphify.bench.differential import MODELS, apply_step, steps  # noqa: E402

SimGraph.replay = lambda self: None
backend = SimBackend()
backend.clock = lambda device: time.perf_counter
_capture.set_backend(backend)
# (HF's mask code asks whether it is captured: answered as the double captures, as on a GPU)
torch.cuda.is_current_stream_capturing = lambda: backend.capturing
warnings.simplefilter("ignore")


def per_call(fn, x, n=30):
    t = time.perf_counter()
    for _ in range(n):
        fn(x)
    return (time.perf_counter() - t) / n * 1e6


name = sys.argv[1] if len(sys.argv) > 1 else "llama"
ref, make, pick = MODELS[name]("cpu")
torch.manual_seed(0)
ref = ref.eval()
g = cg.graphify(copy.deepcopy(ref))
real_slow = _engine.GraphedState.slow
slow = collections.Counter()


def counting_slow(self, fn, args, kwargs):
    slow[self.name] += 1
    return real_slow(self, fn, args, kwargs)


_engine.GraphedState.slow = counting_slow
for step, change, kwargs, ctx in steps("cpu"):
    x = apply_step(step, change, make, kwargs, ref, g)
    with ctx():
        for _ in range(26):
            g(x)
        chain = g._cudagraphify_state._chain
        moved = chain.moved_outputs if chain is not None else 0
        slow.clear()
        s0 = cg.stats(g)
        for _ in range(20):
            g(x)
        s1 = cg.stats(g)
        chain = g._cudagraphify_state._chain
        moved = (chain.moved_outputs if chain is not None else 0) - moved
        slow_calls = sum(slow.values())
        best = {"eager": float("inf"), "graphify": float("inf")}
        for _ in range(7):
            best["eager"] = min(best["eager"], per_call(ref, x))
            best["graphify"] = min(best["graphify"], per_call(g, x))
    eager = sum(s1.eager_calls.values()) - sum(s0.eager_calls.values())
    print(f"{step:30s} eager {best['eager']:6.0f} µs  graphify {best['graphify']:6.0f} µs  "
          f"per forward: slow {slow_calls / 20:.1f}, replays "
          f"{(s1.replays - s0.replays) / 20:.1f}, eager {eager / 20:.1f}, moved {moved / 20:.1f}",
          flush=True)
