"""Shared bits of the fix-7 review's GPU scripts (a17907e..313b2d5: registries watched and the
reason where one is referred to elsewhere, .grad refused, a graph per requires_grad pattern;
CPU reproductions in tests/test_review_fix7.py).

Every script: one line per check, ``PASS ...`` / ``FAIL ...: why`` (``INFO`` for numbers),
compared with an eager twin (torch.equal where the same kernels run), ``SKIP`` and exit 0
without CUDA. ``[finding]`` lines FAIL where the finding holds; ``[control]`` lines should PASS.
DEV=cpu: a smoke test of the scripts' own logic on the CPU double of tests/conftest.py, whose
capture is made to leave the RNG as a CUDA capture does.
"""
import os
import sys
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(_HERE, "..", "..", ".."))
if sys.path[0] != ROOT:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

CPU = os.environ.get("DEV", "cuda") == "cpu"
DEV = "cpu" if CPU else "cuda"
warnings.simplefilter("ignore")
FAILS: list = []


def skip_without_cuda(name: str) -> None:
    if not CPU and not torch.cuda.is_available():
        print(f"SKIP {name}: needs a CUDA GPU (DEV=cpu: a smoke test on the CPU double)",
              flush=True)
        sys.exit(0)


if CPU:
    sys.path.insert(1, os.path.join(ROOT, "tests"))
    from conftest import SimBackend  # noqa: E402
    from cudagraphify import _capture as _cap  # noqa: E402

    class _RngSim(SimBackend):
        def capture(self, fn, device, pool=None, keep_graph=False):
            state = torch.random.get_rng_state()
            try:
                return super().capture(fn, device, pool, keep_graph)
            finally:
                torch.random.set_rng_state(state)

    _cap.set_backend(_RngSim())
    torch.set_num_threads(1)


def check(ok: bool, what: str, detail: str = "") -> None:
    if not ok:
        FAILS.append(what)
    print(f"{'PASS' if ok else 'FAIL'} {what}" + (f": {detail}" if detail and not ok else ""),
          flush=True)


def info(what: str) -> None:
    print(f"INFO {what}", flush=True)


def sync_all() -> None:
    if not CPU:
        torch.cuda.synchronize()


def rng_state() -> torch.Tensor:
    """The generator the device's random kernels draw from (CUDA's on a GPU)."""
    return torch.random.get_rng_state() if CPU else torch.cuda.get_rng_state()


def stats_line(g) -> str:
    import cudagraphify as cg
    s = cg.stats(g)
    return (f"captures={s.captures} replays={s.replays} eager={s.eager} "
            f"reasons={[r[:100] for r in s.eager_calls]}")


def finish(name: str) -> None:
    sync_all()
    info(f"{name}: {len(FAILS)} FAIL line(s)")


def same(got, want) -> tuple:
    """(ok, detail): dtype, shape and values bitwise equal (signs of zeros too)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False, (f"dtype/shape {got.dtype}{tuple(got.shape)} vs eager's "
                       f"{want.dtype}{tuple(want.shape)}")
    if torch.equal(got, want):
        if torch.equal(torch.signbit(got.real), torch.signbit(want.real)):
            return True, ""
        return False, "equal values, but signs of zeros differ from eager's"
    diff = (got - want).abs().max().item() if got.is_floating_point() or got.is_complex() \
        else "n/a"
    return False, f"values differ from eager's (max abs diff {diff})"


def twin_run(make, change=None, n=6, at=3, every=False, width=None):
    """(ok, detail, graphed): ``make()`` graphed against an eager twin built from the same
    seed, ``n`` no_grad calls on fresh inputs; ``change(model, i)`` applied to both at call
    ``at`` (and every later one with ``every``)."""
    import cudagraphify as cg
    torch.manual_seed(0)
    ref = make().to(DEV)
    torch.manual_seed(0)
    g = cg.graphify(make().to(DEV))
    ok, why = True, ""
    with torch.no_grad():
        for i in range(n):
            if change is not None and (i == at or (every and i > at)):
                change(ref, i)
                change(g, i)
            x = torch.randn(8, width or W, device=DEV)
            got, want = g(x), ref(x)
            sync_all()
            ok, why = same(got, want)
            if not ok:
                why = f"call {i}: {why}"
                break
    return ok, why, g


W = 256


def scenario(make, change, before=3, after=3, fresh=False, train=False, shape=(8, 64)):
    """(ok, detail, graphed): ``make()`` graphed beside an eager twin (a deep copy, or built
    again from the same seed with ``fresh``); ``before`` no_grad calls, ``change`` on both,
    ``after`` more. Not ok also where nothing replayed before the change (proves nothing)."""
    import copy
    import cudagraphify as cg
    torch.manual_seed(0)
    ref = make().to(DEV).train(train)
    if fresh:
        torch.manual_seed(0)
        g = make().to(DEV).train(train)
    else:
        g = copy.deepcopy(ref)
    g = cg.graphify(g)
    with torch.no_grad():
        for i in range(before + after):
            if i == before:
                if cg.stats(g).replays < 1:
                    return False, "no replay before the change: " + stats_line(g), g
                change(ref)
                change(g)
            x = torch.randn(*shape, device=DEV)
            got, want = g(x.clone()), ref(x.clone())
            sync_all()
            ok, why = same(got, want)
            if not ok:
                return False, f"call {i}: {why} ({stats_line(g)})", g
    return True, "", g
