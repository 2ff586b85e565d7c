"""Shared bits of the hunt-8c review's GPU scripts (of 3ca76f2: the probe refuses a forward's
read of ``_probe.COPY_READS`` on a copied argument's memory by code outside torch, and a
static's ``_version``; CPU reproductions in tests/test_review_hunt8c.py).

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

N, D = 8, 64  # the argument's shape


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x):
        return x * self.w + 0.5


class Net(nn.Module):
    """Elementwise only (bitwise equal to eager); ``pred(x, *rest)`` picks the root's branch."""

    def __init__(self, pred):
        super().__init__()
        self.inner = Inner()
        self.pred = pred

    def forward(self, x, *rest):
        h = self.inner(x)
        if self.pred(x, *rest):
            return h * 2
        return h + 1


def twins(pred, fn=False):
    """(graphified, eager) from one seed; ``fn``: a plain function around the module."""
    import cudagraphify as cg
    torch.manual_seed(0)
    ref = Net(pred).to(DEV)
    net = copy.deepcopy(ref)
    if fn:
        def forward(*a):
            return net(*a)
        return cg.graphify(forward), ref
    return cg.graphify(net), ref


def fresh():
    return (torch.randn(N, D, device=DEV),)


def misaligned():  # (offset 1 float: data_ptr % 16 == 4)
    return (torch.randn(N * D + 1, device=DEV)[1:].view(N, D),)


def offset():
    return (torch.randn(N * D + 16, device=DEV)[16:].view(N, D),)


def calls(g, ref, first, later, grad=False, n_first=3, n_later=2):
    """(ok, why, replays after the change): ``first()`` ``n_first`` times, then ``later()``;
    each call's arguments passed to both, compared bitwise."""
    import cudagraphify as cg
    ctx = torch.enable_grad if grad else torch.no_grad
    after = 0
    for i in range(n_first + n_later):
        torch.manual_seed(i)
        args = (first if i < n_first else later)()
        r0 = cg.stats(g).replays
        with ctx():
            a, b = g(*args), ref(*args)
        sync_all()
        if i >= n_first:
            after += cg.stats(g).replays - r0
        ok, why = same(a.detach(), b.detach())
        if not ok:
            return False, (f"call {i} ({'later' if i >= n_first else 'first'}, replayed "
                           f"{cg.stats(g).replays - r0}): {why} ({stats_line(g)})"), after
    return True, stats_line(g), after


def refused(g, op: str) -> bool:
    import cudagraphify as cg
    return any(f"{op} [PYTHON_STATE]" in k for k in cg.stats(g).eager_calls)
