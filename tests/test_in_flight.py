"""Two training graphs of one signature in flight: a grad-mode call made while the signature's
training graph waits for its backward (gradient accumulation over two forwards; an output kept
and never backpropagated) gets a second graph of its own, with its own pool, instead of running
eagerly; past ``_engine._IN_FLIGHT`` graphs waiting at once the calls run eagerly. CPU, through
the simulated backend (``sim``), which replays what it recorded: outputs and gradients are
compared with eager's bitwise."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _engine, _first_call
from cudagraphify._engine import PENDING
from cudagraphify._outcome import EAGER, Outcome


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudagraphifyWarning)
        yield


def _pair(seed=0):
    torch.manual_seed(seed)
    ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    return ref, cg.graphify(copy.deepcopy(ref))


def _grads_equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))


def _pending(m) -> int:
    return cg.stats(m).eager_calls.get(PENDING, 0)


@pytest.mark.parametrize("micro", [2, 3])
def test_accumulation_over_forwards_replays_a_graph_for_each_in_flight(sim, micro):
    ref, g = _pair()
    opt_g = torch.optim.SGD(g.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.manual_seed(1)
    for step in range(6):
        lg = lr = 0
        for _ in range(micro):
            x = torch.randn(3, 4)
            o, w = g(x), ref(x)
            assert torch.equal(o, w), step
            lg, lr = lg + o.sum(), lr + w.sum()
        lg.backward(), lr.backward()
        assert _grads_equal(g, ref), step
        opt_g.step(), opt_r.step(), opt_g.zero_grad(), opt_r.zero_grad()
    s = cg.stats(g)
    # two graphs (the second made by the first call that found the first waiting); a third
    # forward in flight runs eagerly
    assert s.captures == 2, s
    assert _pending(g) == (6 - 1) * (micro - 2) if micro > 2 else _pending(g) == 0, s
    assert s.replays == 6 * micro - 2 - _pending(g), s


def test_outputs_kept_without_backward_then_eager_past_two_then_graphed_again(sim):
    ref, g = _pair()
    x = torch.randn(3, 4)
    first = g(x)  # warm-up and capture: eager autograd, no graph waits
    a = g(x)  # the first graph's replay: it waits while ``a`` lives
    b = g(x)  # a second graph, captured by this call
    c = g(x)  # the second graph's replay
    s = cg.stats(g)
    assert (s.captures, s.replays, _pending(g)) == (2, 2, 0), s
    outs = [g(x) for _ in range(3)]  # both wait: eager (the fast path after the first)
    assert _pending(g) == 3 and cg.stats(g).replays == 2
    for o in (first, a, b, c, *outs):
        assert torch.equal(o, ref(x))
    del outs
    a.sum().backward()  # the first graph waits no more
    ref(x).sum().backward()
    assert _grads_equal(g, ref)
    g.zero_grad(), ref.zero_grad()
    d = g(x)  # the first graph again, not eager
    assert torch.equal(d, ref(x)) and cg.stats(g).replays == 3 and _pending(g) == 3
    # the second graph's backward after the first graph's replay, then the first's: each reads
    # its own activations
    c.sum().backward(), d.sum().backward()
    rc, rd = ref(x), ref(x)
    rc.sum().backward(), rd.sum().backward()
    assert _grads_equal(g, ref)


def test_a_second_graph_that_cannot_be_made_hides_nothing_and_is_not_tried_again(sim,
                                                                                 monkeypatch):
    ref, g = _pair()
    x = torch.randn(3, 4)
    g(x)
    held = g(x)  # the first graph waits
    runs = []
    real = _first_call.FirstCall.run

    def refused(self):
        runs.append(1)
        out = real(self)
        return Outcome(EAGER, out.result, reason="refused by the test", guard=out.guard,
                       flags=out.flags) if len(runs) == 1 else out

    monkeypatch.setattr(_first_call.FirstCall, "run", refused)
    outs = [g(x) for _ in range(3)]
    assert len(runs) == 1  # tried once, by the first call
    assert all(torch.equal(o, ref(x)) for o in outs)
    assert _pending(g) == 3 and cg.stats(g).captures == 1
    held.sum().backward()
    replays = cg.stats(g).replays
    y = g(x)  # the first graph replays: no entry of the refusal stands in front of it
    assert torch.equal(y, ref(x)) and cg.stats(g).replays == replays + 1


def test_inside_an_explicit_region_calls_in_flight_run_eagerly(sim):
    ref, g = _pair()
    x = torch.randn(3, 4)
    with cg.graph_region():
        g(x)
        held = g(x)
        replays, captures = cg.stats(g).replays, cg.stats(g).captures
        out = g(x)
        assert torch.equal(out, ref(x))
        s = cg.stats(g)
        assert (s.replays, s.captures) == (replays, captures) and _pending(g) >= 1, s
        del held
