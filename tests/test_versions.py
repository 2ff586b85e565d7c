"""Version counters of the tensors a graph writes and autograd saves (cudagraphify/_versions.py).

After each call every version counter the user can see has moved as eager's would, and a
backward raises "modified by an inplace operation" exactly where eager's does.

CPU, on the simulated backend (``sim``, tests/conftest.py); each check compares with an eager
twin (outcome, outputs, gradients, buffers bitwise, and ``_version``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from test_review_inflight2 import _same_as_eager, _twins


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _same_versions(ref, g, *names):
    """An ``extra`` for ``_same_as_eager``: the named tensors' versions are eager's. Set to
    eager's first (``load_state_dict`` in ``_twins`` moved the graphed twin's)."""
    for name in names:
        _set_version(_get(g, name), _get(ref, name)._version)

    def check(ref, g, step):
        for name in names:
            a, b = _get(ref, name), _get(g, name)
            assert a._version == b._version, (step, name, a._version, b._version)
    return check


def _set_version(t, version):
    torch._C._autograd._unsafe_set_version_counter((t,), (version,))


def _get(m, path):
    for part in path.split("."):
        m = getattr(m, part)
    return m


# -- modules ------------------------------------------------------------------------------------

class _DataView(nn.Module):
    """A buffer registered as a view of another's ``.data``: one memory, two counters; forward
    writes the view and autograd saves the other half of the base (through a view of it)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("base", torch.ones(8))
        self.register_buffer("lo", self.base.data[:4])

    def forward(self, x):
        self.lo.mul_(0.5)
        return self.lin(x) * self.base[4:]


# -- what autograd saves ------------------------------------------------------------------------

@pytest.mark.parametrize("shapes", [(3,), (3, 3), (3, 5)])
def test_a_view_of_the_data_written_besides_a_saved_base(sim, shapes):
    """``lo`` (a view of ``base.data``: a counter of its own) written, ``base`` saved: eager
    raises for neither a second forward nor a replay."""
    ref, g = _twins(_DataView, warm=(3, 5))
    _same_as_eager(ref, g, shapes, extra=_same_versions(ref, g, "base", "lo"))
