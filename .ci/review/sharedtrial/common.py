"""Shared set-up of the shared-trial review scripts (a second training graph shares its busy
twin's trial). One line per check: PASS/FAIL/INFO/SKIP. ``REVIEW_SIM=1``: a dry run on the CPU
test double with the host clock (not a GPU result)."""
import copy
import os
import sys
import time
import warnings

import torch
from torch import nn

SIM = os.environ.get("REVIEW_SIM") == "1"
if not torch.cuda.is_available() and not SIM:
    print(f"SKIP {os.path.basename(sys.argv[0])}: needs a CUDA GPU")
    sys.exit(0)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
import cudagraphify as cg  # noqa: E402
from cudagraphify import _capture, _trial  # noqa: E402

DEV = torch.device("cpu" if SIM else "cuda")
if SIM:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../tests"))
    from conftest import SimBackend  # noqa: E402
    _b = SimBackend()
    _b.clock = lambda device: time.perf_counter
    _capture.set_backend(_b)
    torch.cuda.synchronize = lambda *a: None
warnings.simplefilter("ignore")
TOL = dict(rtol=2e-5, atol=2e-6)  # a graphed backward may differ from eager's by an ulp
GIVE = "piece given back: forced by the review script (its graph costs more)"
FORCE = {"verdict": None}  # None: the real verdict; "give": give back; "keep": keep


_real_verdict = _trial.Trial.verdict


def _verdict(self):
    if FORCE["verdict"] == "give":
        return GIVE
    if FORCE["verdict"] == "keep":
        return None
    return _real_verdict(self)


_trial.Trial.verdict = _verdict  # (the script's own process only: the library is untouched)


def report(ok, what, detail=""):
    print(f"PASS {what}" if ok else f"FAIL {what}: {detail}", flush=True)


def info(what):
    print(f"INFO {what}", flush=True)


def check(what, fn):
    try:
        detail = fn()
    except Exception as e:  # noqa: BLE001
        detail = f"{type(e).__name__}: {str(e)[:300]}"
    report(detail is None, what, detail or "")


class Block(nn.Module):
    def __init__(self, d=256):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Root(nn.Module):
    """A host sync between two blocks: piecewise, ``a`` and ``b`` graphed as pieces."""

    def __init__(self, d=256):
        super().__init__()
        self.a, self.b = Block(d), Block(d)

    def forward(self, x):
        y = self.a(x)
        if bool((y > -1e9).all()):  # a host sync
            y = y + 1
        return self.b(y)


def pair(cls=Root, seed=0, **kw):
    torch.manual_seed(seed)
    ref = cls().to(DEV)
    return ref, cg.graphify(copy.deepcopy(ref), **kw)


def state(m):
    return m.__dict__.get("_cudagraphify_state")


def pieces(g):
    return [g.a, g.b]


def on_trial(st):
    return [e for e in st.cache.graphs() if getattr(e, "trial", None) is not None]


def grads_close(g, ref):
    for (n, p), q in zip(g.named_parameters(), ref.parameters()):
        if (p.grad is None) != (q.grad is None):
            return f"{n}: .grad None on one side"
        if p.grad is not None and not torch.allclose(p.grad, q.grad, **TOL):
            return f"{n}: max diff {(p.grad - q.grad).abs().max().item():.3g}"
    return None


def x_(n=16, d=256, grad=False):
    return torch.randn(n, d, device=DEV, requires_grad=grad)
