"""#16's "grad mode" step of the differential (GPT-2, Llama: piecewise, a forward under grad mode
whose outputs are kept, no backward), timed longer than the bench does, on one warm model:
eager; graphify as it is (its pending pieces bypassed, see _fast.Bypass); graphify with the
bypass off (``Bypass.scan`` answering None: each piece through its own pending fast path, as
before a8abf78). Interleaved rounds; per variant the best and the median round, µs per call,
and the median of the per-round ratios to eager. The outputs are compared with eager's bitwise.
``--cpu``: the CPU double (tests/conftest.py's SimBackend, its replay a no-op, timed)."""
import copy
import statistics
import sys
import time
import warnings

import torch

import cudagraphify as cg
from cudagraphify import _fast
from cudagraphify.bench.differential import MODELS, apply_step, steps

DEV = "cuda" if torch.cuda.is_available() and "--cpu" not in sys.argv else "cpu"
if DEV == "cpu":
    sys.path.insert(0, "tests")
    from conftest import SimBackend, SimGraph
    from cudagraphify import _capture
    SimGraph.replay = lambda self: None
    backend = SimBackend()
    backend.clock = lambda device: time.perf_counter
    _capture.set_backend(backend)
warnings.simplefilter("ignore")
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
ROUNDS, CALLS = 15, 30
scan = _fast.Bypass.scan


def per_call(fn, x) -> float:
    sync()
    t = time.perf_counter()
    for _ in range(CALLS):
        fn(x)
    sync()
    return (time.perf_counter() - t) / CALLS * 1e6


for name in [a for a in sys.argv[1:] if not a.startswith("--")] or ["gpt2", "llama"]:
    ref, make, pick = MODELS[name](DEV)
    torch.manual_seed(0)
    ref = ref.to(DEV).eval()  # (MODELS build on the CPU: see bench_differential)
    g = cg.graphify(copy.deepcopy(ref))
    for step, change, kwargs, ctx in steps(DEV):
        x = apply_step(step, change, make, kwargs, ref, g)
        if step == "grad mode":
            break
    with torch.enable_grad():
        for _ in range(6):  # as the bench: the last outputs stay referenced while timed
            got, want = pick(g(x)), pick(ref(x))
        print(f"{name}: grad-mode output bitwise eager's: {torch.equal(got, want)}", flush=True)
        variants = {"eager": (ref, None), "graphify": (g, scan),
                    "graphify, bypass off": (g, lambda state: None)}
        samples = {k: [] for k in variants}
        for _ in range(ROUNDS):
            for key, (fn, scanner) in variants.items():
                if scanner is not None:
                    _fast.Bypass.scan = staticmethod(scanner)
                    _fast.decided_made[0] += 1  # (the root looks at its pieces again)
                    for _ in range(3):
                        fn(x)
                samples[key].append(per_call(fn, x))
        _fast.Bypass.scan = staticmethod(scan)
        eager = samples["eager"]
        for key, values in samples.items():
            ratio = statistics.median(v / e for v, e in zip(values, eager))
            print(f"  {key:<22} best {min(values):7.0f} µs  median {statistics.median(values):7.0f}"
                  f" µs  median ratio to eager {ratio:.3f}", flush=True)
        s = cg.stats(g)
        print(f"  stats: captures {s.captures}, replays {s.replays}, "
              f"eager {sum(s.eager_calls.values())}", flush=True)
