"""Review of fix-versions (cudagraphify/_versions.py): reproductions against eager twins.

CPU, on the simulated backend (``sim``). The findings (helper-90) failed on the reviewed code and
pass since statics are found again by their slot and the saved ones' counter sharing is checked
(``Counters.resolve``); controls are as they were.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from test_review_inflight2 import _PieceRoot, _outcome, _twins


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _set_version(t, version):
    torch._C._autograd._unsafe_set_version_counter((t,), (version,))


def _get(m, path):
    for part in path.split("."):
        m = getattr(m, part)
    return m


def _align(ref, g, *names):
    for name in names:
        _set_version(_get(g, name), _get(ref, name)._version)


def _between(ref, g, write, steps=3, shapes=(3,)):
    """Forward(s), ``write(m)``, backward: the outcomes of each step, eager's then graphed."""
    out = []
    for step in range(steps):
        xs = [torch.randn(n, 4) for n in shapes]
        seen = []
        for m in (ref, g):
            def go(m=m):
                total = sum(m(x).sum() for x in xs)
                write(m)
                total.backward()
            seen.append(_outcome(go))
            m.zero_grad()
        out.append(tuple(seen))
    return out


# -- modules ------------------------------------------------------------------------------------

class _SharedView(nn.Module):
    """Forward reads ``b`` (autograd saves it); ``v`` is a buffer registered as a view of ``b``
    (one counter), which forward does not use."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("b", torch.ones(4))
        self.register_buffer("v", self.b[:])

    def forward(self, x):
        return self.lin(x) * self.b


def _unshare(m):
    m.v = m.b.data  # the same memory and layout, a counter of its own now


def _write_v(m):
    with torch.no_grad():
        m.v.add_(1)


# -- A: the statics a backward checks are not found again after a rebinding ------------------------

def test_finding_a_rebound_view_no_longer_sharing_a_saved_counter_raises(sim):
    ref, g = _twins(_SharedView, warm=(3,), prep=_unshare)
    # (the graph is dropped at the first call after the rebinding and captured again: the fourth
    # call replays the new one)
    seen = _between(ref, g, _write_v, steps=4)
    assert all(a == b for a, b in seen), seen
    assert cg.stats(g).replays >= 2


def test_control_a_view_sharing_a_saved_counter_raises_as_eager(sim):
    ref, g = _twins(_SharedView, warm=(3,))
    seen = _between(ref, g, _write_v)
    assert all(a == b == "inplace" for a, b in seen), seen
    assert cg.stats(g).replays >= 2


# -- B: a static is found again by its position among the statics, checked only by address ---------

class _Twin(nn.Module):
    """Two buffers over one memory, one layout, two counters (``c`` is ``a.data``); forward
    writes ``a`` and autograd saves it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("a", torch.ones(4))
        self.register_buffer("c", self.a.data)

    def forward(self, x):
        self.a.mul_(0.5)
        return self.lin(x) * self.a


def _reregister(m):
    # the same objects under the same names, in another order among the statics (c, then a):
    # the layouts by position are unchanged
    t = m.a
    del m.a
    m.register_buffer("a", t)


def _write_a(m):
    with torch.no_grad():
        m.a.add_(1)


def test_finding_reordered_alias_buffers_miss_a_raise(sim):
    ref, g = _twins(_Twin, warm=(3, 3), prep=_reregister)
    seen = _between(ref, g, _write_a)
    assert all(a == b for a, b in seen), seen
    assert cg.stats(g).replays >= 2


def test_finding_reordered_alias_buffers_versions(sim):
    ref, g = _twins(_Twin, warm=())
    _align(ref, g, "a", "c")
    for step in range(6):
        if step == 3:
            _reregister(ref), _reregister(g)
        x = torch.randn(3, 4)
        with torch.no_grad():
            assert torch.equal(ref(x), g(x))
        assert (ref.a._version, ref.c._version) == (g.a._version, g.c._version), step
    assert cg.stats(g).replays >= 4


def test_control_twin_buffers_without_reordering(sim):
    ref, g = _twins(_Twin, warm=(3, 3))
    seen = _between(ref, g, _write_a)
    assert all(a == b == "inplace" for a, b in seen), seen
    assert cg.stats(g).replays >= 2


# -- controls that held -------------------------------------------------------------------------

class _WriteAfter(nn.Module):
    """Writes the buffer after autograd saved it: eager's backward always raises."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("s", torch.ones(4))

    def forward(self, x):
        y = self.lin(x) * self.s
        self.s.mul_(0.5)
        return y


def test_control_a_buffer_written_after_it_was_saved(sim):
    ref, g = _twins(_WriteAfter, warm=())
    for step in range(4):
        x = torch.randn(3, 4)
        seen = [_outcome(lambda m=m: m(x).sum().backward()) for m in (ref, g)]
        assert seen[0] == seen[1] == "inplace", (step, seen)


def test_control_a_pieces_inference_replays_move_versions(sim):
    ref, g = _twins(_PieceRoot, warm=())
    _align(ref, g, "s.scale")
    for step in range(5):
        x = torch.randn(3, 4)
        with torch.no_grad():
            assert torch.equal(ref(x), g(x)), step
        assert ref.s.scale._version == g.s.scale._version, step
    assert cg.stats(g).replays >= 3


def test_control_increment_version_counts_repeats():
    t = torch.zeros(2)
    torch._C._increment_version((t, t, t[:1]))
    assert t._version == 3
