"""A callable kept as a module attribute is held by identity (finding F1 of
tests/test_review_hunt5.py), against an eager twin.

F1: ``self.post = sched.scale`` (a bound method of a plain object), ``self.post = lambda t:
t / cfg["temperature"]``, a lambda over a rebound local, ``self.post =
functools.partial(F.leaky_relu, negative_slope=...)``, a function with an attribute: the
non-tensor values the callable reads when the forward calls it (the bound object's attributes,
closure cells and what a closed-over dict holds, the partial's keywords, the function's
attributes) are kernel scalars baked into the graph; changed after capture, the old graph
replays with the old value.
Checks (Linear 256 wide, no_grad, each change after three calls: warm-up, capture, replay):
  [finding] bound method of a plain object, its attribute changed;
  [finding] lambda over a dict, the dict's value changed;
  [finding] lambda over a local, the local rebound (nonlocal);
  [finding] functools.partial(F.leaky_relu), its keyword changed;
  [finding] function with an attribute, the attribute changed;
  [finding] weakref.ref / weakref.proxy to a plain object kept as attribute, its attribute
            changed (x2);
  [control] a callable object (__call__) kept as the attribute, its attribute changed;
  [control] the plain object kept as the attribute, its method called through it;
  [control] a lambda reading a tensor from a closed-over dict (refused: eager), replaced.
Run from the repository root: python3 .ci/review/hunt5/a_callable_attrs.py
"""
import functools
import os
import sys
import weakref

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("a_callable_attrs.py")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphify as cg  # noqa: E402

W = 256


class Post(nn.Module):
    def __init__(self, post):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.post = post

    def forward(self, x):
        return self.post(self.lin(x))


class Sched:
    def __init__(self):
        self.temperature = 1.0

    def scale(self, t):
        return t / self.temperature


class CallObj(Sched):
    def __call__(self, t):
        return t / self.temperature


class Holds(nn.Module):
    def __init__(self, sched):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.sched = sched

    def forward(self, x):
        return self.sched.scale(self.lin(x))


class Weak(nn.Module):
    def __init__(self, obj, proxy):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.proxy = proxy
        self.owner = weakref.proxy(obj) if proxy else weakref.ref(obj)

    def forward(self, x):
        o = self.owner if self.proxy else self.owner()
        return self.lin(x) / o.temperature


def callables(kind):
    """(graphed callable, eager callable, change(value)) for one kind."""
    if kind in ("bound", "callobj", "holds", "weakref", "weakproxy"):
        a, b = (CallObj(), CallObj()) if kind == "callobj" else (Sched(), Sched())

        def change(v):
            a.temperature = b.temperature = v
        if kind == "bound":
            return a.scale, b.scale, change
        if kind in ("weakref", "weakproxy"):
            return (a, kind == "weakproxy"), (b, kind == "weakproxy"), change
        return a, b, change
    if kind == "dict":
        cfg = {"temperature": 1.0}

        def change(v):
            cfg["temperature"] = v
        return (lambda t: t / cfg["temperature"]), (lambda t: t / cfg["temperature"]), change
    if kind == "local":
        temperature = 1.0

        def change(v):
            nonlocal temperature
            temperature = v
        return (lambda t: t / temperature), (lambda t: t / temperature), change
    if kind == "partial":
        a = functools.partial(F.leaky_relu, negative_slope=1.0)
        b = functools.partial(F.leaky_relu, negative_slope=1.0)

        def change(v):
            a.keywords["negative_slope"] = b.keywords["negative_slope"] = v
        return a, b, change
    if kind == "fattr":
        def fa(t):
            return t / fa.temperature

        def fb(t):
            return t / fb.temperature
        fa.temperature = fb.temperature = 1.0

        def change(v):
            fa.temperature = fb.temperature = v
        return fa, fb, change
    if kind == "tensor":
        q = {"bias": torch.zeros(W, device=C.DEV)}

        def change(v):
            q["bias"] = torch.full((W,), v, device=C.DEV)
        return (lambda t: t + q["bias"]), (lambda t: t + q["bias"]), change
    raise ValueError(kind)


def case(label, name, kind):
    pa, pb, change = callables(kind)
    cls = {"holds": Holds, "weakref": Weak, "weakproxy": Weak}.get(kind, Post)
    pa, pb = (pa, pb) if cls is Weak else ((pa,), (pb,))
    torch.manual_seed(0)
    ref = cls(*pb).to(C.DEV)
    torch.manual_seed(0)
    g = cg.graphify(cls(*pa).to(C.DEV))
    ok, why = True, ""
    with torch.no_grad():
        for i in range(6):
            if i == 3:
                change(0.25)
            x = torch.randn(8, W, device=C.DEV)
            got, want = g(x), ref(x)
            C.sync_all()
            ok, why = C.same(got, want)
            if not ok:
                why = f"call {i}: {why}"
                break
    C.check(ok, f"[{label}] {name}", why + " " + C.stats_line(g))
    C.info(f"{name}: {C.stats_line(g)}")


if __name__ == "__main__":
    case("finding", "bound method of a plain object kept as attribute, its attribute changed",
         "bound")
    case("finding", "lambda over a dict kept as attribute, the dict's value changed", "dict")
    case("finding", "lambda over a local kept as attribute, the local rebound", "local")
    case("finding", "functools.partial(F.leaky_relu) kept as attribute, keyword changed",
         "partial")
    case("finding", "function with an attribute kept as attribute, attribute changed", "fattr")
    case("finding", "weakref.ref to a plain object kept as attribute, its attribute changed",
         "weakref")
    case("finding", "weakref.proxy to a plain object kept as attribute, its attribute changed",
         "weakproxy")
    case("control", "callable object (__call__) kept as attribute, its attribute changed",
         "callobj")
    case("control", "plain object kept as attribute, method called through it", "holds")
    case("control", "lambda reading a tensor from a closed-over dict, tensor replaced", "tensor")
    C.finish("a_callable_attrs.py")
