"""Segments (cudagraphify._segrun): a segment's graph replays as soon as its inputs are all
copied in, not at its last member (``_Segment.launch``), so the GPU runs it while the forward's
Python meets the rest. CPU tests on the simulated backend, whose replay computes at once: an
input copied after the replay would show as a wrong value, and the backend's replay count,
read from the forward between two calls, tells where the replay ran."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg


def _graphed(m):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cg.graphify(copy.deepcopy(m))


def _plan(g):
    (plan,) = g._cudagraphify_state.segments.plans()
    return plan


_WATCHED: list = []  # [backend, [(where, its replay count)]] while a test watches


def _mark(where: str) -> None:
    if _WATCHED:
        _WATCHED[1].append((where, _WATCHED[0].replays))


class _Probe(nn.Module):
    """Two segments around an ``.item()``; the first reads a second input (``y``, copied) at
    its third call, the second copies nothing. :func:`_mark` notes the backend's replay count
    at three points, from the forward's own Python (no torch call; a global, which the
    module's guard does not read)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = 2.0

    def forward(self, x, y):
        a = self.lin(x).relu()
        _mark("before y")
        b = a * 3 + y  # (y: the segment's last copied input)
        _mark("after y")
        c = b.tanh().neg()
        n = 1.0 if b.abs().amax().item() < 1e4 else 0.5  # (a boundary)
        _mark("second segment started")
        d = self.lin(c).sigmoid()
        e = d * self.scale
        return e + n


def _run(m, g, inputs):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x, y in inputs:
            got, want = g(x, y), m(x, y)
            assert torch.equal(got, want), (got - want).abs().max()


def _watched(backend, m, g, inputs) -> list:
    """One call of ``g`` with :func:`_mark` on: where it was, and the replays since the call
    began; its output checked against ``m``'s."""
    seen: list = []
    before = backend.replays
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _WATCHED[:] = [backend, seen]
        try:
            got = g(*inputs)
        finally:
            _WATCHED.clear()
        assert torch.equal(got, m(*inputs))
    return [(where, n - before) for where, n in seen]


def test_the_graph_replays_once_its_last_input_is_copied_in(segments):
    torch.manual_seed(0)
    m = _Probe().eval()
    g = _graphed(m)
    inputs = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(5)]
    _run(m, g, inputs)
    plan = _plan(g)
    assert [s.graph is not None for s in plan.segments] == [True, True]
    first, second = plan.segments
    # the first segment copies x (its first call) and y (at ``a * 3 + y``): it launches there;
    # the second copies nothing: it launches at its first call
    assert first.launch > first.first and first.launch < first.last
    assert plan.calls[first.launch].name.endswith("add")
    assert second.launch == second.first
    before = segments.replays
    assert _watched(segments, m, g, inputs[0]) == [
        ("before y", 0),  # (not yet: y is still to come)
        ("after y", 1),  # (replayed before ``tanh``, ``neg`` and ``abs`` were met)
        ("second segment started", 1)]
    assert segments.replays - before == 2  # (the second: at its first call, ``self.lin``'s)
    assert plan.divergences == 0


def test_inputs_that_change_every_call_come_out_right(segments):
    """Every input differs on every call (y too, copied at the launch point): a replay
    launched before y is copied in would give the last call's values."""
    torch.manual_seed(0)
    m = _Probe().eval()
    g = _graphed(m)
    _run(m, g, [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(8)])
    plan = _plan(g)
    assert plan.replays >= 2 * 5 and plan.divergences == 0


def test_a_call_that_diverges_after_the_launch_gives_eagers_result(segments):
    """The second segment launches at its first call; its last call, ``+ n``, then diverges
    (a new value read on the host): what the graph computed past the launch is not handed
    out, eager's is."""
    torch.manual_seed(0)
    m = _Probe().eval()
    g = _graphed(m)
    inputs = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(4)]
    _run(m, g, inputs)
    plan = _plan(g)
    replays, divergences = plan.replays, plan.divergences
    assert divergences == 0
    _run(m, g, [(torch.randn(4, 8), torch.full((4, 8), 1e5))])  # (n: 0.5)
    assert plan.divergences == 1
    assert plan.replays == replays + 2  # (both launched: the second before ``+ 0.5`` diverged)
    _run(m, g, inputs)  # (and the plan goes on)
    assert plan.divergences == 1 and plan.replays == replays + 2 + 2 * len(inputs)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)

    def forward(self, x, y):
        h = self.fc(self.ln(x))  # (modules answered whole: members)
        h = h + y  # (y copied here: the launch point)
        h = self.fc(h).relu()  # (a member after the launch)
        return h * h.abs().amax().item()


def test_members_answered_whole_around_the_launch_point(segments):
    torch.manual_seed(0)
    m = _Block().eval()
    g = _graphed(m)
    _run(m, g, [(torch.randn(3, 8), torch.randn(3, 8)) for _ in range(6)])
    plan = _plan(g)
    (seg,) = [s for s in plan.segments if s.graph is not None]
    assert seg.first < seg.launch < seg.last
    assert plan.whole > 0 and plan.divergences == 0


def _peek(t):
    """Marked as cudagraphify's own code by the test below: its torch call sees real values
    (the mode replays the pending segment first)."""
    return t.sum()


class _Peeking(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, y):
        a = self.lin(x).relu()
        _peek(a)  # (before the launch: y is still to come)
        b = (a * 3 + y).tanh()
        return b * (1.0 if b.abs().amax().item() < 1e4 else 0.5)


def test_a_segment_replayed_before_its_launch_replays_again_at_it(segments, monkeypatch):
    """An own call (cudagraphify's: it needs real values) before the launch replays the
    segment with y not yet copied in; the segment must replay again at its launch."""
    from cudagraphify import _segcalls
    monkeypatch.setitem(_segcalls._own_codes, _peek.__code__, True)
    torch.manual_seed(0)
    m = _Peeking().eval()
    g = _graphed(m)
    _run(m, g, [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(6)])
    plan = _plan(g)
    (seg,) = [s for s in plan.segments if s.graph is not None]
    assert seg.first < seg.launch and plan.divergences == 0
    before = plan.replays
    _run(m, g, [(torch.randn(4, 8), torch.randn(4, 8))])
    assert plan.replays == before + 2  # (at the peek, and again at the launch)


# -- waits between calls (a weight written on another stream, then waited for) --------------

class _TEvt:
    """A profiler event: name, parent, start time."""

    def __init__(self, name, start, parent=None):
        self.name, self.cpu_parent = name, parent
        self.time_range = type("R", (), {"start": start, "end": start + 1})()


def test_waits_are_placed_between_the_calls_they_came_between():
    from cudagraphify._segmodes import _RANGE, waits
    calls = [_TEvt(_RANGE, t) for t in (10, 20, 30, 40)]
    inside = _TEvt("cudaStreamSynchronize", 21, calls[1])  # (part of call 1: .item())
    canary = _TEvt("cudaStreamWaitEvent", 5)
    assert waits([canary, *calls, inside]) == set()
    assert waits([canary, *calls, _TEvt("cudaStreamWaitEvent", 25)]) == {2}
    assert waits([canary, *calls, _TEvt("cudaEventSynchronize", 15),
                  _TEvt("cuStreamWaitEvent", 45)]) == {1, 4}
    # (another name under a call: not a wait)
    assert waits([canary, *calls, _TEvt("cudaLaunchKernel", 25)]) == set()
    # no wait before the first call, not even the canary's: the profile does not show waits
    assert waits([*calls, _TEvt("cudaStreamWaitEvent", 25)]) is None


@pytest.mark.parametrize("seen", [{5}, None])
def test_a_wait_between_two_calls_moves_the_launch_after_it(segments, monkeypatch, seen):
    """The record saw a wait before call 5 (``.neg()``): the first segment replays there,
    not at ``+ y`` (call 3); a profile that shows no waits: at its last call."""
    from cudagraphify import _segrun
    capture = _segrun.SegmentPlan._capture

    def with_waits(self):
        self.waits = None if seen is None else set(seen)
        capture(self)

    monkeypatch.setattr(_segrun.SegmentPlan, "_capture", with_waits)
    torch.manual_seed(0)
    m = _Probe().eval()
    g = _graphed(m)
    inputs = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(5)]
    _run(m, g, inputs)
    plan = _plan(g)
    first, second = plan.segments
    assert plan.calls[3].name.endswith("add") and plan.calls[5].name.endswith("neg")
    assert first.launch == (5 if seen else first.last)
    assert second.launch == (second.first if seen else second.last)
    assert _watched(segments, m, g, inputs[0]) == [
        ("before y", 0), ("after y", 0), ("second segment started", 1)]
    assert plan.divergences == 0
