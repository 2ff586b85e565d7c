"""Shared bits of the hunt-8e review's GPU scripts (of 5dcf40f + f8c82f7's key item
``_signature.repeated``: a tensor passed twice gets one static copy, ``StaticInputs._build``;
CPU reproductions in tests/test_review_hunt8e.py).

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


def untimed() -> None:
    """No timing of pieces or plans against their eager runs (as tests/conftest.py does for
    GPU tests): a piece given back for speed would make the counts depend on the machine."""
    from cudagraphify import _capture
    _capture.CudaBackend.clock = None


class Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x):
        return x * self.w + 0.5


class Body(nn.Module):
    """A value (not an op) that depends on ``x is y``."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x, y):
        return x * self.w * (2.0 if x is y else 3.0) + y


def twin(make, **kw):
    """(graphified deep copy, eager) from one seed, on DEV."""
    import cudagraphify as cg
    torch.manual_seed(0)
    ref = make().to(DEV)
    return cg.graphify(copy.deepcopy(ref), **kw), ref


def rand(*shape):
    return torch.randn(*(shape or (N, D)), device=DEV)


def replays(m) -> int:
    import cudagraphify as cg
    try:
        return cg.stats(m).replays
    except cg.CudagraphifyUsageError:  # (a piece not graphified before its plan's first call)
        return 0
