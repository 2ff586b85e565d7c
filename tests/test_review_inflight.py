"""Review of d62294e: a grad-mode call made while its signature's training graph waits for an
earlier call's backward captures a second graph of that signature (own pool).

CPU, on the simulated backend (``sim``, tests/conftest.py), outputs and gradients compared with
eager's bitwise. Findings (each failed on d62294e; fixed since: F3 by 31e55a3, the others by the
commit after it, which makes a second graph only where the cache has room, records nothing but
that graph under the key, and moves the version counters a replay's in-place writes move):

- F1 (crash): the second graph's ``cache.put`` evicts by LRU, and a graph found waiting for its
  backward is not touched: with ``max_graphs=1`` the second graph evicts the first of its own
  key, with a full cache another signature's pending graph; the pending backward then raises
  "released before the backward ran" where 380d851 ran the call eagerly.
- F2 (speed, leak): with the eviction budget spent, a call in flight reaches ``_ineligible``,
  which puts an EagerEntry under the key: the key's graph is hidden for good (never replayed,
  its memory kept).
- F3 (leak; fixed by 31e55a3): a piece's twin graphs each have a trial; one given back as a
  signature (other signatures keep graphs) puts an EagerEntry in front of its twin.
- F4 (wrong values, silent where eager raises): a replay does not move the version counters of
  the buffers its forward writes; the second graph's replay overwrites a buffer the first
  graph's backward saved (``saved_statics``) and that backward reads it silently, where eager
  (and 380d851, whose second call ran eagerly) raise "modified by an inplace operation".
  F4b: the same across two signatures, pre-existing.
- F5 (speed): second graphs count against ``max_graphs``: 9 signatures x 2 micro-batches evict
  and thrash under the default 16 (26 captures for 9 signatures; 380d851: 9, no eviction).
Controls (plain tests): accumulation orders, set_to_none both ways, hooks, autograd.grad,
mixed shapes, BatchNorm, an optimizer step between backwards, a piecewise plan's pieces.
GPU side: .ci/review/inflight/run_all.sh.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify._cache import EagerEntry
from cudagraphify._engine import PENDING

from test_trial import _COST, _ScaledRoot
from test_trial_training import timed  # noqa: F401 - the fixture (clocked simulated backend)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


def _pair(make=_mlp, **kw):
    ref = make()
    return ref, cg.graphify(copy.deepcopy(ref), **kw)


def _grads_equal(a, b) -> bool:
    for p, q in zip(a.parameters(), b.parameters()):
        if (p.grad is None) != (q.grad is None):
            return False
        if p.grad is not None and not torch.equal(p.grad, q.grad):
            return False
    return True


def _accumulate(g, ref, shapes, steps=3, none=True, opt=True):
    og = torch.optim.SGD(g.parameters(), lr=0.1) if opt else None
    orf = torch.optim.SGD(ref.parameters(), lr=0.1) if opt else None
    for step in range(steps):
        lg = lr = 0
        for n in shapes:
            x = torch.randn(n, 4)
            o, w = g(x), ref(x)
            assert torch.equal(o, w), step
            lg, lr = lg + o.sum(), lr + w.sum()
        lg.backward(), lr.backward()
        assert _grads_equal(g, ref), step
        if opt:
            og.step(), orf.step()
        g.zero_grad(set_to_none=none), ref.zero_grad(set_to_none=none)


# -- F1 --------------------------------------------------------------------------------------

def test_f1_second_graph_evicts_its_pending_twin(sim):
    ref, g = _pair(max_graphs=1)
    _accumulate(g, ref, [3, 3])


def test_f1_second_graph_evicts_another_signatures_pending_graph(sim):
    ref, g = _pair(max_graphs=2)
    _accumulate(g, ref, [3, 3, 5])


# -- F2 --------------------------------------------------------------------------------------

def test_f2_a_call_in_flight_with_the_eviction_budget_spent_hides_the_graph(sim):
    ref, g = _pair(cache_policy=cg.CachePolicy(max_graphs=1, max_evictions=1))
    x5, x3 = torch.randn(5, 4), torch.randn(3, 4)
    g(x5).sum().backward()
    g(x3).sum().backward()  # evicts the (5, 4) graph: the budget is spent
    g(x3).sum().backward()
    held = g(x3)  # the graph waits for this backward
    assert torch.equal(g(x3), ref(x3))  # in flight: eager (380d851: PENDING, no entry)
    held.sum().backward()
    replays = cg.stats(g).replays
    assert torch.equal(g(x3), ref(x3))
    assert cg.stats(g).replays == replays + 1, cg.stats(g).eager_calls


# -- F3 --------------------------------------------------------------------------------------

# (31e55a3 fixed it: no second graph before the first's trial is over, and none timed)


def test_f3_a_signature_given_back_leaves_no_graph_behind_its_eager_entry(timed):
    _COST.update(graph=30e-6, eager=0.0)  # (_Scaled: 10 µs a row: one row loses, eight win)
    torch.manual_seed(0)
    ref = _ScaledRoot()
    g = cg.graphify(copy.deepcopy(ref))
    for step in range(14):
        lg = lr = 0
        for n in (8, 1, 1, 1):
            x = torch.randn(n, 8)
            o, w = g(x), ref(x)
            assert torch.equal(o, w), step
            lg, lr = lg + o.sum(), lr + w.sum()
        lg.backward(), lr.backward()
        g.zero_grad(), ref.zero_grad()
    st = g.a.__dict__["_cudagraphify_state"]
    hidden = [k for k, e in st.cache.items() if not isinstance(e, EagerEntry)
              and isinstance(st.cache.get(k)[0], EagerEntry)]
    assert not hidden, [type(e).__name__ for _, e in st.cache.items()]


# -- F4 --------------------------------------------------------------------------------------

class _Scaled(nn.Module):
    """Writes a buffer in forward that autograd saves (``mul``'s other operand): eager's backward
    of a call raises once a later call wrote it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        self.scale.mul_(0.5)
        return self.lin(x) * self.scale


def _written_buffer_raises_as_eager(shapes):
    torch.manual_seed(0)
    ref = _Scaled()
    g = cg.graphify(copy.deepcopy(ref))
    for n in sorted(set(shapes)):
        g(torch.randn(n, 4)).sum().backward()
    for step in range(3):
        with pytest.raises(RuntimeError, match="inplace"):
            sum(ref(torch.randn(n, 4)).sum() for n in shapes).backward()
        with pytest.raises(RuntimeError, match="inplace"):
            sum(g(torch.randn(n, 4)).sum() for n in shapes).backward()


def test_f4_a_buffer_saved_for_backward_written_by_the_twins_replay(sim):
    _written_buffer_raises_as_eager([3, 3])


def test_f4b_the_same_across_two_signatures(sim):
    _written_buffer_raises_as_eager([3, 5])


# -- F5 --------------------------------------------------------------------------------------

def test_f5_nine_signatures_in_flight_twice_do_not_thrash(sim):
    ref, g = _pair()
    for step in range(3):
        for n in range(1, 10):
            _accumulate(g, ref, [n, n], steps=1, opt=False)
    s = cg.stats(g)
    assert s.evictions == 0 and s.captures <= 18, s


# -- controls ----------------------------------------------------------------------------------

@pytest.mark.parametrize("none", [True, False])
@pytest.mark.parametrize("shapes", [[3, 3], [3, 3, 3], [3, 5, 3, 5], [3, 3, 5]])
def test_accumulation_matches_eager(sim, shapes, none):
    ref, g = _pair()
    _accumulate(g, ref, shapes, steps=5, none=none)
    assert cg.stats(g).captures == sum(min(shapes.count(n), 2) for n in set(shapes))


@pytest.mark.parametrize("none", [True, False])
@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_two_backwards_one_by_one_in_either_order(sim, order, none):
    ref, g = _pair()
    og, orf = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(5):
        xs = [torch.randn(3, 4) for _ in range(2)]
        outs, wants = [g(x) for x in xs], [ref(x) for x in xs]
        assert all(torch.equal(o, w) for o, w in zip(outs, wants))
        for i in order:
            outs[i].sum().backward(), wants[i].sum().backward()
            assert _grads_equal(g, ref), (step, i)
        og.step(), orf.step(), og.zero_grad(set_to_none=none), orf.zero_grad(set_to_none=none)
    assert cg.stats(g).captures == 2


def test_hooks_and_autograd_grad(sim):
    ref, g = _pair()
    seen_g, seen_r = {}, {}
    for i, p in enumerate(g.parameters()):
        p.register_hook(lambda t, i=i: seen_g.setdefault(i, []).append(t.clone()))
    for i, p in enumerate(ref.parameters()):
        p.register_hook(lambda t, i=i: seen_r.setdefault(i, []).append(t.clone()))
    for step in range(4):
        xs = [torch.randn(3, 4, requires_grad=True) for _ in range(2)]
        xr = [x.detach().clone().requires_grad_() for x in xs]
        gg = torch.autograd.grad(sum(g(x).sum() for x in xs), [*xs, *g.parameters()])
        gr = torch.autograd.grad(sum(ref(x).sum() for x in xr), [*xr, *ref.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(gg, gr)), step
        sum(g(x).sum() for x in xs).backward(), sum(ref(x).sum() for x in xr).backward()
        assert _grads_equal(g, ref), step
        g.zero_grad(), ref.zero_grad()
    assert seen_g.keys() == seen_r.keys()
    for i in seen_r:  # (the order across parameters differs: one Function gives them all)
        assert len(seen_g[i]) == len(seen_r[i])
        assert all(torch.equal(a, b) for a, b in zip(seen_g[i], seen_r[i])), i


def test_an_optimizer_step_between_the_backwards_raises_as_eager(sim):
    for model in _pair():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(3, 4)
        model(x).sum().backward()
        a, b = model(x), model(x)
        a.sum().backward()
        opt.step()
        with pytest.raises(RuntimeError, match="inplace"):
            b.sum().backward()


def test_batchnorm_accumulation_keeps_running_statistics(sim):
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
    ref, g = _pair(make)
    for step in range(4):
        lg = lr = 0
        for _ in range(3):
            x = torch.randn(6, 4)
            o, w = g(x), ref(x)
            assert torch.allclose(o, w, atol=1e-6), step
            lg, lr = lg + o.sum(), lr + w.sum()
        lg.backward(), lr.backward()
        for a, b in zip(g.buffers(), ref.buffers()):
            assert torch.allclose(a.float(), b.float(), atol=1e-6), step
        for p, q in zip(g.parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-5), step
        g.zero_grad(), ref.zero_grad()
    assert cg.stats(g).captures == 2


class _Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        if bool((y > -1e9).all()):  # a host sync: piecewise
            y = y + 1
        return self.b(y).relu()


@pytest.mark.parametrize("micro", [2, 3])
def test_a_piecewise_plans_pieces_in_flight(sim, micro):
    torch.manual_seed(0)
    ref = _Root()
    g = cg.graphify(copy.deepcopy(ref))
    for step in range(6):
        lg = lr = 0
        for _ in range(micro):
            x = torch.randn(4, 8)
            o, w = g(x), ref(x)
            assert torch.equal(o, w), step
            lg, lr = lg + o.sum(), lr + w.sum()
        lg.backward(), lr.backward()
        assert _grads_equal(g, ref), step
        g.zero_grad(), ref.zero_grad()


def test_an_output_kept_forever_the_second_graph_serves(sim):
    ref, g = _pair()
    x = torch.randn(3, 4)
    g(x)
    kept = g(x)  # noqa: F841 - the first graph waits for good
    for step in range(5):
        g(x).sum().backward(), ref(x).sum().backward()
        assert _grads_equal(g, ref), step
        g.zero_grad(), ref.zero_grad()
    s = cg.stats(g)
    assert s.captures == 2 and s.eager_calls.get(PENDING, 0) == 0, s
