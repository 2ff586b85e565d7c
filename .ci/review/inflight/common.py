"""Shared set-up of the in-flight review scripts (review of d62294e: a second training graph of
a signature while the first waits for its backward). One line per check: PASS/FAIL/SKIP.
``REVIEW_SIM=1``: a dry run of a script on the CPU test double (tests/conftest.py); not a GPU
result (pools are not modelled there)."""
import copy
import os
import sys
import warnings

import torch
from torch import nn

SIM = os.environ.get("REVIEW_SIM") == "1"
if not torch.cuda.is_available() and not SIM:
    print(f"SKIP {os.path.basename(sys.argv[0])}: needs a CUDA GPU")
    sys.exit(0)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
import cudagraphify as cg  # noqa: E402
from cudagraphify import _capture  # noqa: E402
from cudagraphify.bench.models import GPT  # noqa: E402

DEV = torch.device("cpu" if SIM else "cuda")
if SIM:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../tests"))
    from conftest import SimBackend  # noqa: E402
    _capture.set_backend(SimBackend())
    torch.cuda.synchronize = lambda *a: None
warnings.simplefilter("ignore")
TOL = dict(rtol=2e-5, atol=2e-6)  # a graphed backward may differ from eager's by an ulp
PENDING = "has not run yet"


def report(ok: bool, what: str, detail: str = "") -> None:
    print(f"PASS {what}" if ok else f"FAIL {what}: {detail}", flush=True)


def check(what: str, fn) -> None:
    """Run ``fn`` (returns None or a failure detail); an exception is a FAIL."""
    try:
        detail = fn()
    except Exception as e:  # noqa: BLE001
        detail = f"{type(e).__name__}: {str(e)[:300]}"
    report(detail is None, what, detail or "")


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 64)).to(DEV)


def gpt(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return GPT(256, 4, 4, dropout=dropout).to(DEV)


def pair(make, **kw):
    ref = make()
    return ref, cg.graphify(copy.deepcopy(ref), **kw)


def grads_close(g, ref, exact=False):
    """None, or which parameter's gradient differs."""
    for (n, p), q in zip(g.named_parameters(), ref.parameters()):
        if (p.grad is None) != (q.grad is None):
            return f"{n}: .grad None on one side"
        if p.grad is None:
            continue
        if exact and not torch.equal(p.grad, q.grad):
            return f"{n}: not bitwise equal"
        if not torch.allclose(p.grad, q.grad, **TOL):
            return f"{n}: max diff {(p.grad - q.grad).abs().max().item():.3g}"
    return None


def pending_calls(g) -> int:
    return sum(n for r, n in cg.stats(g).eager_calls.items() if PENDING in r)
