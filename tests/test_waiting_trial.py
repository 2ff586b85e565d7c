"""A piece's training graph whose trial waits behind its own backward (``_engine.
_settle_waiting_trials``): grad-mode forwards whose output stays referenced with no backward (the
differential bench's grad-mode step). The calls that find it waiting run eagerly anyway and are
timed as its eager samples; with the trial's three of them and a graph sample, a verdict to keep
the graph ends the trial, so a second training graph of the signature is captured and replays
beside the waiting one; a verdict to give it back waits for the full trial. CPU, on the
clocked simulated backend of tests/test_trial_training.py; every output compared with eager's."""

from __future__ import annotations

import copy

import torch

import cudagraphify as cg
from cudagraphify import _engine
from conftest import SimGraph  # noqa: F401 (the fixture's backend)

from test_trial import _COST, _Root
from test_trial_training import timed  # noqa: F401 - the fixture (clocked simulated backend)

GIVE_BACK = dict(graph=30e-6, eager=10e-6)
KEEP = dict(graph=5e-6, eager=50e-6)


def _pair():
    torch.manual_seed(0)
    ref = _Root()
    return ref, cg.graphify(copy.deepcopy(ref))


def _steps(g, ref, pattern: str, kept: list) -> None:
    """One grad-mode forward per letter: ``k`` keeps its output (no backward ever), ``d`` drops
    it at once, ``b`` runs its backward (on both models, gradients compared)."""
    for c in pattern:
        _step(g, ref, c, kept)


def _step(g, ref, c: str, kept: list) -> None:
    x = torch.randn(4, 8)
    o, w = g(x), ref(x)
    assert torch.equal(o, w)
    if c == "k":
        kept.append((o, w))
    elif c == "b":
        o.sum().backward(), w.sum().backward()
        for p, q in zip(g.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)


def _state(g):
    return g.a.__dict__["_cudagraphify_state"]


# (the root's first call runs its pieces plain; ``a``'s first call captures its training graph;
# its trial then alternates: a graph turn, an eager turn; "dddd" leaves one sample of each kind
# and a graph turn next, which "k" takes and keeps its output: the graph waits for good)
START = "ddddk"


def test_a_kept_output_no_longer_keeps_a_paying_piece_eager(timed):
    _COST.update(KEEP)
    ref, g = _pair()
    kept: list = []
    _steps(g, ref, START, kept)
    st = _state(g)
    (entry,) = list(st.cache.graphs(st))
    assert entry.pending() and entry.trial is not None and not entry.trial.done
    assert (len(entry.trial.graph), len(entry.trial.eager)) == (2, 1)
    _steps(g, ref, "dd", kept)  # waiting: eager, and timed as its eager samples
    assert (len(entry.trial.graph), len(entry.trial.eager)) == (2, 3)
    assert st.timed_calls == 3 and len(list(st.cache.graphs(st))) == 1
    _steps(g, ref, "d", kept)  # judged on what it has: kept, and a second graph made
    assert entry.trial is None, "a keep verdict on the samples taken ends the trial"
    graphs = list(st.cache.graphs(st))
    assert len(graphs) == 2 and graphs[1].trial is None, graphs  # the signature's second graph


def test_the_second_graph_keeps_replaying_while_the_first_waits(timed):
    _COST.update(KEEP)
    ref, g = _pair()
    kept: list = []
    _steps(g, ref, START + "ddd", kept)  # (the output of START's "k" kept for good)
    st = _state(g)
    replays, eager = st.replays, sum(st.eager_calls.values())
    _steps(g, ref, "d" * 6, kept)
    # every call replays the second graph; none runs eagerly
    assert st.replays - replays == 6, (st.replays - replays, dict(st.eager_calls))
    assert sum(st.eager_calls.values()) == eager, dict(st.eager_calls)


def test_a_give_back_verdict_waits_for_the_full_trial(timed):
    # the graph loses on what was timed: nothing is decided (nor released) while it waits
    _COST.update(GIVE_BACK)
    ref, g = _pair()
    kept: list = []
    _steps(g, ref, START, kept)
    st = _state(g)
    (entry,) = list(st.cache.graphs(st))
    _steps(g, ref, "kkk", kept)
    assert st.given_back is None and entry.trial is not None
    assert list(st.cache.graphs(st)) == [entry]  # no second graph either
    kept.clear()  # (the backward will never run: its graph is free again)
    _steps(g, ref, "d" * 8, kept)
    assert st.given_back is not None, "judged on the full trial once the graph was free"


def test_without_the_settling_the_kept_output_keeps_it_eager(timed, monkeypatch):
    # (the control: what the bench's grad-mode step did before)
    monkeypatch.setattr(_engine, "_settle_waiting_trials", lambda busy: None)
    _COST.update(KEEP)
    ref, g = _pair()
    kept: list = []
    _steps(g, ref, START, kept)
    st = _state(g)
    replays = st.replays
    _steps(g, ref, "d" * 6, kept)
    assert st.replays == replays, "waiting: every call ran eagerly"
