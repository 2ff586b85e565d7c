"""Shared set-up of the trial2 review scripts (fast-grad2: 6d1d94d, cec1945, b6cc670). One
line per check: PASS/FAIL/SKIP/INFO, tagged [finding ...] or [control]. ``REVIEW_SIM=1``: a dry
run on the CPU test double (tests/conftest.py); not a GPU result. See
tests/test_review_trial2.py."""
import os
import sys
import warnings

import torch
from torch import nn

SIM = os.environ.get("REVIEW_SIM") == "1"
if not torch.cuda.is_available() and not SIM:
    print(f"SKIP {os.path.basename(sys.argv[0])}: needs a CUDA GPU")
    sys.exit(0)

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "../../.."))
import cudagraphify as cg  # noqa: E402
from cudagraphify import _capture  # noqa: E402

DEV = torch.device("cpu" if SIM else "cuda")
if SIM:
    sys.path.insert(0, os.path.join(_HERE, "../../../tests"))
    from conftest import SimBackend  # noqa: E402
    _capture.set_backend(SimBackend())
    torch.cuda.synchronize = lambda *a: None
warnings.simplefilter("ignore")


def report(ok: bool, what: str, detail: str = "") -> None:
    print(f"PASS {what}" if ok else f"FAIL {what}: {detail}", flush=True)


def check(what: str, fn) -> None:
    """Run ``fn`` (returns None or a failure detail); an exception is a FAIL."""
    try:
        detail = fn()
    except Exception as e:  # noqa: BLE001
        detail = f"{type(e).__name__}: {str(e)[:300]}"
    report(detail is None, what, detail or "")


def sync():
    if not SIM:
        torch.cuda.synchronize()


def twins(make, **kw):
    """(eager module, graphed twin with the same weights: the same seed, no load_state_dict,
    which would move the twin's version counters) on DEV."""
    torch.manual_seed(0)
    ref = make().to(DEV)
    torch.manual_seed(0)
    g = make().to(DEV)
    return ref, cg.graphify(g, **kw)


def randn(*shape):
    return torch.randn(*shape, device=DEV)


def bump(t, v) -> None:
    with torch.no_grad():
        t.add_(v)


def grads_equal(ref, g):
    """None, or the first parameter whose gradient differs bitwise."""
    for (n, p), q in zip(ref.named_parameters(), g.parameters()):
        if (p.grad is None) != (q.grad is None) or (p.grad is not None
                                                    and not torch.equal(p.grad, q.grad)):
            return f"gradient of {n} differs"
    return None


def eager(g) -> str:
    reasons = dict(cg.stats(g).eager_calls)
    return next(iter(reasons), "")[:160] if reasons else "(none)"


def stats(g) -> str:
    s = cg.stats(g)
    return f"captures={s.captures} replays={s.replays} eager={eager(g)!r}"
