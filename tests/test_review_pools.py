"""Review: one memory pool per graphed callable (FirstCall._capture_inference, GraphedState.pool).

A test double on top of conftest's simulated backend models what a shared CUDA pool allows:

- ``new_pool()`` returns a real pool id, graphs remember the pool they were captured into;
- replaying a graph first *scribbles* (fills with NaN bytes) the memory that every other live
  graph of the same pool made during its capture (its intermediates and static outputs): with a
  shared caching-allocator pool, one graph's replay may write any of it. Anything that reads a
  graph's pool memory after another graph of the pool replayed then sees garbage;
- streams: ``backend.stream`` is the current stream; ``order_after`` records that the current
  stream waited for another; a capture synchronises the device (as CudaBackend.capture does).
  A replay of a graph on stream s while another graph of the same pool last replayed on stream
  t != s, with no wait of s on t since, is recorded as a race (``backend.races``).

Plain tests pass when the library is right; ``xfail(strict=True)`` tests expose a finding.
"""

from __future__ import annotations

import copy
import warnings
import weakref

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _capture
from conftest import SimBackend, SimGraph


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudagraphifyWarning)
        yield


class PoolGraph(SimGraph):
    def __init__(self, rec, backend, pool=None, capture_seconds=0.0):
        super().__init__(rec, backend, pool, capture_seconds)
        self.fresh = [rec.storages[k] for k in rec.fresh_storages]
        self.pool_key = pool if pool is not None else ("private", id(self))
        self.order = len(backend.pools_used)  # capture order (see replay)
        backend.members.setdefault(self.pool_key, []).append(weakref.ref(self))
        backend.pools_used.append(pool)

    def replay(self):
        b = self._backend
        s = b.stream
        for ref in b.members.get(self.pool_key, []):
            g = ref()
            # a replay writes this graph's memory: what graphs captured after it in the pool
            # may have reused while it was free (their outputs too, still there once such a
            # graph is released, for whoever holds them), never what a graph captured before
            # it still held (its outputs) when it was captured
            if g is None or g is self or g.order < self.order:
                continue
            with torch._C._DisableTorchDispatch():
                for st in g.fresh:
                    if st.nbytes():
                        torch.empty(0, dtype=torch.uint8).set_(st).fill_(0xFF)
            last = b.last.get(id(g))
            if last is not None:
                t, n = last
                if t != s and max(b.seen.get((s, t), -1), b.synced.get(t, -1)) < n:
                    b.races.append((s, t))
        super().replay()
        b.counter[s] = b.counter.get(s, 0) + 1
        b.last[id(self)] = (s, b.counter[s])

    def release(self):
        super().release()  # (fresh kept: released memory someone holds is still written)


class PoolSim(SimBackend):
    graph_class = PoolGraph

    def __init__(self):
        super().__init__()
        self.stream = 1
        self.counter: dict[int, int] = {}
        self.seen: dict[tuple[int, int], int] = {}
        self.synced: dict[int, int] = {}
        self.last: dict[int, tuple[int, int]] = {}
        self.races: list = []
        self.members: dict = {}
        self.pools_used: list = []
        self.n_pools = 0

    def new_pool(self, device):
        self.n_pools += 1
        return ("pool", self.n_pools)

    def stream_token(self, device):
        return self.stream

    def order_after(self, device, token):
        self.seen[(self.stream, token)] = self.counter.get(token, 0)

    def drain(self, device, token):
        self.synced = dict(self.counter)

    def capture(self, fn, device, pool=None, keep_graph=False):
        self.synced = dict(self.counter)  # CudaBackend.capture synchronises the device
        return super().capture(fn, device, pool=pool, keep_graph=keep_graph)


@pytest.fixture
def psim():
    backend = PoolSim()
    old = _capture.set_backend(backend)
    try:
        yield backend
    finally:
        _capture.set_backend(old)


def eager(m):
    return m.__dict__["forward"].__wrapped__


def same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


def snapshot(out):
    if isinstance(out, dict):
        return {k: snapshot(v) for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        return type(out)(snapshot(v) for v in out)
    return out.clone()


class Multi(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("b", torch.randn(4))

    def forward(self, x):
        h = self.lin(x)
        return {"h": h, "again": h, "relu": h.relu() + self.b, "view": x[:, :2],
                "w": self.lin.weight, "b": self.b, "t": (h * 2).t(), "empty": h[:0]}


SIZES = [4, 2, 3, 2, 4, 3, 1, 4, 1, 2]


# -- sanity of the double -------------------------------------------------------------------

def test_the_double_sees_one_pool_for_a_callables_graphs(psim):
    m = cg.graphify(nn.Linear(4, 4))
    with torch.no_grad():
        for b in (2, 3):
            m(torch.randn(b, 4))
    assert cg.stats(m).captures == 2
    pools = [p for p in psim.pools_used if p is not None]
    assert len(pools) == 2 and pools[0] == pools[1]


def test_the_double_catches_a_graph_output_read_after_another_graphs_replay(psim):
    # copy_outputs=True clones; read the static output itself to check the double scribbles
    m = cg.graphify(nn.Linear(4, 4))
    with torch.no_grad():
        m(torch.randn(2, 4)), m(torch.randn(3, 4))
        a, c = psim.graphs
        # (a replay scribbles over the graphs captured after it: they may have reused its
        # memory; never over those captured before it, whose outputs were held)
        c.replay()
        static_c = [st for st in c.fresh]
        before = [torch.empty(0, dtype=torch.uint8).set_(st).clone() for st in static_c]
        a.replay()
        after = [torch.empty(0, dtype=torch.uint8).set_(st).clone() for st in static_c]
        assert any(not torch.equal(x, y) for x, y in zip(before, after))
        before = [torch.empty(0, dtype=torch.uint8).set_(st).clone() for st in a.fresh]
        c.replay()
        after = [torch.empty(0, dtype=torch.uint8).set_(st).clone() for st in a.fresh]
    assert all(torch.equal(x, y) for x, y in zip(before, after))


# -- outputs the caller holds ------------------------------------------------------------------

def _interleaved_sizes_equal_eager_and_stay_put(m) -> None:
    """``m`` called at every size of SIZES in turn: each output equals eager's, and every
    output the caller keeps is unchanged by the later calls."""
    held = []
    with torch.no_grad():
        for b in SIZES:
            x = torch.randn(b, 4)
            out = m(x)
            assert same(out, eager(m)(x)), b
            held.append((out, snapshot(out)))
    for out, snap in held:
        assert same(out, snap)


def test_interleaved_sizes_outputs_of_every_kind_equal_eager_and_stay_put(psim):
    torch.manual_seed(0)
    m = cg.graphify(Multi())
    _interleaved_sizes_equal_eager_and_stay_put(m)
    s = cg.stats(m)
    assert s.captures == 4 and s.replays == len(SIZES) - 4


def test_forward_writing_its_input_interleaved_sizes(psim):
    class W(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            x.mul_(2)
            return self.lin(x), x, x[1:]

    torch.manual_seed(0)
    m = cg.graphify(W())
    held = []
    with torch.no_grad():
        for b in SIZES:
            x = torch.randn(b, 4)
            x2 = x.clone()
            out = m(x)
            want = eager(m)(x2)
            assert same(out, want) and torch.equal(x, x2), b
            held.append((out, snapshot(out)))
    for out, snap in held:
        assert same(out, snap)
    assert cg.stats(m).replays > 0


def test_nested_graphed_module_inside_a_graphed_function(psim):
    torch.manual_seed(0)
    inner = cg.graphify(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)))
    ref = copy.deepcopy(eager(inner).__self__) if hasattr(eager(inner), "__self__") else None

    @cg.graphify
    def outer(x):
        return inner(x) * 2 + inner(x + 1)

    with torch.no_grad():
        for b in SIZES:
            x = torch.randn(b, 4)
            got_o = outer(x)
            got_i = inner(x)
            want_i = eager(inner)(x)
            want_o = eager(inner)(x) * 2 + eager(inner)(x + 1)
            assert torch.equal(got_o, want_o) and torch.equal(got_i, want_i), b
    assert cg.stats(outer).replays > 0 and cg.stats(inner).replays > 0
    del ref


def test_piecewise_piece_called_twice_with_two_sizes_in_one_forward(psim):
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            y = self.a(x)  # batch b
            z = self.a(x[:1])  # batch 1: another graph of the same piece (same pool)
            if y.sum() > 1e9:  # a host sync: the root runs piecewise
                y = y * 0
            return y + z, z

    torch.manual_seed(0)
    ref = Root()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for b in SIZES:
            x = torch.randn(b, 4)
            assert same(g(x), ref(x)), b
    assert cg.stats(g.a).replays > 0


def test_eviction_and_invalidation_with_interleaved_sizes(psim):
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    m = cg.graphify(lin, max_graphs=2)
    held = []
    with torch.no_grad():
        for k, b in enumerate(SIZES * 2):
            if k == len(SIZES):
                lin.weight.data = lin.weight.data + 1  # moves: every graph is dropped
            x = torch.randn(b, 4)
            out = m(x)
            assert torch.equal(out, nn.Linear.forward(lin, x)), (k, b)
            held.append((out, out.clone()))
    for out, snap in held:
        assert torch.equal(out, snap)
    s = cg.stats(m)
    assert s.evictions > 0 and s.invalidations == 1


def test_training_graphs_and_copy_outputs_false_keep_private_pools(psim):
    torch.manual_seed(0)
    m = cg.graphify(nn.Linear(4, 4))
    for b in (2, 3):
        x = torch.randn(b, 4, requires_grad=True)
        m(x).sum().backward()
    assert psim.captures > 0 and all(p is None for p in psim.pools_used)
    psim.pools_used.clear()
    n = cg.graphify(nn.Linear(4, 4), copy_outputs=False)
    with torch.no_grad():
        ya = n(torch.randn(2, 4))
        yc = n(torch.randn(3, 4))
        keep_a = ya.clone()
        n(torch.randn(3, 4))  # another graph's replay must not write ya
    assert all(p is None for p in psim.pools_used) and torch.equal(ya, keep_a)
    del yc


# -- streams ---------------------------------------------------------------------------------

def test_one_callable_two_streams_replays_are_ordered(psim):
    m = cg.graphify(nn.Linear(4, 4))
    with torch.no_grad():
        for b in (2, 3):
            m(torch.randn(b, 4))
        for k in range(6):
            psim.stream = 1 + k % 2
            for b in (2, 3):
                x = torch.randn(b, 4)
                assert torch.equal(m(x), nn.Linear.forward(m, x))
    assert cg.stats(m).replays == 12 and psim.races == []


def test_shared_policy_graphs_of_one_pool_replayed_by_two_modules_on_two_streams(psim):
    torch.manual_seed(0)
    policy = cg.CachePolicy(shared=True)
    a = cg.graphify(nn.Linear(4, 4), cache_policy=policy)
    b = copy.deepcopy(a)  # the same policy: one cache
    with torch.no_grad():
        a(torch.randn(2, 4)), a(torch.randn(3, 4))  # a captures both sizes, into a's pool
        assert cg.stats(a).captures == 2
        psim.stream = 1
        a(torch.randn(3, 4))  # graph C on stream 1
        psim.stream = 2
        b(torch.randn(2, 4))  # a's graph A on stream 2, through b (b's own stream token)
    assert cg.stats(b).replays == 1
    assert psim.races == [], psim.races


# -- capture_sizes -----------------------------------------------------------------------------

def test_capture_sizes_then_interleaved_calls_equal_eager(psim):
    torch.manual_seed(0)
    m = cg.graphify(Multi())
    with torch.no_grad():
        done = cg.capture_sizes(m, lambda b: torch.randn(b, 4), [1, 2, 3, 4], progress=False)
        assert done.graphed == [4, 3, 2, 1]
    _interleaved_sizes_equal_eager_and_stay_put(m)
    assert cg.stats(m).captures == 4


def test_capture_sizes_refuses_more_sizes_than_the_callable_keeps(psim):
    """Review finding: with max_graphs smaller than the sizes, the later captures evicted the
    earlier ones, which were still reported as graphed. Refused up front now, with the fix."""
    m = cg.graphify(nn.Linear(4, 4), max_graphs=2)
    with torch.no_grad(), pytest.raises(cg.CudagraphifyUsageError, match="max_graphs=4"):
        cg.capture_sizes(m, lambda b: torch.randn(b, 4), [1, 2, 3, 4], progress=False)
    assert cg.stats(m).captures == 0  # nothing was run


def test_capture_sizes_reports_the_graphs_it_evicted(psim):
    m = cg.graphify(nn.Linear(4, 4), max_graphs=3)
    with torch.no_grad():
        m(torch.randn(7, 4)), m(torch.randn(8, 4))
        done = cg.capture_sizes(m, lambda b: torch.randn(b, 4), [1, 2], progress=False)
    assert done.graphed == [2, 1] and done.evicted == 1, done
    assert "evicted 1 graphs made before" in str(done)
    assert cg.stats(m).graphs == 3
