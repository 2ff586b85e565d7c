"""Shared set-up of the second in-flight review scripts (2661480: a training replay moves the
version counters of the buffers its forward writes, as measured on the first call). One line per
check: PASS/FAIL/SKIP. ``REVIEW_SIM=1``: a dry run on the CPU test double (tests/conftest.py);
not a GPU result."""
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


def outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except RuntimeError as e:
        return "inplace" if "inplace operation" in str(e) else f"RuntimeError: {str(e)[:160]}"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:160]}"


def randn(n):
    return torch.randn(n, 16, device=DEV)


class Scaled(nn.Module):
    """Writes a buffer in forward, then autograd saves it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("scale", torch.ones(16))

    def forward(self, x):
        self.scale.mul_(0.5)
        return self.lin(x) * self.scale


class FirstCallWrites(nn.Module):
    """The first call writes ``scale``, later ones ``tmp`` (one op, ``out=`` another buffer)."""

    def __init__(self, saved):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("scale", torch.zeros(16))
        self.register_buffer("tmp", torch.zeros(16))
        self.ready, self.saved = False, saved

    def forward(self, x):
        torch.add(self.scale, 0.5, out=self.tmp if self.ready else self.scale)
        self.ready = True
        return self.lin(x) * getattr(self, self.saved)


def twins(make, prep=None, warm=(8,), warm_backward=True, **kw):
    """(eager module, graphed copy), both through the same first calls; None on a mismatch."""
    torch.manual_seed(0)
    ref = make().to(DEV)
    g = make().to(DEV)
    g.load_state_dict(ref.state_dict())
    g = cg.graphify(g, **kw)
    for n in warm:
        x = randn(n)
        seen = [outcome(lambda m=m: m(x).sum().backward() if warm_backward else m(x))
                for m in (ref, g)]
        if seen[0] != seen[1]:
            raise AssertionError(f"first calls of {n}: eager {seen[0]}, graphed {seen[1]}")
        ref.zero_grad(), g.zero_grad()
    if prep is not None:
        prep(ref), prep(g)
    return ref, g


def step(m, xs):
    outs = []

    def go():
        total = 0
        for x in xs:
            o = m(x)
            outs.append(o)
            total = total + o.sum()
        total.backward()

    res = outcome(go)
    grads = [None if p.grad is None else p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    return res, outs, grads


def same_as_eager(ref, g, shapes, steps=3, exact=False):
    """None, or how the graphed module's calls differ from eager's (raise / no raise, values)."""
    tol = dict(rtol=2e-5, atol=2e-6)
    for s in range(steps):
        xs = [randn(n) for n in shapes]
        r, w, gr = step(ref, xs)
        o, v, gg = step(g, xs)
        if r != o:
            return f"step {s}: eager {r}, graphed {o}"
        close = torch.equal if exact else (lambda a, b: torch.allclose(a, b, **tol))
        if not all(close(a, b) for a, b in zip(w, v)):
            return f"step {s}: outputs differ"
        if r == "ok" and not all((a is None) == (b is None) and (a is None or close(a, b))
                                 for a, b in zip(gr, gg)):
            return f"step {s}: gradients differ"
        for (n, a), b in zip(ref.named_buffers(), g.buffers()):
            if not close(a.float(), b.float()):
                return f"step {s}: buffer {n} differs"
    return None
