"""Pieces that pay (cudagraphify/_trial.py): a piecewise plan's piece is timed against its
eager run on its first calls and given back when its graph costs more.

On the CPU double, with clocks of the test's: the piece's eager forward advances them by
``eager`` and a replay of its graph by ``graph`` (what each costs on a device, here chosen);
the host's clock by ``eager_host`` and ``graph_host`` where a test sets them apart."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _engine, _fast, _region, _trial, _wrap
from conftest import SimGraph

_NOW = [0.0]
_HOST = [0.0]  # the host's clock: until a call returns
_COST = {"eager": 0.0, "graph": 0.0, "eager_host": None, "graph_host": None}


def _spend(kind: str) -> None:
    _NOW[0] += _COST[kind]
    host = _COST[kind + "_host"]
    _HOST[0] += _COST[kind] if host is None else host


class _Piece(nn.Linear):
    def forward(self, x):
        _spend("eager")  # (runs only when the forward's Python runs: eagerly)
        return super().forward(x)


class _Root(nn.Module):
    """A host sync between two pieces: the root runs piecewise, ``a`` and ``b`` graphed."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _Piece(8, 8), _Piece(8, 8)

    def forward(self, x):
        y = self.a(x)
        if bool((y > -1e9).all()):  # a host sync
            y = y + 1
        return self.b(y)


@pytest.fixture
def timed(sim, monkeypatch):
    sim.clock = lambda device: lambda: _NOW[0]
    monkeypatch.setattr(_trial, "host_clock", lambda: _HOST[0])
    # (these tests follow one piece's trial: the root's plan trial, timed after it, is off but
    # in the tests that ask for it, see ``plan_timed``)
    monkeypatch.setattr(_trial, "PLAN_TRIAL", False)
    _COST.update(eager=0.0, graph=0.0, eager_host=None, graph_host=None)
    replay = SimGraph.replay

    def costly(self):
        _spend("graph")
        return replay(self)

    monkeypatch.setattr(SimGraph, "replay", costly)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            yield sim


def _run(graph_cost: float, eager_cost: float, calls: int = 10, **host):
    _COST.update(graph=graph_cost, eager=eager_cost, **host)
    torch.manual_seed(0)
    ref = _Root()
    g = cg.graphify(copy.deepcopy(ref))
    for _ in range(calls):
        x = torch.randn(4, 8)
        assert torch.equal(g(x), ref(x))  # every call: eager's result, graphed or timed
    return g


def test_a_piece_whose_graph_costs_more_is_given_back(timed):
    g = _run(graph_cost=30e-6, eager_cost=10e-6)
    for piece in (g.a, g.b):
        s = cg.stats(piece)
        # call 1: the root's warm-up; 2: each piece's first call (warm-up, capture, and, in
        # the root's implicit region, a replay: timed); 3-7: an eager run and a replay, timed,
        # in turn; then given back: its plain forward is back in place, calls 8-10 are plain
        # PyTorch, not counted (the reason stays)
        assert (s.captures, s.timed_calls, s.graphs) == (1, 3, 0), s
        (why, n), = s.eager_calls.items()
        assert why.startswith("piece given back: its graph costs more than its eager run "
                              "(30 vs 10 µs a call") and n == 0, s
        assert "forward" not in piece.__dict__  # (and no DirectCall: see tests/test_retire.py)
        assert not isinstance(getattr(piece.__dict__.get("_compiled_call_impl"), "__self__",
                                      None), _wrap.DirectCall)
    assert g._cudagraphify_state.given_back is None  # (the root is not a piece)


def test_a_piece_whose_graph_pays_keeps_it_and_replays_fast(timed):
    g = _run(graph_cost=5e-6, eager_cost=50e-6)
    for piece in (g.a, g.b):
        s = cg.stats(piece)
        assert (s.captures, s.timed_calls, s.graphs, s.eager) == (1, 3, 1, 0), s
        assert s.replays == 9 - 3  # calls 2-10 (the capture's replays too), three eager
        assert piece._cudagraphify_state._fast is not None  # the fast path after the trial


def test_a_tie_keeps_the_graph_when_it_costs_less_host_time(timed):
    # within the margin end to end; its replay returns sooner than its forward's launches
    g = _run(graph_cost=10.5e-6, eager_cost=10e-6, graph_host=4e-6, eager_host=9e-6)
    assert cg.stats(g.a).graphs == 1 and cg.stats(g.a).eager == 0


def test_a_tie_that_costs_more_host_time_is_given_back(timed):
    # a one-kernel piece: as fast end to end (its kernel is short), but its copy-in, replay and
    # clone cost more Python than launching the kernel (a tie on both goes to eager too)
    g = _run(graph_cost=9.8e-6, eager_cost=10e-6, graph_host=8e-6, eager_host=5e-6)
    for piece in (g.a, g.b):
        s = cg.stats(piece)
        assert (s.captures, s.timed_calls, s.graphs) == (1, 3, 0), s
        (why, n), = s.eager_calls.items()
        assert why.startswith("piece given back: its graph saves under 10% of its eager run, "
                              "end to end (10 vs 10 µs a call) and on the host (8.0 vs 5.0 µs)"
                              ), why
    assert g._cudagraphify_state._chain_needed() is False  # (nothing left to chain)


def test_the_graph_turn_pays_the_fast_paths_checks(timed, monkeypatch):
    # the same tie as test_a_tie_keeps_the_graph_when_it_costs_less_host_time, but the per-call
    # checks of the fast path (here 6 µs of host time a call) eat what the replay saves: the
    # trial times the graph's turn through them, as every later replay would pay them
    from cudagraphify import _fast
    call, turns = _fast.Fast.call, []

    def checked(self, fn, args, kwargs):
        turns.append(self)
        _HOST[0] += 6e-6
        return call(self, fn, args, kwargs)

    monkeypatch.setattr(_fast.Fast, "call", checked)
    g = _run(graph_cost=10.5e-6, eager_cost=10e-6, graph_host=4e-6, eager_host=9e-6)
    for piece in (g.a, g.b):
        s = cg.stats(piece)
        assert (s.captures, s.timed_calls, s.graphs) == (1, 3, 0), s
        (why, n), = s.eager_calls.items()
        assert "on the host (10.0 vs 9.0 µs)" in why, why
        # three timed turns (the first right after the capture), each counted once
        assert s.replays == 3, s
    assert len(turns) == 2 * 3  # (every timed turn of both pieces went through it)
    assert len({id(f) for f in turns}) == 2  # (one fast path for all turns of a piece)


def test_clearly_faster_end_to_end_keeps_the_graph_whatever_its_host_time(timed):
    g = _run(graph_cost=5e-6, eager_cost=10e-6, graph_host=8e-6, eager_host=5e-6)
    assert cg.stats(g.a).graphs == 1 and cg.stats(g.a).eager == 0


def test_the_verdict_needs_the_margin_and_enough_samples():
    t = _trial.Trial(lambda: 0.0)
    assert not t.done and not t.eager_next()
    t.graph, t.eager = [3.0, 2.0, 2.5], [1.9, 5.0, 1.95]
    t.graph_host, t.eager_host = [1.0, 0.5, 0.7], [0.6, 0.6, 0.6]
    assert t.done and t.verdict() is None  # 2.0 vs 1.9: within 10%; 0.5 vs 0.6 on the host
    t.graph_host = [0.61] * 3
    assert "and on the host (610000.0 vs 600000.0 µs)" in t.verdict()
    t.graph_host = [0.56] * 3  # cheaper on the host, but not by 10% (0.616 > 0.6): eager's
    assert "saves under 10% of its eager run" in t.verdict()
    t.graph_host = [0.61] * 3
    t.graph = [1.8] * 3  # 1.8 * 1.1 = 1.98 > 1.9: faster, but not clearly
    assert t.verdict() is not None
    t.graph = [1.7] * 3  # 1.7 * 1.1 = 1.87 <= 1.9: clearly faster
    assert t.verdict() is None
    t.eager = [1.0, 5.0, 1.5]
    t.graph = [3.0, 2.0, 2.5]
    assert "(2000000 vs 1000000 µs a call" in t.verdict()


def test_no_clock_no_trial(sim):
    # (the CPU double has no clock): pieces keep their graphs untimed
    with torch.no_grad():
        g = cg.graphify(_Root())
        for _ in range(4):
            g(torch.randn(4, 8))
    s = cg.stats(g.a)
    assert (s.timed_calls, s.graphs, s.replays) == (0, 1, 3), s  # calls 2-4 replay


def test_a_given_back_piece_stays_plain_through_the_direct_call_and_ungraphify(timed):
    g = _run(graph_cost=30e-6, eager_cost=10e-6)
    state = g.a._cudagraphify_state
    assert state.given_back is not None and state.eager_calls[state.given_back] == 0
    with torch.no_grad():
        x = torch.randn(4, 8)
        ref = _Piece(8, 8)
        ref.load_state_dict(g.a.state_dict())
        assert torch.equal(g.a(x), ref(x))  # its plain forward: not seen, not counted
    assert state.eager_calls[state.given_back] == 0
    g(torch.randn(4, 8))
    assert "forward" not in g.a.__dict__
    assert cg.stats(g).eager_calls[state.given_back] == 0  # (the root's sum: the reason)
    cg.ungraphify(g)
    assert "forward" not in g.a.__dict__ and "_cudagraphify_state" not in g.a.__dict__


def test_explain_shows_a_given_back_piece_with_the_reason(timed):
    g = _run(graph_cost=30e-6, eager_cost=10e-6)
    text = str(cg.explain(g))
    assert text.count("given back (eager)") == 2, text
    assert "its graph costs more than its eager run (30 vs 10 µs a call" in text, text


class _Scaled(nn.Linear):
    """Its eager run costs 10 µs a row: one row, less than its graph; eight, more."""

    def forward(self, x):
        _NOW[0] += 10e-6 * x.shape[0]
        return super().forward(x)


class _ScaledRoot(_Root):
    def __init__(self):
        super().__init__()
        self.a = _Scaled(8, 8)


def test_only_the_signature_whose_graph_does_not_pay_runs_eagerly(timed):
    """A piece with two signatures (a prefill's and a decode step's): the one whose graph costs
    more runs eagerly from its verdict on, the other keeps its graph."""
    _COST.update(graph=30e-6, eager=0.0)
    torch.manual_seed(0)
    ref = _ScaledRoot()
    g = cg.graphify(copy.deepcopy(ref))
    for _ in range(10):
        for rows in (8, 1):
            x = torch.randn(rows, 8)
            assert torch.equal(g(x), ref(x))
    state = g.a._cudagraphify_state
    assert state.given_back is None
    (why,) = [r for r in state.eager_calls if r.startswith("signature run eagerly")]
    assert "(30 vs 10 µs a call" in why and state.eager_calls[why] >= 2, state.eager_calls
    s = cg.stats(g.a)
    assert s.graphs == 1 and s.timed_calls == 6, s  # (the 8-row graph kept)


# -- the root's plan trial: its forward with its pieces against its forward without them -----

@pytest.fixture
def plan_timed(timed, monkeypatch):
    monkeypatch.setattr(_trial, "PLAN_TRIAL", True)
    return timed


def _plain_calls(piece) -> int:
    return cg.stats(piece).eager_calls[_engine.PLAN_PLAIN]


def test_the_plan_trial_waits_for_the_pieces_own_trials(plan_timed):
    # calls 2-7: the pieces capture and time themselves; the root's forwards then are not
    # what the plan costs (timed again); call 8 is the plan trial's first sample
    g = _run(graph_cost=5e-6, eager_cost=50e-6, calls=8)
    trial = g._cudagraphify_state._plan_trial
    assert trial.voided == 6 and len(trial.plan) == 1 and trial.plain == [], trial
    assert cg.stats(g.a).eager_calls == {}  # (no plain forward yet)


def test_a_plan_that_pays_keeps_its_pieces(plan_timed):
    g = _run(graph_cost=5e-6, eager_cost=50e-6, calls=24)
    assert g._cudagraphify_state._plan_trial is False  # decided
    for piece in (g.a, g.b):
        s = cg.stats(piece)
        assert s.graphs == 1 and piece._cudagraphify_state.given_back is None, s
        # five pairs (the first one not counted), one plain forward each; every call counted
        assert _plain_calls(piece) == 5, s
        assert s.replays + s.timed_calls + _plain_calls(piece) == 24 - 1, s
        assert type(piece._cudagraphify_state._fast) is _fast.Fast
    # explain tells the root's verdict, with what was timed (pieces 2 x 5 µs against 2 x 50)
    root_lines = [l for l in str(cg.explain(g)).splitlines() if "plan timed as a whole" in l]
    assert root_lines == ["  - plan timed as a whole: its pieces kept (10 µs a forward with them, "
                          "100 µs with all of them plain; 0.10x)"], root_lines


def test_a_plan_slower_than_its_plain_forward_gives_every_piece_back(plan_timed, monkeypatch):
    # each piece pays alone, but the forward with them costs more (here its chain's way out:
    # what the pieces' own trials do not see)
    owned = _region.GraphRegion.owned_outputs

    def costly(self, out):
        _NOW[0] += 1e-3
        return owned(self, out)

    monkeypatch.setattr(_region.GraphRegion, "owned_outputs", costly)
    g = _run(graph_cost=5e-6, eager_cost=50e-6, calls=24)
    for piece in (g.a, g.b):
        why = piece._cudagraphify_state.given_back
        assert why.startswith("piece given back: the forward that runs it is not faster with "
                              "its pieces graphed (1"), why
        s = cg.stats(piece)
        # (decided at call 17; its plain forward back in place: the later calls not counted)
        assert s.graphs == 0 and s.eager_calls[why] == 0, s
    assert g._cudagraphify_state._chain_needed() is False
    assert "  - plan timed as a whole: its pieces given back (1010 µs a forward with them, 100 " \
        "µs with all of them plain; 10.10x)" in str(cg.explain(g)).splitlines()


def test_a_plan_no_faster_end_to_end_goes_to_plain(plan_timed):
    # the pieces keep their graphs on their host time (a tie end to end, see
    # test_a_tie_keeps_the_graph_when_it_costs_less_host_time); the forward is judged end to
    # end, and a plan that is not faster there gives its pieces back
    g = _run(graph_cost=10.5e-6, eager_cost=10e-6, calls=24, graph_host=4e-6, eager_host=9e-6)
    assert g.a._cudagraphify_state.given_back.startswith("piece given back: the forward")


def test_the_plan_verdict_takes_the_middle_of_its_pairs():
    t = _trial.PlanTrial(lambda: 0.0)
    assert not t.done
    t.plan, t.plain = [9.0, 1.0, 1.0, 9.0, 1.0], [1.0, 2.0, 2.0, 2.0, 2.0]
    assert t.done and t.verdict() is None  # the untimed first pair and one outlier: ignored
    t.plan = [1.0, 2.0, 2.1, 1.0, 2.0]  # ratios 1.0, 1.05, 0.5, 1.0: the middle is 1.0
    assert "1.00x" in t.verdict()  # (a tie goes to the plain forward)


def test_the_plan_trial_times_one_kind_of_call(plan_timed):
    # calls of another shape (here every third: a prefill among decode steps, say) run as
    # planned, untimed: the trial's five pairs are all of the first kind it timed
    torch.manual_seed(0)
    _COST.update(graph=5e-6, eager=50e-6)
    ref = _Root()
    g = cg.graphify(copy.deepcopy(ref))
    for i in range(26):
        x = torch.randn(4 if i % 3 else 2, 8)
        assert torch.equal(g(x), ref(x))
        trial = g._cudagraphify_state._plan_trial
        if i == 25:
            assert trial is False  # (decided on this call)
        elif trial is not None:
            assert trial.key == (torch.Size([4, 8]), torch.float32), trial.key
    for piece in (g.a, g.b):
        assert _plain_calls(piece) == 5 and piece._cudagraphify_state.given_back is None
