"""Shared set-up of the third in-flight review scripts (2653ffc: a training replay's version
moves measured over the capture's run; the statics of modules first met in a call count as
written where the probe saw them written). One line per check: PASS/FAIL/SKIP.
``REVIEW_SIM=1``: a dry run on the CPU test double (tests/conftest.py); not a GPU result."""
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
from cudagraphify import _capture, _fast  # noqa: E402
from cudagraphify.api import _state_of  # noqa: E402

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


def randn(n, d=16, grad=False):
    return torch.randn(n, d, device=DEV, requires_grad=grad)


def twins(make, warm=(8,), warm_backward=True, **kw):
    """(eager module, graphed copy), both through the same first calls."""
    torch.manual_seed(0)
    ref = make().to(DEV)
    g = make().to(DEV)
    g.load_state_dict(ref.state_dict())
    if hasattr(g, "sync_from"):
        g.sync_from(ref)
    g = cg.graphify(g, **kw)
    for n in warm:
        x = randn(n)
        seen = [outcome(lambda m=m: m(x).sum().backward() if warm_backward else m(x))
                for m in (ref, g)]
        if seen[0] != seen[1]:
            raise AssertionError(f"first calls of {n}: eager {seen[0]}, graphed {seen[1]}")
        ref.zero_grad(), g.zero_grad()
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


def same_as_eager(ref, g, shapes, steps=3, extra=None):
    """None, or how the graphed module's calls differ from eager's (raise / no raise, values)."""
    tol = dict(rtol=2e-5, atol=2e-6)
    close = lambda a, b: torch.allclose(a, b, **tol)  # noqa: E731
    for s in range(steps):
        xs = [randn(n) for n in shapes]
        r, w, gr = step(ref, xs)
        o, v, gg = step(g, xs)
        if r != o:
            return f"step {s}: eager {r}, graphed {o}"
        if not all(close(a, b) for a, b in zip(w, v)):
            return f"step {s}: outputs differ"
        if r == "ok" and not all((a is None) == (b is None) and (a is None or close(a, b))
                                 for a, b in zip(gr, gg)):
            return f"step {s}: gradients differ"
        for (n, a), b in zip(ref.named_buffers(), g.buffers()):
            if not close(a.float(), b.float()):
                return f"step {s}: buffer {n} differs"
        if extra is not None:
            d = extra(ref, g, s)
            if d:
                return d
    return None


_SIDE = {}


class OuterBN(nn.Module):
    """Runs a BatchNorm held outside its tree (a plain dict): adopted on the first call."""

    def __init__(self, train=True):
        super().__init__()
        self.lin = nn.Linear(16, 32)
        _SIDE[id(self)] = nn.BatchNorm1d(32).train(train).to(DEV)

    def side(self):
        return _SIDE[id(self)]

    def sync_from(self, other):
        self.side().load_state_dict(other.side().state_dict())

    def forward(self, x):
        return self.side()(self.lin(x))


def outer_bn(train_bn):
    def run():
        ref, g = twins(lambda: OuterBN(train_bn), warm=())
        for s in range(4):
            x = randn(8)
            a, b = ref(x), g(x)
            ra, rb = outcome(lambda: a.sum().backward()), outcome(lambda: b.sum().backward())
            if ra != rb:
                return f"call {s}: eager {ra}, graphed {rb}"
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                if not torch.allclose(getattr(ref.side(), name).float(),
                                      getattr(g.side(), name).float(), rtol=2e-5, atol=2e-6):
                    return f"call {s}: {name} differs from eager's"
            if not torch.allclose(a, b, rtol=2e-5, atol=2e-6):
                return f"call {s}: outputs differ"
        return None
    return run


def fast_installed(as_function, probe):
    def run():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)).to(DEV)
        g = cg.graphify((lambda x: m(x)) if as_function else m, probe=probe)
        with torch.no_grad():
            for _ in range(4):
                g(randn(8))
        if cg.stats(g).replays < 2:
            return f"not replayed: {cg.stats(g).eager_calls}"
        kind = type(_state_of(g)._fast)
        return None if kind is _fast.Fast else f"no fast path ({kind.__name__})"
    return run


class PlainAcc(nn.Module):
    """``acc`` is a plain tensor attribute (no buffer), written in place, then saved by mul."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.acc = torch.ones(16, device=DEV)

    def sync_from(self, other):
        self.acc = other.acc.clone()

    def forward(self, x):
        self.acc.mul_(0.5)
        return self.lin(x) * self.acc


def same_acc(ref, g, s):
    return None if torch.allclose(ref.acc, g.acc) else f"step {s}: acc differs"


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


def first_calls(saved):
    def run():
        torch.manual_seed(0)
        ref, g = FirstCallWrites(saved).to(DEV), FirstCallWrites(saved).to(DEV)
        g.load_state_dict(ref.state_dict())
        g = cg.graphify(g)
        for s in range(3):
            x = randn(8)
            a = outcome(lambda: ref(x).sum().backward())
            b = outcome(lambda: g(x).sum().backward())
            if a != b:
                return f"call {s}: eager {a}, graphed {b}"
            if not torch.equal(ref.tmp, g.tmp):
                return f"call {s}: tmp {g.tmp[0].item()} (eager {ref.tmp[0].item()})"
        return None
    return run
