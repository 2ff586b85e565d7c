"""Review of the ``speed`` branch (64a3f1f..HEAD): segments' compiled member checks, their timing
trial, DirectCall inside a graphed run, and ``GraphRegion.owned_outputs``. CPU, simulated
backend (tests/conftest.py), bitwise against an eager twin. The tests marked "review finding N"
failed before their fix (strict xfails); the others document behaviour checked."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudagraphify as cg

from test_segments_match import _NOW, _Timed  # (the test clock and its model)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _graphed(m):
    return cg.graphify(copy.deepcopy(m))


def _plan(g):
    (plan,) = g._cudagraphify_state.segments.plans()
    return plan


# -- finding 1: views of one another copied out of the graphs' memory lose the conj bit -------

class _ConjPair(nn.Module):
    """Returns a member's output and its conjugate view (one storage, the conj bit on)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))

    def forward(self, x):
        if x.abs().sum().item() > 1e9:  # a host sync: the calls below are one segment
            x = x * 0
        h = (x @ self.w) + 1
        return h, h.conj()


# (review finding 1: fixed; was a strict xfail)
def test_finding1_a_returned_conj_view_keeps_its_conj_bit(segments):
    torch.manual_seed(0)
    m = _ConjPair().eval()
    g = _graphed(m)
    with torch.no_grad():
        for _ in range(4):  # probe, record, two replays
            x = torch.randn(3, 4, dtype=torch.complex64)
            got, want = g(x), m(x)
            assert torch.equal(got[0], want[0])
            assert torch.equal(got[1], want[1])  # fails on the first replay
    assert _plan(g).replays > 0


# -- finding 2: an alias made where the mode does not see it reads a pending segment ----------

class _DLPackRoundTrip(nn.Module):
    """Hands a member's output through DLPack (``to_dlpack``/``from_dlpack`` of a capsule: no
    torch function, no kernel) to the next member."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum().item() > 1e9:  # a host sync
            x = x * 0
        h = self.lin(x)
        t = torch.from_dlpack(torch.utils.dlpack.to_dlpack(h))  # unseen alias of h
        return (t * 2 + 1).relu()


# (review finding 2: fixed; was a strict xfail)
def test_finding2_an_unseen_alias_of_a_members_output_is_not_read_stale(segments):
    torch.manual_seed(0)
    m = _DLPackRoundTrip().eval()
    g = _graphed(m)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, 8)
            assert torch.equal(g(x), m(x))


class _ParameterAlias(_DLPackRoundTrip):
    def forward(self, x):
        if x.sum().item() > 1e9:
            x = x * 0
        h = self.lin(x)
        t = nn.Parameter(h, requires_grad=False)  # Tensor._make_subclass: no torch function
        return (t * 2 + 1).relu()


# (review finding 2: fixed; was a strict xfail)
def test_finding2b_a_parameter_made_of_a_members_output_is_not_read_stale(segments):
    torch.manual_seed(0)
    m = _ParameterAlias().eval()
    g = _graphed(m)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, 8)
            assert torch.equal(g(x), m(x))


# -- finding 3: a given-back plan keeps its graphs' outputs and buffers -----------------------

# (review finding 3: fixed; was a strict xfail)
def test_finding3_segments_given_back_let_go_of_their_memory(segments):
    segments.clock = lambda device: lambda: _NOW[0]
    torch.manual_seed(0)
    m = _Timed().eval()
    g = _graphed(m)
    g.cost = {True: 2.0, False: 1.0}  # the segments cost twice the forward without them
    with torch.no_grad():
        for _ in range(2):  # probe, record
            x = torch.randn(4, 8)
            assert torch.equal(g(x), m(x))
        plan = _plan(g)
        refs = [weakref.ref(t) for seg in plan.segments for outs in seg.outs.values()
                for t in outs]
        refs += [weakref.ref(t) for seg in plan.segments for t in seg.bufs.values()]
        assert refs
        for _ in range(40):  # the trial (pieces settling in the first calls void timings)
            x = torch.randn(4, 8)
            assert torch.equal(g(x), m(x))
            if plan.trial is None:
                break
        assert plan.given_back is not None
        assert g._cudagraphify_state.segments.plans() == [plan]  # (kept: it says given back)
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} of {len(refs)} static outputs/buffers still alive"


def test_segments_given_back_give_eagers_bits_afterwards(segments):
    segments.clock = lambda device: lambda: _NOW[0]
    torch.manual_seed(0)
    m = _Timed().eval()
    g = _graphed(m)
    g.cost = {True: 2.0, False: 1.0}
    with torch.no_grad():
        for _ in range(30):  # (the trial's timings while the pieces settle are voided)
            x = torch.randn(4, 8)
            assert torch.equal(g(x), m(x))
    plan = _plan(g)
    assert plan.given_back is not None and plan.replays == 2 * 3


# -- finding 4: a chained root's outputs that are views of one another come back apart -------

class _ViewPair(nn.Module):
    """Two pieces around a host sync (a piecewise root chained in its implicit region); returns
    the last piece's output and a view of it."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x):
        h = self.norm(x)
        if h.sum().item() > 1e9:
            h = h * 0
        y = self.mlp(h)
        return y, y[1:]


# (review finding 4: fixed; was a strict xfail)
def test_finding4_chained_outputs_that_are_views_of_one_another_stay_views(sim):
    torch.manual_seed(0)
    ref = _ViewPair()
    g = _graphed(ref)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 8)
            got, want = g(x), ref(x)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            got[0].add_(1)
            want[0].add_(1)
            assert torch.equal(got[1], want[1])  # eager's view sees the write
    assert cg.stats(g.mlp).replays > 0


def test_chained_output_returned_twice_is_one_copy(sim):
    class _Twice(_ViewPair):
        def forward(self, x):
            y = super().forward(x)[0]
            return y, y

    torch.manual_seed(0)
    ref = _Twice()
    g = _graphed(ref)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 8)
            got, want = g(x), ref(x)
            assert got[0] is got[1] and torch.equal(got[0], want[0])
            if g._cudagraphify_state._chain is None:
                continue  # (the probe)
            slots = {s.storage.data_ptr() for s in g._cudagraphify_state._chain._slots.values()}
            assert got[0].untyped_storage().data_ptr() not in slots


# -- behaviour checked (not findings) -------------------------------------------------------

class _Kw(nn.Module):
    """Members called with keywords whose order the forward varies (mode ``v``)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x, y):
        v = int(x[0, 0].item())
        h = x @ self.w
        if v == 1:
            h = torch.add(other=y, input=h, alpha=2.0)
        else:
            h = torch.add(input=h, other=y, alpha=2.0)
        return torch.clamp(h, max=3.0, min=-3.0) if v == 1 else torch.clamp(h, min=-3.0, max=3.0)


def _input(v):
    x = torch.randn(4, 8)
    x[0, 0] = v + 0.5
    return x


def test_keywords_in_another_order_match_and_give_eagers_bits(segments):
    torch.manual_seed(0)
    m = _Kw().eval()
    g = _graphed(m)
    with torch.no_grad():
        for k in range(6):
            x, y = _input(1 if k >= 4 else 0), torch.randn(4, 8)
            assert torch.equal(g(x, y), m(x, y))
    plan = _plan(g)
    assert plan.divergences == 0 and plan.replays == 4


class _Kinds(nn.Module):
    """Mode ``v`` swaps one value for an equal one of another type or sign (an int for a float,
    a list for a tuple, a tuple for an int, -0.0 for 0.0)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        v = int(x[0, 0].item())
        h = x @ self.w
        h = h * (2 if v == 1 else 2.0)
        h = torch.sum(h, dim=(1,) if v != 2 else [1], keepdim=True)
        h = F.leaky_relu(h, negative_slope=1 if v == 3 else 1.0)
        h = h + (-0.0 if v == 4 else 0.0)
        h = torch.roll(h, shifts=(1 if v != 5 else (1,)), dims=0)
        return torch.atan2(h, torch.full_like(h, -0.0 if v == 6 else 0.0))


@pytest.mark.parametrize("v", range(1, 7))
def test_values_equal_in_python_but_of_another_type_or_sign_diverge(segments, v):
    torch.manual_seed(0)
    m = _Kinds().eval()
    g = _graphed(m)
    with torch.no_grad():
        for _ in range(4):
            x = _input(0)
            assert torch.equal(g(x), m(x))
        plan = _plan(g)
        assert plan.divergences == 0
        x = _input(v)
        got, want = g(x), m(x)
        assert torch.equal(got, want)
        if v != 6:  # (6: a tensor's value, read by the graph: no divergence needed)
            assert plan.divergences == 1, v


class _ViewsOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum().item() > 1e9:
            x = x * 0
        h = self.lin(x).relu()
        h = h * 2
        return h, h[1:], h


def test_segment_outputs_views_of_one_another_stay_views_of_one_copy(segments):
    torch.manual_seed(0)
    m = _ViewsOut().eval()
    g = _graphed(m)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 8)
            got, want = g(x), m(x)
            assert got[0] is got[2]
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            got[0].add_(1)
            want[0].add_(1)
            assert torch.equal(got[1], want[1])
    assert _plan(g).replays == 2


class _AutocastMid(nn.Module):
    """Switches autocast (CPU, bfloat16) on between two members when mode says so."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        v = int(x[0, 0].item())
        h = x @ self.w
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=v == 1):
            h = h @ self.w
        return (h.float() + 1).tanh()


def test_a_global_state_set_between_members_diverges(segments):
    torch.manual_seed(0)
    m = _AutocastMid().eval()
    g = _graphed(m)
    with torch.no_grad():
        for _ in range(4):
            x = _input(0)
            assert torch.equal(g(x), m(x))
        plan = _plan(g)
        x = _input(1)
        assert torch.equal(g(x), m(x))
        assert plan.divergences == 1
        x = _input(0)
        assert torch.equal(g(x), m(x))


class _Piece(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return F.gelu(self.lin(x))


class _RootWithPieces(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _Piece(), _Piece()

    def forward(self, x):
        h = self.a(x)
        if h.sum().item() > 1e9:
            h = h * 0
        return self.b(h) * 2


def test_pieces_inside_a_segments_run_are_part_of_it_and_the_forward_is_eagers(segments):
    torch.manual_seed(0)
    ref = _RootWithPieces().eval()
    g = _graphed(ref)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x))
    plan = _plan(g)
    assert plan.replays > 0 and plan.divergences == 0
    # the pieces ran inside the segments' runs (their ops are the segments'): no graph of theirs
    # replayed in a segments' run
    names = [c.name for c in plan.calls]
    assert any("linear" in n for n in names), names
