"""GPU diagnosis (#16, the differential bench's grad-mode step, GPT-2 1.07x eager): the step's
calls run eagerly (the warm-up's output kept: its backward pending), yet cost more than eager.
Where: eager; graphify; the graphified model's forward called directly (root wrapper skipped);
the same with every submodule's cudagraphify call override and wrapped forward taken off (so
only what else differs is left); each best of 7 interleaved rounds of 20 calls. Also what each
submodule holds (call override type, own forward).

    source .device/install.sh && python3 .ci/diag/pending_parts.py gpt2 llama"""
import collections
import copy
import sys
import time
import warnings

import torch

import cudagraphify as cg
from cudagraphify import _capture
from cudagraphify.bench.differential import MODELS, apply_step, steps

warnings.simplefilter("ignore")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":  # (the CPU double: its replays are slow, only the overrides-off row means much)
    sys.path.insert(0, "tests")
    from conftest import SimBackend
    _capture.set_backend(SimBackend())
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)


def tpc(fn, x, calls=20):
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(x)
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


for name in sys.argv[1:] or ("gpt2", "llama"):
    ref, make, pick = MODELS[name](DEV)
    torch.manual_seed(0)
    ref = ref.to(DEV).eval()
    g = cg.graphify(copy.deepcopy(ref))
    for step, change, kwargs, ctx in steps(DEV):
        x = apply_step(step, change, make, kwargs, ref, g)
        with ctx():
            for _ in range(6):
                got, want = pick(g(x)), pick(ref(x))
        if step == "grad mode":
            break
    held = collections.Counter(
        (type(m.__dict__.get("_compiled_call_impl")).__name__, "forward" in m.__dict__)
        for m in g.modules())
    print(name, "submodules (call override, own forward):", dict(held))
    raw = g.forward.__wrapped__
    with torch.enable_grad():
        best = collections.defaultdict(lambda: 1e9)
        for _ in range(7):
            for k, fn in (("eager", ref), ("graphify", g), ("root skipped", raw)):
                best[k] = min(best[k], tpc(fn, x))
        # every override and wrapped forward off (put back after)
        saved = []
        for m in g.modules():
            d = m.__dict__
            saved.append((m, d.get("_compiled_call_impl"), d.pop("forward", None)))
            d["_compiled_call_impl"] = None
        plain = type(g).forward.__get__(g)
        for _ in range(7):
            for k, fn in (("eager", ref), ("overrides off", plain)):
                best[k] = min(best[k], tpc(fn, x))
        for m, impl, fwd in saved:
            m.__dict__["_compiled_call_impl"] = impl
            if fwd is not None:
                m.__dict__["forward"] = fwd
    # which path the graphified calls' modules took: the bypass (a piece's plain forward
    # straight from its DirectCall), the eager fast path, the slow path
    from cudagraphify import _engine, _fast, _wrap
    counts = collections.Counter()
    real = {"slow": _engine.GraphedState.slow, "eager_fast": _fast.EagerFast.call,
            "direct": _wrap.DirectCall.__call__}

    def counting(key):
        def f(self, *a, **k):
            counts[key, type(getattr(self, "module", None) or getattr(self, "state", None)
                             or self).__name__] += 1
            return real[key](self, *a, **k)
        return f
    _engine.GraphedState.slow = counting("slow")
    _fast.EagerFast.call = counting("eager_fast")
    _wrap.DirectCall.__call__ = counting("direct")
    try:
        for m in g.modules():  # (the bound method each DirectCall installed: made again)
            dc = m.__dict__.get("_compiled_call_impl")
            if isinstance(getattr(dc, "__self__", None), _wrap.DirectCall):
                dc.__self__.bound = m.__dict__["_compiled_call_impl"] = dc.__self__.__call__
        with torch.enable_grad():
            for _ in range(10):
                g(x)
    finally:
        _engine.GraphedState.slow = real["slow"]
        _fast.EagerFast.call = real["eager_fast"]
        _wrap.DirectCall.__call__ = real["direct"]
        for m in g.modules():
            dc = m.__dict__.get("_compiled_call_impl")
            if isinstance(getattr(dc, "__self__", None), _wrap.DirectCall):
                dc.__self__.bound = m.__dict__["_compiled_call_impl"] = dc.__self__.__call__
    print(name, "per call:", {f"{k}:{t}": v / 10 for (k, t), v in sorted(counts.items())})
    e = best["eager"]
    print(name, ", ".join(f"{k} {v:.0f} µs ({v / e:.3f}x)" for k, v in best.items()))
