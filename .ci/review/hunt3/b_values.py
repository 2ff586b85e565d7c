"""Values a replay is keyed or guarded on by ``==`` (findings F2 and F3 of
tests/test_review_hunt3.py), against an eager twin.

F2: a mutable object whose class defines ``__eq__`` and ``__hash__`` (``dataclass(unsafe_hash=
True)``; a frozen dataclass holding a list) is taken for an immutable value: changed in place,
as a module attribute or as an argument passed again, the graph captured with the old value
replays (``F.leaky_relu``'s slope is a kernel scalar, baked in).
F3: ``(2,)`` and ``(2.0,)`` compare equal (``torch.full``'s dtype follows the Python type),
``0.0`` and ``-0.0`` too (the sign of a zero product).
Checks (Linear 256 wide, no_grad, each change after three calls: warm-up, capture, replay):
  [finding] attribute dataclass(unsafe_hash=True) changed in place;
  [finding] attribute frozen dataclass's list changed in place;
  [finding] argument dataclass(unsafe_hash=True) changed in place, passed again;
  [finding] attribute (2,) -> (2.0,) read by torch.full;
  [finding] float attribute 0.0 -> -0.0 (the sign of x * scale);
  [finding] frozen dataclass argument Cfg(2) -> Cfg(2.0) read by torch.full;
  [control] attribute object replaced by a new one; a new argument object each call;
  [control] float argument 0.0 / -0.0; tuple attribute (2,) -> (3,).
Run from the repository root: python3 .ci/review/hunt3/b_values.py
"""
import copy
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("b_values.py")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphify as cg  # noqa: E402

W = 256


@dataclasses.dataclass(unsafe_hash=True)
class HashCfg:
    slope: float = 0.1


@dataclasses.dataclass(frozen=True)
class FrozenList:
    slopes: list = dataclasses.field(default_factory=lambda: [0.1])


@dataclasses.dataclass(frozen=True)
class FrozenFill:
    fill: object


def slope_of(c):
    return c.slope if isinstance(c, HashCfg) else c.slopes[0]


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.cfg = HashCfg()
        self.fill = (2,)
        self.scale = 0.0

    def forward(self, x, cfg=None):
        c = cfg if isinstance(cfg, HashCfg) else self.cfg
        y = F.leaky_relu(self.lin(x), slope_of(c))
        fill = cfg.fill if isinstance(cfg, FrozenFill) else self.fill[0]
        return y, torch.full((4,), fill, device=x.device), x * self.scale


def run(g, ref, calls, arg=lambda i: None):
    """calls: list of (before-call change or None); compares each call's outputs."""
    with torch.no_grad():
        for i, change in enumerate(calls):
            if change is not None:
                change()
            x = torch.randn(8, W, device=C.DEV) - 0.5
            a = arg(i)
            outs = g(x, a), ref(x, a)
            C.sync_all()
            for u, v in zip(*outs):
                ok, why = C.same(u, v)
                if not ok:
                    return False, f"call {i}: {why}"
    return True, ""


def case(label, name, make_change, arg=lambda i: None, init=None):
    torch.manual_seed(0)
    ref = M().to(C.DEV).eval()
    if init is not None:
        init(ref)
    g = cg.graphify(copy.deepcopy(ref))
    ok, why = run(g, ref, [None, None, None, lambda: make_change(g, ref), None, None], arg)
    C.check(ok, f"[{label}] {name}", why + " " + C.stats_line(g))
    C.info(f"{name}: {C.stats_line(g)}")


def both(fn):
    return lambda g, ref: (fn(g), fn(ref))


def set_attr(name, value):
    return both(lambda m: setattr(m, name, value))


if __name__ == "__main__":
    case("finding", "attribute dataclass(unsafe_hash=True) changed in place",
         both(lambda m: setattr(m.cfg, "slope", 0.5)))
    case("finding", "attribute frozen dataclass's list changed in place",
         both(lambda m: m.cfg.slopes.__setitem__(0, 0.5)),
         init=lambda m: setattr(m, "cfg", FrozenList()))
    shared = HashCfg()
    case("finding", "argument dataclass(unsafe_hash=True) changed in place, passed again",
         lambda g, ref: setattr(shared, "slope", 0.5), arg=lambda i: shared)
    case("finding", "attribute (2,) -> (2.0,) read by torch.full", set_attr("fill", (2.0,)))
    case("finding", "float attribute 0.0 -> -0.0 (sign of x * scale)", set_attr("scale", -0.0))
    case("finding", "frozen dataclass argument FrozenFill(2) -> FrozenFill(2.0)",
         lambda g, ref: None, arg=lambda i: FrozenFill(2 if i < 3 else 2.0))
    case("control", "attribute object replaced by a new one", set_attr("cfg", HashCfg(0.5)))
    case("control", "a new argument object each call",
         lambda g, ref: None, arg=lambda i: HashCfg(0.1 if i < 3 else 0.5))
    case("control", "tuple attribute (2,) -> (3,)", set_attr("fill", (3,)))

    def f(x, s):
        return 1 / (x.abs() * s)

    gf = cg.graphify(f)
    ok, why = True, ""
    for i, s in enumerate((0.0, 0.0, 0.0, -0.0, 0.0, -0.0)):
        x = torch.randn(W, device=C.DEV)
        ok, why = C.same(gf(x, s), f(x, s))
        if not ok:
            why = f"call {i}: {why}"
            break
    C.check(ok, "[control] float argument 0.0 / -0.0", why + " " + C.stats_line(gf))
    C.finish("b_values.py")
