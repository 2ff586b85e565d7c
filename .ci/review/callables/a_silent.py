"""Silent differences from eager that d3132f3 leaves (S1-S3 of tests/test_review_callables.py),
against an eager twin; Linear 256 wide, no_grad, the change after three calls.
  [finding] S1 a lambda with a default-argument binding (``lambda t, cfg=cfg: ...``), its dict
            changed; a mutable default (``def post(t, _state={...})``); ``__kwdefaults__``
            (a function's defaults are not watched: _guards._watch_callable);
  [finding] S2 a bound method whose function closes over a dict (only ``__self__`` watched);
  [finding] S3 ``object.__getattribute__(self, "__dict__")["scale"]`` and
            ``self.__getstate__()["scale"]`` then ``m.scale = 0.25`` (not recorded);
  [control] the same dict in a closure; a plain function's closure; ``vars(self)["scale"]``,
            ``getattr(self, "__dict__")``, a helper reading ``m.__dict__``.
Run from the repository root: python3 .ci/review/callables/a_silent.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("a_silent.py")
from torch import nn  # noqa: E402

W = C.W


class Post(nn.Module):
    def __init__(self, post):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.post = post

    def forward(self, x):
        return self.post(self.lin(x))


def default_binding():
    cfg = {"temperature": 1.0}
    return lambda t, cfg=cfg: t / cfg["temperature"]


def mutable_default():
    def post(t, _state={"temperature": 1.0}):  # noqa: B006
        return t / _state["temperature"]
    return post


def kwdefaults():
    def post(t, *, temperature=1.0):
        return t / temperature
    return post


def closure():
    cfg = {"temperature": 1.0}
    return lambda t: t / cfg["temperature"]


def factory_method():
    state = {"temperature": 1.0}

    class Sched:
        def scale(self, t):
            return t / state["temperature"]
    return Sched().scale


def plain_function():
    state = {"temperature": 1.0}

    def scale(t):
        return t / state["temperature"]
    return scale


def set_default(m, i):
    m.post.__defaults__[0]["temperature"] = 0.25


def set_kwdefault(m, i):
    m.post.__kwdefaults__["temperature"] = 0.25


def set_closure(m, i):
    m.post.__closure__[0].cell_contents["temperature"] = 0.25


def set_method_closure(m, i):
    m.post.__func__.__closure__[0].cell_contents["temperature"] = 0.25


def helper(m):
    return m.__dict__["scale"]


class DictRead(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.scale = 1.0
        self.how = how

    def forward(self, x):
        h = self.how
        if h == "object_getattribute":
            s = object.__getattribute__(self, "__dict__")["scale"]
        elif h == "getstate":
            s = self.__getstate__()["scale"]
        elif h == "getattr":
            s = getattr(self, "__dict__")["scale"]
        elif h == "helper":
            s = helper(self)
        else:
            s = vars(self)["scale"]
        return self.lin(x) * s


def set_scale(m, i):
    m.scale = 0.25


def case(label, name, make, change):
    ok, why, g = C.twin_run(make, change)
    C.check(ok, f"[{label}] {name}", why + " " + C.stats_line(g))
    C.info(f"{name}: {C.stats_line(g)}")


if __name__ == "__main__":
    case("finding", "S1 lambda default-argument binding, its dict changed",
         lambda: Post(default_binding()), set_default)
    case("finding", "S1 mutable default argument changed", lambda: Post(mutable_default()),
         set_default)
    case("finding", "S1 __kwdefaults__ changed", lambda: Post(kwdefaults()), set_kwdefault)
    case("finding", "S2 bound method whose function closes over a dict, dict changed",
         lambda: Post(factory_method()), set_method_closure)
    case("documented", "S3 (README; expected FAIL) object.__getattribute__(self, '__dict__') "
         "read, m.scale set", lambda: DictRead("object_getattribute"), set_scale)
    case("documented", "S3 (README; expected FAIL) self.__getstate__() read, m.scale set",
         lambda: DictRead("getstate"), set_scale)
    case("control", "same dict in a closure, changed", lambda: Post(closure()), set_closure)
    case("control", "plain function's closure dict changed", lambda: Post(plain_function()),
         set_closure)
    for how in ("vars", "getattr", "helper"):
        case("control", f"__dict__ read via {how}, m.scale set", lambda h=how: DictRead(h),
             set_scale)
    C.finish("a_silent.py")
