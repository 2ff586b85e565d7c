"""Calls graphed at 79b2f55 that run eagerly on ``percall`` (loud regressions L1-L3 of
tests/test_review_percall2.py): F2 removed the "__eq__ and __hash__ of its own" rule from
_signature.is_opaque too, so a top-level argument whose type pytree does not list in
SUPPORTED_NODES (a NamedTuple), a frozenset, a numpy scalar is opaque; and a numpy scalar or
dtype module attribute (no __dict__) is unwatchable: the whole forward runs eagerly.
Each: 4 calls; FAIL where any call ran eagerly (the results are eager's either way: checked).
  [finding] L1 typing.NamedTuple / collections.namedtuple argument (of a tensor and a float);
  [finding] L2 numpy.int64 / numpy.float32 / frozenset argument;
  [finding] L3 numpy.float32 / numpy.dtype module attribute;
  [control] torch.Size, Enum, torch.dtype, str, tuple argument graphed; INFO per-call host
            time of a graphed call with five int/bool/None keywords (the fast path's _mixed_ok).
Run from the repository root: python3 .ci/review/percall2/c_loud.py
"""
import collections
import copy
import enum
import os
import sys
import time
import typing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("c_loud.py")
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphify as cg  # noqa: E402

N = 4096


class NT(typing.NamedTuple):
    a: torch.Tensor
    s: float


CT = collections.namedtuple("CT", "a s")


class Mode(enum.Enum):
    A = 1


def first2(p):
    return p[0] * 2


def times(x, s):
    return x * (len(s) if isinstance(s, frozenset) else 2)


def graphed(label, name, g, f, make):
    def body():
        for _ in range(4):
            x = torch.randn(N, device=C.DEV)
            ok, why = C.same(g(*make(x)), f(*make(x)))
            if not ok:
                return False, why
        s = cg.stats(g)
        return s.eager == 0 and s.captures >= 1, f"not graphed: {C.stats_line(g)}"
    C.guarded(label, name, body)


class NpAttr(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.v = v

    def forward(self, x):
        return self.lin(x) * (2.0 if self.v is not None else 1.0)  # (reads self.v)


def module_graphed(name, v):
    def body():
        torch.manual_seed(0)
        ref = NpAttr(v).to(C.DEV).eval()
        g = cg.graphify(copy.deepcopy(ref))
        with torch.no_grad():
            for _ in range(4):
                x = torch.randn(8, 64, device=C.DEV)
                ok, why = C.same(g(x), ref(x))
                if not ok:
                    return False, why
        s = cg.stats(g)
        return s.eager == 0 and s.captures >= 1, f"not graphed: {C.stats_line(g)}"
    C.guarded("finding", name, body)


def kw(x, a=0, b=False, c=None, d=3, e=True):
    return x * 2


if __name__ == "__main__":
    graphed("finding", "L1 typing.NamedTuple argument", cg.graphify(first2), first2,
            lambda x: (NT(x, 0.5),))
    graphed("finding", "L1 collections.namedtuple argument", cg.graphify(first2), first2,
            lambda x: (CT(x, 0.5),))
    for v in (np.int64(3), np.float32(0.5), frozenset({1, 2})):
        graphed("finding", f"L2 {type(v).__name__} argument", cg.graphify(times), times,
                lambda x, v=v: (x, v))
    module_graphed("L3 numpy.float32 module attribute", np.float32(0.5))
    module_graphed("L3 numpy.dtype module attribute", np.dtype("float32"))
    for v in (torch.Size([2, 3]), Mode.A, torch.float16, "s", (1, 2.5, None)):
        graphed("control", f"{type(v).__name__} argument graphed", cg.graphify(times), times,
                lambda x, v=v: (x, v))
    g = cg.graphify(kw)
    x = torch.randn(N, device=C.DEV)
    with torch.no_grad():
        for _ in range(5):
            g(x, a=0, b=False, c=None, d=3, e=True)
        C.sync_all()
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            g(x, a=0, b=False, c=None, d=3, e=True)
        C.sync_all()
    C.info(f"graphed call with 5 int/bool/None keywords: "
           f"{(time.perf_counter() - t0) / n * 1e6:.1f} us per call ({C.stats_line(g)})")
    C.finish("c_loud.py")
