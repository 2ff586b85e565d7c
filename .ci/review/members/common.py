"""Shared bits of the members review's GPU scripts (of aad9246: a graphed submodule whose calls
are all members of one graphed segment answered whole, its Python not run; CPU reproductions in
tests/test_review_members.py). The helpers are the callables review's (../callables/common.py),
loaded under a name of their own: one line per check, ``PASS ...`` / ``FAIL ...: why``;
``[finding]`` lines FAIL where the finding holds, ``[control]`` lines should PASS; SKIP and
exit 0 without CUDA. DEV=cpu: a smoke test on the CPU double of tests/conftest.py.

Segments are on (``graphify(m, segments=True)``) and their trial is off (``CudaBackend.clock``
None, as tests/conftest.py does): segments are never given back by time, so the member path is
taken on every replay; each check also says how many module calls were answered whole.
"""
import copy
import importlib.util
import os

_spec = importlib.util.spec_from_file_location("review_callables_common", os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "callables", "common.py"))
_h = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_h)
CPU, DEV = _h.CPU, _h.DEV
check, finish, info, same = _h.check, _h.finish, _h.info, _h.same
skip_without_cuda, sync_all = _h.skip_without_cuda, _h.sync_all

import torch  # noqa: E402
from torch import nn  # noqa: E402

D = 64


def untimed() -> None:
    from cudagraphify import _capture
    _capture.CudaBackend.clock = None


class Elem(nn.Module):
    """An elementwise piece (bitwise equal to eager on a GPU): ``x * w + 0.5``, then ``tail``."""

    def __init__(self, tail=None):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))
        self.tail = tail

    def forward(self, x):
        h = x * self.w + 0.5
        return self.tail(self, h) if self.tail is not None else h


class Host(nn.Module):
    """``inner`` called after a host sync: its calls one graphed segment, it a member."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        h = x.relu()
        h = h * 1 if h.sum().item() > -1e9 else h
        return self.inner(h) + 1


def plan_of(g):
    plans = g._cudagraphify_state.segments.plans()
    return plans[0] if len(plans) == 1 else None


def whole(g) -> int:
    p = plan_of(g)
    return -1 if p is None else p.whole


def twins(m):
    import cudagraphify as cg
    m = m.to(DEV).eval()
    return cg.graphify(copy.deepcopy(m), segments=True), m


def run(g, ref, x, n=1):
    """(ok, why) over ``n`` no_grad calls of both twins with ``x``."""
    for i in range(n):
        with torch.no_grad():
            got, want = g(x), ref(x)
        sync_all()
        ok, why = same(got, want)
        if not ok:
            return False, f"call {i}: {why}"
    return True, ""


def x_of():
    torch.manual_seed(1)
    return torch.randn(8, D, device=DEV)
