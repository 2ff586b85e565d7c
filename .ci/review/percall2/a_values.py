"""Values keyed or watched by ``==`` where the forward sees more (findings S1-S4, S6 of
tests/test_review_percall2.py), against eager. Each: three calls with the first value (warm-up,
capture, replay), then the changed one.
  [finding] S1 numpy.float64 argument 0.0 -> -0.0 (strict_key's (type, value) fallback);
  [finding] S1 numpy.float64 module attribute 0.0 -> -0.0 (_watch.same);
  [finding] S2 range(0, 1) -> range(0, 2, 5) argument, the forward reads r.stop;
  [finding] S3 frozen dataclass argument, a list set in __post_init__ changed in place;
  [finding] S3 a frozen dataclass's (plain) subclass, an extra attribute changed: argument,
            and module attribute;
  [finding] S4 frozen dataclass field changed with object.__setattr__: argument, module attr;
  [finding] S6 float nan -> -nan argument (torch.signbit);
  [control] float argument 0.0 -> -0.0; frozen dataclass dataclasses.replace'd; a tuple
            (2,) -> (2.0,) keyword on the fast path.
Run from the repository root: python3 .ci/review/percall2/a_values.py
"""
import copy
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("a_values.py")
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphify as cg  # noqa: E402

N = 4096


def arg_case(label, name, f, values, change=None):
    """``f(x, v)`` graphed against eager for the values in turn (``change(i)`` before call i)."""
    def body():
        g = cg.graphify(f)
        for i, v in enumerate(values):
            if change is not None:
                change(i)
            x = torch.randn(N, device=C.DEV)
            got, want = g(x, v), f(x, v)
            C.sync_all()
            ok, why = C.same(got, want)
            if not ok:
                return False, f"call {i}: {why} {C.stats_line(g)}"
        C.info(f"{name}: {C.stats_line(g)}")
        return True, ""
    C.guarded(label, name, body)


def module_case(label, name, make, change):
    def body():
        torch.manual_seed(0)
        ref = make().to(C.DEV).eval()
        g = cg.graphify(copy.deepcopy(ref))
        with torch.no_grad():
            for i in range(6):
                if i == 3:
                    for m in (g, ref):
                        change(m)
                x = torch.randn(8, 64, device=C.DEV)
                got, want = g(x), ref(x)
                C.sync_all()
                ok, why = C.same(got, want)
                if not ok:
                    return False, f"call {i}: {why} {C.stats_line(g)}"
        C.info(f"{name}: {C.stats_line(g)}")
        return True, ""
    C.guarded(label, name, body)


def recip(x, s):
    return 1 / (x.abs() * s)


def stop(x, r):
    return x * r.stop


@dataclasses.dataclass(frozen=True)
class Table:
    n: int

    def __post_init__(self):
        object.__setattr__(self, "w", [1.0] * self.n)


@dataclasses.dataclass(frozen=True)
class Cfg:
    slope: float = 0.1


class SubCfg(Cfg):
    pass


class NpScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.s = np.float64(0.0)

    def forward(self, x):
        return 1 / (self.lin(x) * self.s)


class UsesCfg(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.cfg = cfg

    def forward(self, x):
        return self.lin(x) * self.cfg.slope + getattr(self.cfg, "gain", 0.0)


def fill_kw(x, shape=(2,)):
    return x * 2, torch.full((3,), shape[0], device=x.device)


if __name__ == "__main__":
    arg_case("finding", "S1 np.float64 argument 0.0 -> -0.0", recip,
             [np.float64(v) for v in (0.0, 0.0, 0.0, -0.0, -0.0)])

    def np_neg(m):
        m.s = np.float64(-0.0)
    module_case("finding", "S1 np.float64 module attribute 0.0 -> -0.0", NpScale, np_neg)
    arg_case("finding", "S2 range(0,1) -> range(0,2,5), forward reads r.stop", stop,
             [range(0, 1)] * 3 + [range(0, 2, 5)])
    t = Table(2)

    def bump_table(i):
        if i == 3:
            t.w[0] = 5.0
    arg_case("finding", "S3 frozen dataclass argument, __post_init__ list changed",
             lambda x, tb: x * tb.w[0], [t] * 5, bump_table)
    sub = SubCfg(0.1)
    sub.gain = 2.0

    def bump_sub(i):
        if i == 3:
            sub.gain = 3.0
    arg_case("finding", "S3 frozen dataclass subclass argument, extra attribute changed",
             lambda x, c: x * c.gain + c.slope, [sub] * 5, bump_sub)

    def sub_cfg():
        c = SubCfg(0.1)
        c.gain = 1.0
        return UsesCfg(c)

    def gain2(m):
        m.cfg.gain = 2.0
    module_case("finding", "S3 frozen dataclass subclass module attribute, extra attribute",
                sub_cfg, gain2)
    cfg = Cfg(0.1)

    def set_cfg(i):
        if i == 3:
            object.__setattr__(cfg, "slope", 0.5)
    arg_case("finding", "S4 frozen dataclass argument, object.__setattr__ on a field",
             lambda x, c: x * c.slope, [cfg] * 5, set_cfg)
    module_case("documented", "S4 frozen dataclass module attribute, object.__setattr__ "
                "(README Limitations: expected FAIL)",
                lambda: UsesCfg(Cfg(0.1)), lambda m: object.__setattr__(m.cfg, "slope", 0.5))
    nan = float("nan")
    arg_case("finding", "S6 float argument nan -> -nan (signbit)",
             lambda x, s: torch.signbit(x * 0 + s).float(), [nan] * 3 + [-nan] * 2)
    arg_case("control", "float argument 0.0 -> -0.0", recip, [0.0] * 3 + [-0.0] * 2)
    cfgs = [Cfg(0.1)] * 3 + [dataclasses.replace(Cfg(0.1), slope=0.5)] * 2
    arg_case("control", "frozen dataclass argument, dataclasses.replace",
             lambda x, c: x * c.slope, cfgs)

    def kw_body():
        g = cg.graphify(fill_kw)
        for i, s in enumerate([(2,)] * 3 + [(2.0,), (True,), (2,)]):
            x = torch.randn(N, device=C.DEV)
            for u, v in zip(g(x, shape=s), fill_kw(x, shape=s)):
                ok, why = C.same(u, v)
                if not ok:
                    return False, f"call {i}: {why}"
        return True, ""
    C.guarded("control", "keyword tuple (2,) -> (2.0,) -> (True,) on the fast path", kw_body)
    C.finish("a_values.py")
