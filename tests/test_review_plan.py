"""Review of the root-level plan trial (cudagraphify/_trial.py::PlanTrial, _engine.py
GraphedState.chained/_plan_timed, _nested.Plain) and of the DirectCall / device-reader changes.

On the CPU double with a fake clock (as tests/test_trial.py): a piece's eager forward advances
it by ``eager``, a replay of its graph by ``graph``. The clock here behaves as CUDA's does:
reading it (a device synchronisation) inside a stream capture raises. The three findings (a
trial that synchronised inside the caller's capture, a decode loop whose growing mask kept its
trial from deciding, a decided trial restarted by each new signature) failed here before their
fix; the others are controls of something the change could break."""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _engine, _nested, _trial, _wrap
from conftest import SimGraph
from test_trial import _COST, _NOW, _Piece, _Root

_SYNCS_IN_CAPTURE: list[str] = []


class _Ctx:
    """An argument no signature can hold (as an HF DynamicCache): the root plans around it."""


class _OpaqueRoot(nn.Module):
    """Capturable as a whole (no host sync): piecewise only because of its opaque argument."""

    def __init__(self):
        super().__init__()
        self.a, self.b = _Piece(8, 8), _Piece(8, 8)

    def forward(self, x, ctx, mask=None):
        y = self.b(torch.relu(self.a(x)))
        return y if mask is None else y * mask.sum()


def _clock_of(sim):
    def clock(device):
        def now():
            if sim.in_capture():  # torch.cuda.synchronize() while the stream is captured
                _SYNCS_IN_CAPTURE.append("sync")
                raise RuntimeError("CUDA error: operation not permitted when stream is "
                                   "capturing")
            return _NOW[0]
        return now
    return clock


@pytest.fixture
def plan_timed(sim, monkeypatch):
    sim.clock = _clock_of(sim)
    monkeypatch.setattr(_trial, "host_clock", lambda: _NOW[0])
    monkeypatch.setattr(_trial, "PLAN_TRIAL", True)
    _COST.update(eager=50e-6, graph=5e-6, eager_host=None, graph_host=None)
    _SYNCS_IN_CAPTURE.clear()
    replay = SimGraph.replay

    def costly(self):
        _NOW[0] += _COST["graph"]
        return replay(self)

    monkeypatch.setattr(SimGraph, "replay", costly)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            yield sim


def _user_capture(sim, fn):
    """As the caller's ``torch.cuda.graph(g)`` block: the caller's stream is captured (for
    cudagraphify, ``backend.in_capture()`` holds) while ``fn`` runs."""
    sim._tls.depth = getattr(sim._tls, "depth", 0) + 1
    try:
        return fn()
    finally:
        sim._tls.depth -= 1


# -- finding 1: the plan trial synchronises the device inside the caller's stream capture ----

def test_a_root_called_inside_the_callers_capture_does_not_synchronise(plan_timed):
    """FINDING. A root with pieces is captured whole by its caller (``torch.cuda.graph``; its
    forward is capturable: piecewise only for an opaque argument). Before the plan trial that
    worked: the pieces see ``in_capture()`` and run plain, their ops captured. Now
    ``EagerFast.call`` (which never checks ``in_capture``) -> ``chained`` -> ``_plan_timed``
    -> ``PlanTrial.timed`` reads the clock: ``torch.cuda.synchronize`` during a capture raises
    (cudaErrorStreamCaptureUnsupported) and invalidates the caller's capture."""
    torch.manual_seed(0)
    ref = _OpaqueRoot()
    g = cg.graphify(copy.deepcopy(ref))
    ctx = _Ctx()
    for _ in range(3):  # the caller's warm-up (torch.cuda.graph recipes warm up 3 calls)
        x = torch.randn(4, 8)
        assert torch.equal(g(x, ctx), ref(x, ctx))
    assert g._cudagraphify_state.pieces, "the root planned pieces around its argument"
    x = torch.randn(4, 8)
    out = _user_capture(plan_timed, lambda: g(x, ctx))  # raises now
    assert torch.equal(out, ref(x, ctx))
    assert _SYNCS_IN_CAPTURE == []


def test_control_the_same_capture_without_the_plan_trial(plan_timed, monkeypatch):
    # (what the finding above regressed: the same calls with the plan trial off)
    monkeypatch.setattr(_trial, "PLAN_TRIAL", False)
    torch.manual_seed(0)
    ref = _OpaqueRoot()
    g = cg.graphify(copy.deepcopy(ref))
    ctx = _Ctx()
    for _ in range(3):
        x = torch.randn(4, 8)
        assert torch.equal(g(x, ctx), ref(x, ctx))
    x = torch.randn(4, 8)
    out = _user_capture(plan_timed, lambda: g(x, ctx))
    assert torch.equal(out, ref(x, ctx)) and _SYNCS_IN_CAPTURE == []


# -- finding 2: an HF-style decode loop never gets its plan judged ---------------------------

def test_a_decode_loop_with_a_growing_mask_gets_its_plan_judged(plan_timed):
    """FINDING (the feature silently never runs). HF ``generate()`` calls the model with a
    DynamicCache (opaque: pieces are planned around it) and an ``attention_mask`` one column
    longer every step. ``_plan_timed`` keys its trial to the first timed call's tensor shapes,
    mask included: no later decode step matches, every one runs ``_chain_run`` untimed, and
    the trial never decides (no plain forward, no verdict), however long the loop. (The
    README: "a prefill among decode steps runs untimed" -- here every decode step does.)"""
    torch.manual_seed(0)
    ref = _OpaqueRoot()
    g = cg.graphify(copy.deepcopy(ref))
    ctx = _Ctx()
    for step in range(60):
        x, mask = torch.randn(1, 8), torch.ones(1, 5 + step)
        assert torch.equal(g(x, ctx, mask), ref(x, ctx, mask))
    trial = g._cudagraphify_state._plan_trial
    plain = cg.stats(g.a).eager_calls.get(_engine.PLAN_PLAIN, 0)
    assert trial is False, (f"after 60 decode steps the plan trial is still undecided: "
                            f"{len(trial.plan)} plan / {len(trial.plain)} plain samples, "
                            f"{plain} plain forwards, key {trial.key}")


# -- finding 3: a decided plan is timed again on every new signature of its root ------------

def test_a_decided_plan_is_not_timed_again_when_no_piece_was_added(plan_timed):
    """FINDING (minor). ``_plan_trial`` is "False once decided (timed again when pieces are
    added)". But ``_record`` calls ``_add_pieces(install_pieces(paths))`` for every new
    piecewise signature of the root, and ``install_pieces`` returns [] where every path is
    graphed already: the decided trial is reset anyway, and the next calls run five more
    plain forwards (and may now give back pieces the first verdict kept)."""
    torch.manual_seed(0)
    ref = _Root()
    g = cg.graphify(copy.deepcopy(ref))
    for _ in range(24):
        x = torch.randn(4, 8)
        assert torch.equal(g(x), ref(x))
    state = g._cudagraphify_state
    assert state._plan_trial is False  # decided: the plan pays, the pieces kept
    pieces = list(state.pieces)
    x = torch.randn(2, 8)  # another batch size: a new signature of the root, no new piece
    assert torch.equal(g(x), ref(x))
    assert list(state.pieces) == pieces
    assert state._plan_trial is False, "the decided trial was reset with no piece added"


# -- controls: what the plan trial could break and does not ---------------------------------

class _Raising(_Root):
    def forward(self, x):
        y = self.a(x)
        if bool(torch.isnan(y).any()):  # a host sync; raises on a NaN input
            raise ValueError("nan")
        return self.b(y + 1)


def test_control_raising_turns_held_outputs_and_counts(plan_timed):
    # every fourth call raises inside its forward (in plain and planned turns alike): no
    # nesting leaks out, every output held stays eager's, and each piece counts each call once
    torch.manual_seed(0)
    ref = _Raising()
    g = cg.graphify(copy.deepcopy(ref))
    held, calls = [], 0
    for i in range(40):
        x = torch.randn(4, 8)
        if i % 4 == 3:
            x[0, 0] = float("nan")
            with pytest.raises(ValueError):
                g(x)
            assert _nested.nesting[0] == 0 and not _nested.in_graphed_call()
            assert _nested.plain_reason() is None
            continue
        calls += 1
        held.append((g(x), ref(x)))
    assert all(torch.equal(o, w) for o, w in held)
    state = g._cudagraphify_state
    assert state._plan_trial is False
    s = cg.stats(state.pieces[1])  # (b: not reached by the raising calls)
    assert s.eager_calls[_engine.PLAN_PLAIN] >= 5
    assert s.replays + s.timed_calls + sum(s.eager_calls.values()) == calls - 1, s


def test_control_threads_through_the_plan_trial(plan_timed, monkeypatch):
    # four threads through one root while its trial runs: chained turns without the root's
    # lock, a Plain turn's global nesting count seen by the others' fast paths (a piece given
    # back keeps its proxy, so that every call of it is counted below)
    monkeypatch.setattr(_wrap, "RETIRE_PIECES", False)
    torch.manual_seed(0)
    ref = _Root()
    g = cg.graphify(copy.deepcopy(ref))
    g(torch.randn(4, 8))  # (the root's plan, on one thread)
    errors, n = [], 40

    def worker(seed):
        gen = torch.Generator().manual_seed(seed)
        try:
            with torch.no_grad():
                for _ in range(n):
                    x = torch.randn(4, 8, generator=gen)
                    if not torch.equal(g(x), ref(x)):
                        errors.append(seed)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in ts)
    assert _nested.nesting[0] == 0
    for piece in g._cudagraphify_state.pieces:
        s = cg.stats(piece)
        # (another thread can reach a piece before the root's keyed first run captured it:
        # a first sight, run eagerly and counted in seen_once)
        assert s.replays + s.timed_calls + s.seen_once + sum(s.eager_calls.values()) == 4 * n, s
