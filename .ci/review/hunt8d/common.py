"""Shared bits of the hunt-8d review's GPU scripts (of c672b9e + f8c82f7: which tensor leaves
are one object is part of the key, ``_signature.repeated``, checked by the fast path; the probe
refuses Python attributes of a copied argument through a patched ``Tensor.__getattr__`` /
``Tensor.__getattribute__``; CPU reproductions in tests/test_review_hunt8d.py).

Every script: one line per check, ``PASS ...`` / ``FAIL ...: why`` (``INFO`` for numbers),
compared with an eager twin (torch.equal: elementwise ops, the same kernels), ``SKIP`` and
exit 0 without CUDA. ``[finding]`` lines FAIL where the finding holds; ``[control]`` lines
should PASS. DEV=cpu: a smoke test of the scripts' own logic on the CPU double of
tests/conftest.py, whose capture is made to leave the RNG as a CUDA capture does.
"""
import copy
import importlib.util
import os

# (the shared part is the callables review's common.py, loaded under a name of its own; this
# folder's own helpers follow)
_spec = importlib.util.spec_from_file_location("review_common", os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "callables", "common.py"))
_shared = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_shared)
CPU, DEV, FAILS, ROOT, W = _shared.CPU, _shared.DEV, _shared.FAILS, _shared.ROOT, _shared.W
check, finish, info, same = _shared.check, _shared.finish, _shared.info, _shared.same
rng_state, skip_without_cuda = _shared.rng_state, _shared.skip_without_cuda
stats_line, sync_all, twin_run = _shared.stats_line, _shared.sync_all, _shared.twin_run

import torch  # noqa: E402
from torch import nn  # noqa: E402

N, D = 8, 64  # an argument's shape


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x):
        return x * self.w + 0.5


class Net(nn.Module):
    """``body(x, h, *rest)`` after an elementwise inner piece (bitwise equal to eager)."""

    def __init__(self, body):
        super().__init__()
        self.inner = Inner()
        self.body = body

    def forward(self, x, *rest):
        return self.body(x, self.inner(x), *rest)


class Flat(nn.Module):
    """The same without a submodule: replays count the root's graph only."""

    def __init__(self, body):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))
        self.body = body

    def forward(self, x, *rest):
        return self.body(x, x * self.w + 0.5, *rest)


def twins(body, flat=False):
    """(graphified, eager) from one seed."""
    import cudagraphify as cg
    torch.manual_seed(0)
    ref = (Flat if flat else Net)(body).to(DEV)
    return cg.graphify(copy.deepcopy(ref)), ref


def rand():
    return torch.randn(N, D, device=DEV)


def calls(g, ref, make, n, grad=False):
    """Per call (equal to eager bitwise, replays it made), and the first difference's detail;
    ``make(i)`` -> (args, kwargs), passed to both."""
    import cudagraphify as cg
    out, first = [], ""
    ctx = torch.enable_grad if grad else torch.no_grad
    for i in range(n):
        torch.manual_seed(100 + i)
        a, kw = make(i)
        r0 = cg.stats(g).replays
        with ctx():
            got, want = g(*a, **kw), ref(*a, **kw)
        sync_all()
        ok, why = same(got.detach(), want.detach())
        out.append((ok, cg.stats(g).replays - r0))
        if not ok and not first:
            first = f"call {i}: {why}"
    return out, first


def tagged_later(i, at=3, first=None, later=2.0):
    x = rand()
    value = first if i < at else later
    if value is not None:
        x.scale = value
    return (x,), {}


def refused(g, what: str) -> bool:
    import cudagraphify as cg
    return any(f"{what} [PYTHON_STATE]" in k for k in cg.stats(g).eager_calls)
