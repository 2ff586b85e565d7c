"""The engine's state machine on a CPU, through the simulated capture backend of conftest.py.

Keys → capture/replay counts, static buffers, output copies, in-place mutation, invalidation,
eviction, eager fallbacks with reasons, threads, nesting, regions.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import threading
import types
import warnings
import weakref

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify.bench.models import GPT
from cudagraphify._training import TrainingGraph


@pytest.fixture(autouse=True)
def _no_warnings_leak():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudagraphifyWarning)
        yield


def counts(m):
    s = cg.stats(m)
    return s.captures, s.replays, s.eager


def test_five_calls_one_capture_four_replays_equal_eager(sim):
    torch.manual_seed(0)
    ref = GPT(32, 2, 2).eval()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(1, 4, 32)
            torch.testing.assert_close(g(x), ref(x), rtol=0, atol=0)
    assert counts(g) == (1, 4, 0)
    assert sim.captures == 1 and sim.replays == 4 and sim.warmups == 1


def test_warmup_iters_run_on_copies_so_side_effects_happen_once(sim):
    @cg.graphify(num_warmup_iters=3)
    def bump(x):
        x.add_(1)
        return x * 2

    x = torch.zeros(3)
    with torch.no_grad():
        bump(x)
    assert torch.equal(x, torch.ones(3)) and sim.warmups == 3


def test_outputs_are_copies_unless_zero_copy(sim):
    lin = nn.Linear(3, 3)
    safe = cg.graphify(copy.deepcopy(lin))
    fast = cg.graphify(copy.deepcopy(lin), copy_outputs=False)
    with torch.no_grad():
        xs = [torch.randn(2, 3) for _ in range(4)]
        outs = [safe(x) for x in xs]
        for x, o in zip(xs, outs):
            torch.testing.assert_close(o, lin(x), rtol=0, atol=0)
        fast(xs[0])  # capture (eager result)
        a, b = fast(xs[1]), fast(xs[2])
        # the static output's memory, overwritten by the second call (each call a new tensor
        # object on it)
        assert a is not b and a.data_ptr() == b.data_ptr()
        torch.testing.assert_close(a, lin(xs[2]), rtol=0, atol=0)


def test_zero_copy_outputs_keep_what_the_caller_did_to_the_last_one_to_it(sim):
    # copy_outputs=False once returned the static tensor object itself: an in-place metadata
    # change of one call's output (t_, unsqueeze_, requires_grad_, an attribute) was the next
    # call's output too, transposed or marked as eager never returns it
    lin = nn.Linear(3, 5)
    fast = cg.graphify(copy.deepcopy(lin), copy_outputs=False)
    x = torch.randn(2, 3)
    with torch.no_grad():
        for _ in range(3):
            fast(x)
        y = fast(x)
        y.t_()
        y.unsqueeze_(0)
        y.requires_grad_(True)
        y.tag = "mine"
        z = fast(x)
        want = lin(x)
    assert z.shape == want.shape and z.stride() == want.stride()
    assert not z.requires_grad and not hasattr(z, "tag")
    assert torch.equal(z, want)
    assert y.shape == (1, 5, 2)  # the caller's own tensor kept what was done to it
    assert cg.stats(fast).replays >= 2


def test_inplace_mutation_is_copied_back_and_aliases_map_to_the_input(sim):
    @cg.graphify
    def f(x):
        x.mul_(2)
        return x, x[1:], x + 1

    with torch.no_grad():
        for _ in range(3):
            x = torch.arange(4.0)
            same, view, plus = f(x)
            assert torch.equal(x, torch.arange(4.0) * 2)
            assert same is x and view.data_ptr() == x[1:].data_ptr()
            assert torch.equal(plus, x + 1)
    assert counts(f)[:2] == (1, 2)


def _views_of_the_argument(x):
    return x.view(x.shape), x.view(torch.int32), x[1:].t(), x * 2


def test_views_of_an_argument_come_back_as_new_views_with_their_dtype(sim):
    # an output with the argument's layout was returned as the argument object itself (a
    # caller's out.t_() transposed their input), and a view as another dtype of the same size
    # came back as the argument's dtype
    f = cg.graphify(_views_of_the_argument)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 3)
            outs, want = f(x), _views_of_the_argument(x.clone())
            for o, w in zip(outs, want):
                assert o.dtype == w.dtype and o.shape == w.shape and o.stride() == w.stride()
                assert torch.equal(o, w)
            same, ints, tail, _ = outs
            assert same is not x and same.data_ptr() == x.data_ptr()
            assert ints.data_ptr() == x.data_ptr() and tail.data_ptr() == x[1:].data_ptr()
            same.t_()  # the caller's argument keeps its own shape
            assert x.shape == (4, 3)
            same.add_(1)  # a view: the argument sees the write, and its version moves
            assert torch.equal(x, want[0] + 1) and x._version > 0
    assert counts(f)[:2] == (1, 3)


def test_a_detached_argument_comes_back_writable_outside_no_grad(sim):
    # forward returns x.detach() of an argument that requires grad: eager's output may be
    # written in place later under grad mode; an output made as a view of x (created under
    # no_grad, of a leaf that requires grad) would raise there instead
    def fe(x):
        return x.detach(), x * 2

    f = cg.graphify(fe)
    for _ in range(4):
        x = torch.randn(3, requires_grad=True)
        with torch.no_grad():
            out, _ = f(x)
        assert not out.requires_grad and out.data_ptr() == x.data_ptr()
        out.add_(1)  # under grad mode, as eager allows
        assert torch.equal(out, x.detach())
    assert counts(f)[:2] == (1, 3)


def test_aliases_of_an_argument_are_views_where_eagers_are(sim):
    # x.view(torch.int32) is no view for autograd (eager's allows detach_() and an in-place op
    # with grad); x.view(torch.int32)[1:] is a view of that alias, x[1:] a view of x
    def fe(x):
        return x.view(torch.int32), x.view(torch.int32)[1:], x[1:], x * 2

    f = cg.graphify(fe)
    for _ in range(4):
        x = torch.randn(3, 4)
        with torch.no_grad():
            out, want = f(x), fe(x)
        for o, w in zip(out, want):
            assert o._is_view() == w._is_view() and o.dtype == w.dtype
            assert o.stride() == w.stride() and torch.equal(o, w)
        assert out[0].data_ptr() == x.data_ptr() and out[2].data_ptr() == x[1:].data_ptr()
        out[0].detach_()  # as eager's allows
    assert counts(f)[:2] == (1, 3)


def test_views_of_an_argument_replay_in_inference_mode(sim):
    # (an inference tensor's views are not tracked: no view, and still the caller's memory)
    def fe(x):
        return x[1:], x.t(), x * 2

    f = cg.graphify(fe)
    with torch.inference_mode():
        for _ in range(4):
            x = torch.randn(3, 4)
            out, want = f(x), fe(x)
            assert [o.stride() for o in out] == [w.stride() for w in want]
            assert all(torch.equal(o, w) for o, w in zip(out, want))
            assert out[0].data_ptr() == x[1:].data_ptr()
    assert counts(f)[:2] == (1, 3)


def test_a_conjugate_view_of_an_argument_keeps_its_bit(sim):
    @cg.graphify
    def f(z):
        return z.conj(), z * 2

    with torch.no_grad():
        for _ in range(4):
            z = torch.randn(3, dtype=torch.complex64)
            c, _ = f(z)
            assert c.is_conj() and torch.equal(c, z.conj())
            assert c.data_ptr() == z.data_ptr()
    assert counts(f)[:2] == (1, 3)


def test_a_view_of_an_argument_as_a_dtype_of_another_size_runs_eagerly(sim, quiet):
    @cg.graphify
    def f(x):
        return x.view(torch.uint8)[:, 4:8], x * 2

    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 3)
            b, _ = f(x)
            assert b.dtype == torch.uint8 and torch.equal(b, x.view(torch.uint8)[:, 4:8])
    assert counts(f)[:2] == (0, 0)
    assert "view of argument 0 as torch.uint8" in next(iter(cg.stats(f).eager_calls))


@pytest.mark.parametrize("make", [lambda y: y[:, ::2], lambda y: y.t(), lambda y: y.expand(2, 3, 4),
                                  lambda y: torch.view_as_complex(y.view(3, 2, 2)).conj()])
def test_one_output_comes_back_with_eagers_strides_and_bits(sim, make):
    # a single output that a clone would not give back as eager has it (strided, expanded,
    # conj) is a view of a copy of the bytes it reaches, on every replay
    def fe(x):
        return make(x * 2)

    f = cg.graphify(fe)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, 4)
            out, want = f(x), fe(x)
            assert out.stride() == want.stride() and out.is_conj() == want.is_conj()
            assert torch.equal(out, want)
        again = f(x)
    assert again.data_ptr() != out.data_ptr()  # a copy of its own each call
    assert counts(f)[:2] == (1, 4)


def test_aliased_inputs_with_writes_run_eagerly(sim):
    @cg.graphify
    def f(a, b):
        a.add_(1)
        return b * 1

    x = torch.zeros(3)
    with torch.no_grad():
        out = f(x, x)
    assert torch.equal(out, torch.ones(3))
    assert "share memory" in next(iter(cg.stats(f).eager_calls))


def test_marked_static_input_is_read_in_place(sim):
    @cg.graphify
    def f(x, cache):
        return x + cache

    cache = cg.mark_static(torch.zeros(3))
    with torch.no_grad():
        f(torch.ones(3), cache)
        for i in range(3):
            cache.fill_(i)
            assert torch.equal(f(torch.ones(3), cache), torch.full((3,), i + 1.0))
    s = cg.stats(f)
    assert (s.captures, s.replays, s.input_copies) == (1, 3, 3)  # x copied, cache never
    other = cg.mark_static(torch.zeros(3))
    with torch.no_grad():
        f(torch.ones(3), other)
    assert cg.stats(f).captures == 2  # another address: another graph


def test_parameter_change_invalidates_and_recaptures(sim):
    torch.manual_seed(0)
    ref = nn.Linear(4, 4)
    g = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(2, 4)
    with torch.no_grad():
        g(x), g(x)
        g.weight.data = ref.weight.data * 3
        ref.weight.data = ref.weight.data * 3
        torch.testing.assert_close(g(x), ref(x), rtol=0, atol=0)
        g(x)
    s = cg.stats(g)
    assert (s.captures, s.replays, s.invalidations) == (2, 2, 1)
    assert all(gr.released for gr in sim.graphs[:1])


def test_signatures_that_come_round_more_than_max_graphs_hold_stop_evicting(sim):
    # six sizes in turn through four graphs: least recently used drops each graph just before
    # it is needed again. A key evicted twice runs eagerly from then on, and the graphs kept
    # replay (before: 68 captures and 114 replays in 240 calls, then every new size eager)
    torch.manual_seed(0)
    ref = nn.Linear(8, 8)
    g = cg.graphify(copy.deepcopy(ref), max_graphs=4)
    with torch.no_grad():
        for _ in range(40):
            for n in range(1, 7):
                x = torch.randn(n, 8)
                assert torch.equal(g(x), ref(x))
    s = cg.stats(g)
    assert s.captures <= 16 and s.replays >= 140, s
    thrash = [n for r, n in s.eager_calls.items() if "evicted 2 times before" in r]
    assert thrash and thrash[0] <= 80, s.eager_calls


def test_lru_eviction_and_then_eager_past_the_budget(sim):
    g = cg.graphify(nn.Identity(), cache_policy=cg.CachePolicy(max_graphs=2, max_evictions=2))
    with torch.no_grad():
        for n in (1, 2, 3, 4):
            g(torch.zeros(n))
            g(torch.zeros(n))
        g(torch.zeros(5))
    s = cg.stats(g)
    assert (s.captures, s.evictions, s.graphs) == (4, 2, 2)
    assert any("evictions" in r for r in s.eager_calls)
    assert sum(gr.released for gr in sim.graphs) == 2


def test_key_fn_lets_signatures_share_a_graph(sim):
    @cg.graphify(key_fn=lambda sig: sig.spec)
    def f(x, step):
        return x * 2

    with torch.no_grad():
        for step in range(4):
            f(torch.ones(2), step)
    assert counts(f)[:2] == (1, 3)


def test_unhashable_argument_runs_eagerly_with_reason(sim):
    @cg.graphify
    def f(x, opts):
        return x * max(opts)

    with pytest.warns(cg.CudagraphifyWarning, match="set is not a tensor or an immutable value"):
        warnings.simplefilter("always")
        assert torch.equal(f(torch.ones(2), {3}), torch.full((2,), 3.0))
    assert cg.stats(f).captures == 0


def test_grad_mode_gets_its_own_training_graph(sim):
    torch.manual_seed(0)
    lin = nn.Linear(2, 2)
    g = cg.graphify(copy.deepcopy(lin))
    x = torch.ones(1, 2)
    y = g(x)  # the real (eager) first call: backward works as eagerly
    y.sum().backward()
    lin(x).sum().backward()
    torch.testing.assert_close(g.weight.grad, lin.weight.grad, rtol=0, atol=0)
    assert counts(g) == (1, 0, 0) and sim.captures == 2  # forward and backward graphs
    with torch.no_grad():
        g(x), g(x)
    assert counts(g) == (2, 1, 0)  # grad mode is part of the key
    g.weight.requires_grad_(False)
    g(x)
    assert counts(g) == (3, 1, 0)  # and so is which parameters require grad


def test_warm_up_and_capture_differentiate_aliases_not_the_parameters(sim):
    # DDP keeps each parameter's AccumulateGrad node alive with the stream it was made on; a
    # capture that reached those nodes would sync with that stream and break. Our extra
    # backwards run on aliases of the same memory, in every module that holds the parameter.
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
            self.b.weight = self.a.weight

        def forward(self, x):
            seen.append((self.a.weight is param, self.b.weight is self.a.weight))
            return self.b(torch.tanh(self.a(x)))

    torch.manual_seed(0)
    g = cg.graphify(Tied(), num_warmup_iters=2)
    param = g.a.weight
    seen = []
    g(torch.randn(2, 3)).sum().backward()  # the real call, an extra warm-up, the capture
    assert counts(g) == (1, 0, 0) and sim.captures == 2
    assert seen == [(True, True), (False, True), (False, True)]
    assert g.a.weight is param and g.b.weight is param
    assert cg.stats(g).invalidations == 0 and g(torch.randn(2, 3)) is not None
    assert counts(g) == (1, 1, 0)  # the stand-ins left no change the guard would see


def test_a_parameter_read_around_its_module_runs_eagerly_with_eager_gradients(sim):
    class Side(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.__dict__["w"] = self.lin.weight  # a plain attribute, not registered

        def forward(self, x):
            return self.lin(x) + x @ self.w

    torch.manual_seed(0)
    ref = Side()
    g = cg.graphify(copy.deepcopy(ref))
    g.__dict__["w"] = g.lin.weight
    for _ in range(3):
        x = torch.randn(2, 3)
        g(x).sum().backward()
        ref(x).sum().backward()
    (reason,) = cg.stats(g).eager_calls
    assert "other than through its modules' attributes" in reason
    for p, q in zip(g.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)


def test_parameter_hooks_see_each_real_backward_once_not_the_capture(sim):
    torch.manual_seed(0)
    lin = nn.Linear(2, 2)
    g = cg.graphify(copy.deepcopy(lin), num_warmup_iters=2)  # an extra warm-up backward, too
    seen = {id(lin): [], id(g): []}
    for m in (lin, g):
        m.weight.register_hook(lambda grad, k=seen[id(m)]: k.append(grad.clone()))
        m(torch.ones(1, 2)).sum().backward()
    assert sim.captures == 2  # the forward and the backward graph: both ran backward code
    assert len(seen[id(g)]) == 1
    torch.testing.assert_close(seen[id(g)], seen[id(lin)], rtol=0, atol=0)


def test_capture_failure_marks_the_signature_eager_and_returns_the_right_answer(sim):
    @cg.graphify
    def f(x):
        if sim.capturing:
            raise RuntimeError("operation not permitted when stream is capturing")
        return x + 1

    with torch.no_grad():
        outs = [f(torch.zeros(2)) for _ in range(3)]
    assert all(torch.equal(o, torch.ones(2)) for o in outs)
    s = cg.stats(f)
    assert s.captures == 0 and s.eager_calls == {
        "capture failed: RuntimeError: operation not permitted when stream is capturing": 3}


def test_unknown_output_object_runs_eagerly(sim):
    class Box:
        def __init__(self, t):
            self.t = t

    @cg.graphify
    def f(x):
        return Box(x + 1)

    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(f(torch.zeros(1)).t, torch.ones(1))
    assert "Box" in next(iter(cg.stats(f).eager_calls))


def test_warmup_exception_propagates_and_nothing_is_cached(sim):
    calls = []

    @cg.graphify
    def f(x):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("first call fails")
        return x

    with torch.no_grad():
        with pytest.raises(ValueError, match="first call fails"):
            f(torch.zeros(1))
        f(torch.zeros(1)), f(torch.zeros(1))
    assert counts(f)[:2] == (1, 1)


def test_enabled_callable_is_read_per_call(sim):
    on = [False]
    g = cg.graphify(nn.Identity(), enabled=lambda: on[0])
    with torch.no_grad():
        g(torch.zeros(1))
        on[0] = True
        g(torch.zeros(1)), g(torch.zeros(1))
    assert counts(g) == (1, 1, 1)


def test_nested_graphified_modules_become_part_of_the_outer_graph(sim):
    torch.manual_seed(0)
    ref = GPT(16, 2, 2).eval()
    m = copy.deepcopy(ref)
    for b in m.blocks:
        cg.graphify(b)
    cg.graphify(m)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(1, 2, 16)
            torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)
    assert counts(m) == (1, 2, 0)
    assert all(cg.stats(b).captures == 0 for b in m.blocks)


def test_threads_get_their_own_results(sim):
    torch.manual_seed(0)
    ref = nn.Linear(8, 8)
    g = cg.graphify(copy.deepcopy(ref))
    errors = []

    def work(seed):
        gen = torch.Generator().manual_seed(seed)
        try:
            with torch.no_grad():
                for _ in range(50):
                    x = torch.randn(4, 8, generator=gen)
                    torch.testing.assert_close(g(x), ref(x), rtol=0, atol=0)
        except Exception as e:
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errors and cg.stats(g).replays == 149


def test_region_owns_and_releases_its_graphs(sim):
    g = cg.graphify(nn.Linear(2, 2))
    x = torch.ones(1, 2)
    with torch.no_grad():
        g(x), g(x)
        with cg.graph_region(chain=False) as r:
            g(x), g(x), g(x)
            assert (r.stats().captures, r.stats().replays, r.stats().graphs) == (1, 2, 1)
            with cg.graph_region(enabled=False):
                g(x)
        assert r.closed and r.stats().graphs == 0
        g(x)
    s = cg.stats(g)
    assert (s.captures, s.replays, s.graphs) == (2, 4, 1)
    assert s.eager_calls == {"disabled by graph_region(enabled=False)": 1}
    assert sum(gr.released for gr in sim.graphs) == 1
    with pytest.raises(cg.CudagraphifyError, match="closed"):
        with r:
            pass


def test_a_region_holds_callables_weakly_and_releases_a_deleted_ones_graphs():
    # (A real module deleted inside a region is tested on the GPU: tests/test_gpu_faults.py.)
    from cudagraphify._cache import Owned
    from cudagraphify._region import GraphRegion

    class State:  # what a region reads of a callable's engine state
        policy = cg.CachePolicy()

    class Graph(Owned):
        input_copies, pool_bytes, released = 2, 0, False

        def release(self):
            self.released = True

    region = GraphRegion()
    a, b = State(), State()
    graph_a, graph_b = Graph(), Graph()
    for state, graph in ((a, graph_a), (b, graph_b)):
        graph.owner = state  # held weakly
        region.cache_for(state).put("key", graph)
    assert region.cache_for(b) is region.cache_for(b) and region.stats().graphs == 2
    gone = weakref.ref(b)
    del b, state
    gc.collect()
    assert gone() is None, "the region kept a deleted callable's state alive"
    assert graph_b.owner is None and not graph_b.released  # released by the region, not the GC
    s = region.stats()
    assert graph_b.released and (s.graphs, s.input_copies) == (1, 4)
    c = State()  # a new callable (it may reuse the dead one's id) gets a cache of its own
    assert region.cache_for(c) is not region.cache_for(a) and len(region.cache_for(c)) == 0
    graph_c = Graph()
    graph_c.owner = c
    region.cache_for(c).put("key", graph_c)
    region.forget(c)  # c's statics were invalidated: its graphs go, their copies stay counted
    s = region.stats()
    assert graph_c.released and not graph_a.released and (s.graphs, s.input_copies) == (1, 6)
    region.close()
    assert graph_a.released and region.stats().graphs == 0


def test_an_invalidation_while_another_thread_holds_the_region_does_not_deadlock(sim):
    # Thread a: m's parameters moved, so its call (holding m's lock) drops m's graphs in every
    # open region. Thread b: a call in that region (holding the region's lock) then calls m.
    m = cg.graphify(nn.Linear(4, 4))
    x = torch.randn(2, 4)
    inside, go = threading.Event(), threading.Event()
    done: dict = {}

    def b():
        with torch.no_grad(), cg.graph_region() as r:
            m(x), m(x)  # m's graph in the region, from the old weight
            with r.lock:  # as a region call does while it runs
                inside.set()
                go.wait(5)
                before = r.stats().captures
                done["b"] = (m(x), r.stats().captures - before, r.stats().graphs)

    def a():
        with torch.no_grad():
            done["a"] = m(x)

    tb = threading.Thread(target=b, daemon=True)
    tb.start()
    assert inside.wait(5)
    m.weight = nn.Parameter(m.weight.detach() * 2)
    ta = threading.Thread(target=a, daemon=True)
    ta.start()
    ta.join(0.5)  # a cannot take the region's lock: it must not wait for it either
    go.set()
    ta.join(5), tb.join(5)
    assert set(done) == {"a", "b"}, f"deadlock: only {set(done)} finished"
    want = torch.nn.functional.linear(x, m.weight, m.bias)
    y, recaptured, graphs = done["b"]
    torch.testing.assert_close(done["a"], want, rtol=0, atol=0)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    # the old graph was released before m's next call in the region, which captured anew
    assert (recaptured, graphs) == (1, 1)


def test_ungraphify_releases_graphs_and_restores_eager(sim):
    m = cg.graphify(nn.Linear(2, 2))
    with torch.no_grad():
        m(torch.ones(1, 2)), m(torch.ones(1, 2))
    cg.ungraphify(m)
    assert all(gr.released for gr in sim.graphs)
    with torch.no_grad():
        m(torch.ones(1, 2))
    assert sim.captures == 1


def test_cpu_tensors_without_a_backend_run_eagerly():
    m = cg.graphify(nn.Linear(2, 2))
    with torch.no_grad():
        y = m(torch.ones(1, 2))
    torch.testing.assert_close(y, m.__dict__["forward"].__wrapped__(torch.ones(1, 2)))
    assert cg.stats(m).eager_calls == {"tensors are on cpu, not on a CUDA device": 1}


def test_a_shared_policy_lets_interchangeable_modules_replay_one_graph(sim):
    torch.manual_seed(0)
    policy = cg.CachePolicy(shared=True)
    lin = nn.Linear(4, 4)
    a = cg.graphify(lin, cache_policy=policy)
    b = copy.deepcopy(a)  # a deep copy is graphified with the same options (the same policy)
    x = torch.randn(2, 4)
    with torch.no_grad():
        want = a(x)
        for _ in range(3):
            torch.testing.assert_close(b(x), want, rtol=0, atol=0)
        assert counts(a) == (1, 0, 0) and counts(b) == (0, 3, 0)
        # the capturing module's parameters move: its graph is dropped, b captures its own
        a.weight.data = a.weight.data * 2
        torch.testing.assert_close(b(x), b.__dict__["forward"].__wrapped__(x), rtol=0, atol=0)
    assert cg.stats(a).invalidations == 1 and cg.stats(b).captures == 1
    cg.ungraphify(b)  # releases only b's graphs
    assert cg.stats(a).graphs == 0 and len(policy.new_cache()) == 0


def test_a_shared_graph_whose_capturing_module_is_gone_is_dropped_not_replayed(sim):
    # Entries hold their owner weakly: once the capturing module is gone, its graph would read
    # freed memory. (The simulated graphs keep the captured function alive, so the owner's
    # death is simulated by pointing the entry at a dead reference.)
    policy = cg.CachePolicy(shared=True)
    a = cg.graphify(nn.Linear(4, 4), cache_policy=policy)
    b = copy.deepcopy(a)
    x = torch.randn(2, 4)
    with torch.no_grad():
        a(x), b(x)
        assert counts(b) == (0, 1, 0)
        (entry,) = policy.new_cache().graphs()

        class Gone:
            pass

        gone = Gone()
        entry._owner = weakref.ref(gone)
        del gone
        assert entry.orphaned and entry.owner is None
        torch.testing.assert_close(b(x), b.__dict__["forward"].__wrapped__(x), rtol=0, atol=0)
    assert counts(b) == (1, 1, 0)  # b captured its own graph
    graphs = policy.new_cache().graphs()
    assert len(graphs) == 1 and graphs[0] is not entry and sim.graphs[0].released


class _Scaled(nn.Module):
    """Reads a Python attribute of its own: its graphs' guards read the module."""

    def __init__(self, scale=0.5):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = scale

    def forward(self, x):
        return self.lin(x) * self.scale


@pytest.mark.parametrize("where", ["shared policy", "region"])
def test_a_deleted_module_whose_guards_read_it_is_freed_and_its_graphs_released(sim, where):
    # A graph's guard reads the module's own attributes (self.scale) and the modules it ran:
    # an entry held by a cache that outlives the module (a shared policy's, an open region's)
    # must not keep it, its parameters and its graphs alive (it did: StateGuard held them).
    policy = cg.CachePolicy(max_graphs=2, shared=True)
    options = {"cache_policy": policy} if where == "shared policy" else {}
    x = torch.randn(2, 4)
    with torch.no_grad(), cg.graph_region() if where == "region" else contextlib.nullcontext():
        a = cg.graphify(_Scaled(), **options)
        a(x), a(x)
        assert cg.stats(a).captures == 1 and cg.stats(a).replays >= 1
        graph = sim.graphs[-1]
        gone = weakref.ref(a)
        del a
        gc.collect()
        assert gone() is None, "a cache entry kept the deleted module alive"
        b = cg.graphify(_Scaled(2.0), **options)
        want = b.__dict__["forward"].__wrapped__(x)
        for _ in range(3):
            assert torch.equal(b(x), want)
        s = cg.stats(b)
        assert s.captures == 1 and s.replays >= 2 and s.eager == 0 and graph.released


def test_an_orphaned_shared_graph_is_released_after_the_devices_queued_work(sim):
    # Any callable of a shared policy may have replayed the graph last, on its own stream:
    # dropping it waits for all of the device's queued work (a CUDA backend's drain_all)
    policy = cg.CachePolicy(shared=True)
    x = torch.randn(2, 4)
    with torch.no_grad():
        a = cg.graphify(_Scaled(), cache_policy=policy)
        a(x), a(x)
        graph = sim.graphs[-1]
        waited = []
        sim.drain_all = lambda device: waited.append((device, graph.released))
        del a
        gc.collect()
        b = cg.graphify(_Scaled(2.0), cache_policy=policy)
        assert torch.equal(b(x), b.__dict__["forward"].__wrapped__(x))
    assert waited == [(torch.device("cpu"), False)] and graph.released


def test_a_guard_holds_its_modules_tree_weakly_and_a_gone_module_fails_it():
    # The guard's reads of the root's own tree are weak (a module outside it, such as one
    # forward builds on every call, is held as read: it cannot lead back to the owner); once
    # a weakly held module is gone the guard no longer holds, whatever the epoch did.
    from cudagraphify import _watch
    from cudagraphify._guards import StateGuard
    from cudagraphify._watch import Read

    mine, built = _Scaled(), _Scaled(3.0)
    guard = StateGuard([Read(mine, "scale", 0.5), Read(built, "scale", 3.0)], ran=[mine, built],
                       owned=frozenset([id(mine)]))
    assert guard.valid()
    held, gone = weakref.ref(built), weakref.ref(mine)
    del built, mine
    gc.collect()
    assert held() is not None and gone() is None
    _watch.bump()
    assert not guard.valid()
    assert "deleted" in guard._changed()


def test_backward_checks_the_callers_statics_not_the_capturing_modules(sim):
    # Under a shared policy the caller's parameters are other tensors than the capturer's;
    # what must not move before backward are the caller's own (frozen ones included).
    from cudagraphify._training import TrainingGraph

    class Statics:
        def __init__(self, tensors):
            self.tensors, self.ptrs = tensors, [t.data_ptr() for t in tensors]

    frozen, w = torch.randn(3), torch.randn(3, requires_grad=True)
    state = types.SimpleNamespace(statics=Statics([w, frozen]), train_eager=None)
    state.refuse_training = lambda reason: setattr(state, "train_eager", reason)
    replays = []
    graph = types.SimpleNamespace(
        _bwd_raw=types.SimpleNamespace(replay=lambda: replays.append(1)), gen=1, out_diff=[],
        _grad_out=[], _hand_out=lambda ctx: ())
    ctx = types.SimpleNamespace(done=False, gen=1, state=state, params=(torch.randn(3),))
    assert TrainingGraph._backward(graph, ctx, ()) == () and replays == [1]
    frozen.data = frozen.data.clone()  # a frozen weight the backward graph reads moved
    ctx.done = ctx.started = False
    with pytest.raises(cg.CudagraphifyError, match="moved to new memory between a graphed"):
        TrainingGraph._backward(graph, ctx, ())
    assert replays == [1] and "between a forward and its backward" in state.train_eager


def test_the_graphed_autograd_function_passes_one_gradient_per_input():
    # What a replayed training call hands autograd: forward outputs, then per tensor input the
    # backward's gradient (the graph and the caller's state are not tensors).
    from cudagraphify._training import _GraphedFunction

    x, w = torch.randn(2, 3, requires_grad=True), torch.randn(3, requires_grad=True)
    seen = []

    class Graph:
        _n_user, gen, out_diff, saved, saved_statics = 1, 0, [True], [], []

        def forward(self, tensors):
            return [(tensors[0] * tensors[1]).detach()]

        def backward(self, ctx, grads):
            seen.append(ctx.state)
            (g,) = grads
            return g * 2, g.sum(0) * 3

    state = object()
    (y,) = _GraphedFunction.apply(Graph(), state, x, w)
    y.sum().backward()
    assert seen == [state]
    torch.testing.assert_close(x.grad, torch.full((2, 3), 2.0))
    torch.testing.assert_close(w.grad, torch.full((3,), 6.0))


def test_a_tensor_eager_would_save_changed_in_place_before_backward_raises_as_eagerly():
    # The graphed Function saves what the warm-up saw autograd save (here: w), so autograd's
    # own version check raises at backward, as it does eagerly, instead of a silent gradient.
    from cudagraphify._training import _GraphedFunction

    x, w = torch.randn(2, 3, requires_grad=True), torch.randn(3, requires_grad=True)

    class Graph:
        _n_user, gen, out_diff, saved, saved_statics = 1, 0, [True], [1], []

        def forward(self, tensors):
            return [(tensors[0] * tensors[1]).detach()]

        def backward(self, ctx, grads):
            return grads[0] * 2, grads[0].sum(0)

    (y,) = _GraphedFunction.apply(Graph(), None, x, w)
    with torch.no_grad():
        w.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def _chain(n=4, seed=0):
    torch.manual_seed(seed)
    ref = nn.Sequential(*[nn.Linear(8, 8) for _ in range(n)])
    g = copy.deepcopy(ref)
    for blk in g:
        cg.graphify(blk)
    return ref, g


def test_region_chains_blocks_without_copies_between_them(sim):
    ref, g = _chain()
    with torch.no_grad(), cg.graph_region() as r:
        for _ in range(5):
            x = torch.randn(2, 8)
            torch.testing.assert_close(g(x), ref(x), rtol=0, atol=0)
        s = r.stats()
        assert s.moved_outputs == 0  # nobody kept an output: nothing was copied out
        # one copy per forward (the first block's input), none between blocks
        assert (s.captures, s.replays, s.input_copies) == (4, 20, 5)
        assert all(e.borrowed for e in r.cache_for(g[1].__dict__["_cudagraphify_state"]).graphs())
    assert r.stats().graphs == 0 and all(gr.released for gr in sim.graphs)


def test_region_outputs_kept_by_the_caller_are_not_overwritten(sim):
    ref, g = _chain()
    with torch.no_grad(), cg.graph_region() as r:
        g(torch.randn(2, 8))  # capture
        xs = [torch.randn(2, 8) for _ in range(3)]
        kept = [g(x) for x in xs]  # each kept output is moved to a copy before the next replay
        for x, y in zip(xs, kept):
            torch.testing.assert_close(y, ref(x), rtol=0, atol=0)
        assert r.stats().moved_outputs == 2  # kept[0] and kept[1], before the next replays
        y = g(xs[0])
        y.add_(1)  # mutating an output is fine: it is the caller's
        torch.testing.assert_close(y, ref(xs[0]) + 1, rtol=0, atol=0)
        torch.testing.assert_close(g(xs[1]), ref(xs[1]), rtol=0, atol=0)


def test_region_output_held_through_a_view_forces_eager_not_corruption(sim):
    ref, g = _chain(n=2)
    with torch.no_grad(), cg.graph_region():
        g(torch.randn(2, 8))
        x1, x2 = torch.randn(2, 8), torch.randn(2, 8)
        view = g(x1)[0]  # only a view of the output survives
        want = ref(x1)[0].clone()
        out2 = g(x2)
        torch.testing.assert_close(view, want, rtol=0, atol=0)
        torch.testing.assert_close(out2, ref(x2), rtol=0, atol=0)
    assert any("through a view" in r for r in cg.stats(g[1]).eager_calls)


def test_region_input_from_elsewhere_into_a_borrowed_buffer_protects_the_alias(sim):
    ref, g = _chain(n=2)
    with torch.no_grad(), cg.graph_region():
        g(torch.randn(2, 8))
        h = g[0](torch.randn(2, 8))  # an alias of block 0's output, kept
        h_want = h.clone()
        other = torch.randn(2, 8)
        torch.testing.assert_close(g[1](other), ref[1](other), rtol=0, atol=0)
        torch.testing.assert_close(h, h_want, rtol=0, atol=0)


def test_region_borrowed_buffer_on_the_fast_path_protects_a_kept_alias_only(sim, monkeypatch):
    # (block 1's graph reads block 0's output slot in place; called with another tensor, its
    # copy-in overwrites that slot: the fast path moves a kept alias of it to a copy first,
    # and with none kept copies nothing)
    from cudagraphify import _fast

    ref, g = _chain(n=2)
    fast_hits = []
    call = _fast.Fast.call

    def spy(self, fn, args, kwargs):
        out = call(self, fn, args, kwargs)
        fast_hits.append(out is not _fast.MISS)
        return out

    monkeypatch.setattr(_fast.Fast, "call", spy)
    with torch.no_grad(), cg.graph_region() as r:
        for _ in range(3):
            g(torch.randn(2, 8))
        state = g[1].__dict__["_cudagraphify_state"]
        assert type(state._fast) is _fast.Fast and state._fast.entry.borrowed
        for keep in (True, False, True, False):
            h = g[0](torch.randn(2, 8))  # an alias of block 0's slot
            h_want = h.clone()
            if not keep:
                del h
            moved = r.stats().moved_outputs
            fast_hits.clear()
            other = torch.randn(2, 8)
            torch.testing.assert_close(g[1](other), ref[1](other), rtol=0, atol=0)
            assert fast_hits == [True]  # (block 1's replay took the fast path)
            assert r.stats().moved_outputs == moved + keep
            if keep:
                torch.testing.assert_close(h, h_want, rtol=0, atol=0)


def test_inference_mode_calls_are_graphed_and_writes_still_seen(sim):
    torch.manual_seed(0)
    with torch.inference_mode():
        m = nn.BatchNorm1d(4).train()  # writes its running statistics in forward
        ref = copy.deepcopy(m)
        g = cg.graphify(m)

        @cg.graphify
        def bump(x):
            x.add_(1)
            return x * 2

        for _ in range(3):
            x = torch.randn(8, 4)
            torch.testing.assert_close(g(x), ref(x), rtol=0, atol=0)
            y = torch.zeros(2)
            torch.testing.assert_close(bump(y), torch.full((2,), 2.0), rtol=0, atol=0)
            assert torch.equal(y, torch.ones(2))  # the write reached the caller's tensor
    # (running statistics: the simulated capture runs the forward once more; see test_gpu.py)
    assert counts(g)[:2] == (1, 2) and counts(bump)[:2] == (1, 2)


def test_region_alias_passed_twice_is_borrowed_once(sim):
    g = cg.graphify(nn.Identity())

    @cg.graphify
    def f(a, b):
        return a - b

    with torch.no_grad(), cg.graph_region():
        g(torch.ones(3))
        a = g(torch.ones(3))
        f(a, a)
        torch.testing.assert_close(f(torch.full((3,), 10.0), torch.full((3,), 3.0)),
                                   torch.full((3,), 7.0), rtol=0, atol=0)


def test_gapped_slices_keep_their_layout_and_aliases(sim):
    @cg.graphify(copy_outputs=False)
    def first_row(x):
        return x[0]

    @cg.graphify
    def scale_(x):
        return x.mul_(2)

    with torch.no_grad():
        base = torch.ones(4, 6)
        for _ in range(3):
            x = base[:, :2]  # not contiguous, with gaps: nothing overlaps
            y = first_row(x)
            assert y.data_ptr() == x.data_ptr()  # a view of the caller's tensor
            assert scale_(x) is x
    assert counts(first_row)[:2] == (1, 2) and counts(scale_)[:2] == (1, 2)
    assert torch.equal(base[:, :2], torch.full((4, 2), 8.0))


def test_a_training_graph_waiting_for_its_backward_is_not_evicted(sim):
    # (evicted, its backward would raise "released before the backward ran": it is kept past
    # max_graphs until a later capture finds its backward done)
    torch.manual_seed(0)
    ref = nn.Linear(4, 4)
    m = cg.graphify(copy.deepcopy(ref), max_graphs=1)
    xa, xb, xc = torch.randn(2, 4), torch.randn(3, 4), torch.randn(5, 4)
    m(xa), ref(xa)  # warm-up + capture of A
    ya, wa = m(xa), ref(xa)  # replay of A, its backward pending
    assert torch.equal(ya, wa)
    m(xb), ref(xb)  # B's capture: A waits, kept
    assert cg.stats(m).graphs == 2 and cg.stats(m).evictions == 0
    ya.sum().backward(), wa.sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    m(xc)  # C's capture: nothing waits now, back to max_graphs
    assert cg.stats(m).graphs == 1 and cg.stats(m).evictions == 2


def test_region_graph_returning_a_view_of_a_borrowed_input_does_not_pin_it(sim):
    @cg.graphify
    def g(x):
        return x * 2

    @cg.graphify
    def h(a):
        return a[1:]

    with torch.no_grad(), cg.graph_region():
        for _ in range(4):
            x = torch.randn(3)
            torch.testing.assert_close(h(g(x)).clone(), x[1:] * 2, rtol=0, atol=0)
    assert cg.stats(g).eager == 0 and cg.stats(h).eager == 0


def test_static_objects_are_not_touched_by_extra_warmups(sim):
    class State:
        t = 0.0

    @cg.graphify(num_warmup_iters=3, static_argnames=("state",))
    def step(x, state):
        state.t += 1
        return x + 1

    s = State()
    with torch.no_grad():
        step(torch.zeros(2), s)
        step(torch.zeros(2), s)
    # the two real calls: no extra warm-up, no capture (the first call changed the object:
    # a side effect a replay cannot repeat, decided at once)
    assert s.t == 2.0 and cg.stats(step).captures == 0
    (reason,) = cg.stats(step).eager_calls
    assert "forward changes argument 1" in reason and "side effect" in reason


def test_pieces_do_not_inherit_the_roots_argument_names_or_cache_policy(sim):
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Tanh()

        def forward(self, x, cache=None):
            y = self.a(x)
            if y.sum() > 1e9:  # a host sync: the root runs piecewise
                y = y * 0
            return self.b(y)

    torch.manual_seed(0)
    ref = Root()
    g = cg.graphify(copy.deepcopy(ref), static_argnames=("cache",),
                    cache_policy=cg.CachePolicy(shared=True))
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 4)
            torch.testing.assert_close(g(x), ref(x), rtol=0, atol=0)
    # (the pieces chain in the root's implicit region: a capture there replays to give the
    # call its output, so calls 2-4 are 3 replays each)
    assert cg.stats(g.a).replays == 3 and cg.stats(g.b).replays == 3
    total = cg.stats(g)  # the root's counters include its graphed pieces'
    assert (total.captures, total.replays) == (2, 6), total
    assert all(r.startswith("piecewise") for r in total.eager_calls), total


def test_a_policy_cannot_mix_up_keyword_arguments_or_signed_zeros(sim):
    @cg.graphify(key_fn=lambda sig: sig.constants)
    def f(x, y):
        return x - y

    @cg.graphify
    def g(x, s):
        return 1 / (x * s)

    a, b = torch.full((2,), 5.0), torch.full((2,), -4.0)
    with torch.no_grad():
        f(x=a, y=b), f(x=a, y=b)
        torch.testing.assert_close(f(y=b, x=a), a - b, rtol=0, atol=0)
        g(torch.ones(1), 0.0), g(torch.ones(1), 0.0)
        assert g(torch.ones(1), -0.0).item() == float("-inf")


def test_eager_decisions_are_bounded():
    @cg.graphify
    def f(x, k):
        return x * k

    with torch.no_grad():
        for k in range(600):
            f(torch.ones(1), float(k))
    assert len(f._self_dispatch.state.cache) <= 256


def test_tensors_on_several_devices_run_eagerly_with_the_reason(sim):
    @cg.graphify
    def f(a, b):
        return a.sum() + b.shape[0]

    with torch.no_grad():
        assert f(torch.ones(2), torch.empty(3, device="meta")).item() == 5.0
    (reason,) = cg.stats(f).eager_calls
    assert reason.startswith("tensors on several devices") and "meta" in reason


def test_keyboard_interrupt_during_capture_reaches_the_caller_and_nothing_is_cached(sim):
    interrupt = [True]

    @cg.graphify
    def f(x):
        if sim.capturing and interrupt[0]:
            raise KeyboardInterrupt
        return x + 1

    with torch.no_grad():
        with pytest.raises(KeyboardInterrupt):
            f(torch.zeros(1))
        interrupt[0] = False
        f(torch.zeros(1))  # the next call warms up and captures again
        torch.testing.assert_close(f(torch.zeros(1)), torch.ones(1), rtol=0, atol=0)
    assert counts(f) == (1, 1, 0)



def _fake_graph(grad_in: list, n_user: int):
    """What TrainingGraph._hand_out and grads_held read, around gradient buffers a test fills."""
    g = types.SimpleNamespace(_grad_in=grad_in, _n_user=n_user, grads_aliased=0, grads_adopted=0)
    TrainingGraph._watch_gradients(g)
    return g


class _Replayed(torch.autograd.Function):
    """y = x @ w + b whose backward, like a graph replay, writes fixed gradient buffers."""

    @staticmethod
    def forward(ctx, graph, x, w, b):
        ctx.graph, ctx.params = graph, (w, b)
        ctx.save_for_backward(x)
        # what the engine does before each replay
        assert not TrainingGraph.grads_held(graph, [w, b]), "a call the engine runs eagerly"
        return x @ w + b

    @staticmethod
    def backward(ctx, gy):
        (x,) = ctx.saved_tensors
        gx, gw, gb = ctx.graph._grad_in
        gx.copy_(gy @ ctx.params[0].T)
        gw.copy_(x.T @ gy)
        gb.copy_(gy.sum(0))
        return (None,) + TrainingGraph._hand_out(ctx.graph, ctx)


def test_parameter_gradients_are_static_buffers_only_where_autograd_keeps_nothing():
    w, b = torch.randn(3, 2, requires_grad=True), torch.randn(2, requires_grad=True)
    graph = _fake_graph([torch.empty(4, 3), torch.empty(3, 2), torch.empty(2)], 1)
    w_ref, b_ref = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    xs = [torch.randn(4, 3, requires_grad=True) for _ in range(6)]
    kept, kept_ref = [], []
    b.register_hook(kept.append)
    b_ref.register_hook(kept_ref.append)
    for i, x in enumerate(xs[:4]):
        if i == 2:
            w.grad = b.grad = w_ref.grad = b_ref.grad = None
        _Replayed.apply(graph, x, w, b).square().sum().backward()
        (x @ w_ref + b_ref).square().sum().backward()
    torch.testing.assert_close((w.grad, b.grad), (w_ref.grad, b_ref.grad))
    torch.testing.assert_close(kept, kept_ref)  # a hook's gradient is never a static buffer
    # Calls 0 and 2 (.grad None) hand w's buffer itself to autograd as .grad; before calls 1
    # and 3 it is moved to a copy, and the buffer is added into it. The hooked b always gets a
    # copy, and so does the input x.
    assert (graph.grads_aliased, graph.grads_adopted) == (2, 2)
    assert w.grad.data_ptr() != graph._grad_in[1].data_ptr()
    # autograd.grad hands the gradients to the caller: copies the next backward leaves alone
    got = [torch.autograd.grad(_Replayed.apply(graph, x, w, b).sum(), (w, b)) for x in xs[4:]]
    want = [torch.autograd.grad((x @ w_ref + b_ref).sum(), (w_ref, b_ref)) for x in xs[4:]]
    torch.testing.assert_close(got, want)
    # backward(inputs=[x]) executes no AccumulateGrad: w.grad is untouched
    before = w.grad.clone()
    _Replayed.apply(graph, xs[0], w, b).sum().backward(inputs=[xs[0]])
    assert torch.equal(w.grad, before) and (graph.grads_aliased, graph.grads_adopted) == (2, 2)


def test_adopted_gradients_are_the_buffers_and_never_change_under_their_holders():
    ps = [torch.randn(3, 2, requires_grad=True), torch.randn(2, requires_grad=True),
          torch.randn(2, dtype=torch.float64, requires_grad=True)]
    bufs = [torch.randn(3, 2), torch.randn(2), torch.randn(2, dtype=torch.float64)]
    graph = _fake_graph([torch.empty(0)] + bufs, 1)

    class Three(torch.autograd.Function):
        @staticmethod
        def forward(ctx, g, x, *params):
            ctx.graph, ctx.params = g, params
            return x.clone()

        @staticmethod
        def backward(ctx, gy):
            return (None,) + TrainingGraph._hand_out(ctx.graph, ctx)

    def step():
        Three.apply(graph, torch.zeros(0, requires_grad=True), *ps).sum().backward()

    step()  # .grad None: autograd adopts the buffers themselves, as make_graphed_callables
    assert all(p.grad.data_ptr() == b.data_ptr() for p, b in zip(ps, bufs))
    assert graph.grads_adopted == 3
    kept, values = ps[0].grad, [p.grad.clone() for p in ps]
    # before the next replay: each .grad still on a buffer moves to a copy, with its holders
    assert not TrainingGraph.grads_held(graph, ps)
    for b in bufs:  # the replay
        b.add_(1)
    assert all(torch.equal(p.grad, v) for p, v in zip(ps, values)) and torch.equal(kept, values[0])
    assert all(p.grad.data_ptr() != b.data_ptr() for p, b in zip(ps, bufs))
    for p in ps:
        p.grad = None
    step()
    view = ps[1].grad.view(-1)  # another tensor on a buffer: no replay may overwrite it
    for p in ps:
        p.grad = None
    assert TrainingGraph.grads_held(graph, ps)  # the engine runs that call eagerly
    del view
    assert not TrainingGraph.grads_held(graph, ps) and not graph._handed


def test_garbage_collection_stays_off_until_the_last_concurrent_capture_ends():
    import gc

    from cudagraphify._capture import _gc_hold

    assert gc.isenabled()
    _gc_hold(+1)
    _gc_hold(+1)  # a second thread's capture
    _gc_hold(-1)
    assert not gc.isenabled()  # the first capture ended; the second still runs
    _gc_hold(-1)
    assert gc.isenabled()
    gc.disable()  # a caller that keeps it off finds it off afterwards
    try:
        _gc_hold(+1)
        _gc_hold(-1)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_parameters_that_move_on_every_call_run_eagerly_until_they_stay_put(sim):
    lin = nn.Linear(3, 3)
    g = cg.graphify(copy.deepcopy(lin))
    x = torch.ones(1, 3)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudagraphifyWarning)
        for _ in range(8):  # a new weight tensor on every call (as FSDP2's resharding does)
            for m in (lin, g):
                m.weight = nn.Parameter(m.weight.detach() + 1)
            torch.testing.assert_close(g(x), lin(x), rtol=0, atol=0)
        s = cg.stats(g)
        assert s.captures == 5 and s.eager == 3, s  # 4 moves re-capture, then eager
        for _ in range(16 + 2):  # the weights stay put: after 16 calls captured, then replayed
            torch.testing.assert_close(g(x), lin(x), rtol=0, atol=0)
    s = cg.stats(g)
    assert (s.captures, s.replays, s.eager) == (6, 2, 3 + 15), s


def test_parameters_that_keep_moving_run_eagerly_until_they_stand_still(sim):
    # FSDP2 re-gathers parameters after resharding, often (not always) at a new address: a
    # move on most calls, with still calls between, must not re-capture on every move.
    torch.manual_seed(0)
    g = cg.graphify(nn.Linear(4, 4))
    a, b = g.weight.data.clone(), g.weight.data * 2
    with torch.no_grad():
        for i in range(30):
            g.weight.data = b.clone() if i % 3 else a.clone()  # new memory 2 calls in 3
            x = torch.randn(2, 4)
            torch.testing.assert_close(g(x), nn.functional.linear(x, g.weight, g.bias))
        s = cg.stats(g)
        assert s.captures <= 5 and s.eager >= 20, s
        (reason,) = [r for r in s.eager_calls if "keep moving" in r]
        assert "FSDP2" in reason and "moved to new memory" in reason
        for _ in range(16 + 3):  # standing still: graphs again after 16 calls
            x = torch.randn(2, 4)
            torch.testing.assert_close(g(x), nn.functional.linear(x, g.weight, g.bias))
    s2 = cg.stats(g)
    assert s2.captures == s.captures + 1 and s2.replays >= s.replays + 2, s2


def test_a_failed_extra_warm_up_keeps_the_real_call_and_leaves_no_trace_in_buffers(sim):
    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(3)
            self.runs = 0

        def forward(self, x):
            self.runs += 1
            y = self.bn(x)
            if self.runs == 2:  # only in cudagraphify's extra warm-up
                raise RuntimeError("out of luck")
            return y

    torch.manual_seed(0)
    ref = Flaky()
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=2)
    x = torch.randn(4, 3)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudagraphifyWarning)
        torch.testing.assert_close(g(x), ref(x), rtol=0, atol=0)  # the real call's result
        for name, buf in ref.bn.named_buffers():  # the failed run's update was rolled back
            torch.testing.assert_close(getattr(g.bn, name), buf, rtol=0, atol=0, msg=name)
        assert g.runs == ref.runs == 1  # nor in its attributes: the second call fails as eager's
        for m in (ref, g):
            with pytest.raises(RuntimeError, match="out of luck"):
                m(x)
        torch.testing.assert_close(g(x), ref(x), rtol=0, atol=0)
    (reason, *_) = cg.stats(g).eager_calls
    assert "extra warm-up failed: RuntimeError: out of luck" in reason, cg.stats(g)



def test_parameters_moved_before_backward_are_a_clear_error_then_eager(sim):
    # The backward graph reads the parameters where the forward found them: a parameter moved
    # in between (FSDP2 resharding does this) must never yield gradients of stale memory.
    torch.manual_seed(0)
    model = cg.graphify(nn.Linear(4, 3))
    x = torch.randn(2, 4)
    model(x).sum().backward()  # warm-up and capture: backward as eagerly
    y = model(x)  # the forward graph replays
    assert cg.stats(model).replays == 1
    model.weight.data = model.weight.data.clone()  # same values, new memory
    with pytest.raises(cg.CudagraphifyError, match="moved to new memory between a graphed"):
        y.sum().backward()
    model.zero_grad()
    model(x).sum().backward()  # from now on, training calls run eagerly
    torch.testing.assert_close(model.weight.grad, torch.ones(3, 1) * x.sum(0))
    s = cg.stats(model)
    assert s.replays == 1 and any("between a forward and its backward" in r
                                  for r in s.eager_calls), s
    with torch.no_grad():  # inference calls still graph
        model(x), model(x)
    assert cg.stats(model).replays == 2


class _CaptureAware(nn.Module):
    """As HF transformers' mask building: a shortcut when not being captured (``"sync"``: one
    that syncs; ``"skip"``: fewer ops), and a longer, graph-safe path while captured (same
    result). ``sync_always``: the captured path has a sync of its own."""

    def __init__(self, sync_always: bool = False, shortcut: str = "sync"):
        super().__init__()
        self.shortcut = shortcut
        self.lin = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))
        self.sync_always = sync_always

    def forward(self, x):
        self.calls += 1
        y = self.lin(x)
        if not torch.cuda.is_current_stream_capturing():
            if self.shortcut == "sync" and bool((y > -1e9).all()):  # a host sync
                return y
            if self.shortcut == "skip":  # fewer ops, no sync (as HF BERT's)
                return y
        if self.sync_always and y.sum() > 1e9:
            y = y * 0
        return torch.where(y > -1e9, y, torch.zeros_like(y))


class _SkipsAFixUpWhenCaptured(nn.Module):
    """A NaN fix-up skipped while captured: the captured path computes something else."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if not torch.cuda.is_current_stream_capturing() and bool(torch.isnan(y).any()):
            y = torch.nan_to_num(y)
        return y


class _WritesOnlyWhenCaptured(nn.Module):
    def __init__(self, what: str):
        super().__init__()
        self.what = what
        self.lin = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        if torch.cuda.is_current_stream_capturing():
            if self.what == "buffer":
                self.count += 1
            else:
                x.mul_(2)
                return self.lin(x)
        elif bool((x > -1e9).all()):  # a host sync
            x = x * 2 if self.what == "input" else x
        return self.lin(x)


@pytest.fixture
def faithful(sim, monkeypatch):
    """The simulated capture, answering torch.cuda.is_current_stream_capturing() as a real
    one does: "yes" while it captures (a replay runs no Python that could ask)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: sim.capturing)
    return sim


def _trusting(*modules: str) -> cg.OpPolicy:
    policy = cg.OpPolicy()
    policy.TRUSTED_CAPTURED_PATHS = modules
    return policy


def _calls_equal(model, policy=None, calls: int = 4, x=None) -> cg.Stats:
    torch.manual_seed(0)
    ref = copy.deepcopy(model)
    g = cg.graphify(model, op_policy=policy)
    with torch.no_grad():
        for _ in range(calls):
            inp = torch.randn(2, 4) if x is None else x.clone()
            torch.testing.assert_close(g(inp.clone()), ref(inp.clone()), rtol=0, atol=0,
                                       equal_nan=True)
    return cg.stats(g)


@pytest.mark.parametrize("sync_always,shortcut", [(False, "sync"), (True, "sync"),
                                                   (False, "skip"), (True, "skip")])
def test_trusted_code_that_asks_whether_it_is_captured_is_planned_on_its_captured_path(
        faithful, sync_always, shortcut):
    torch.manual_seed(0)
    model = _CaptureAware(sync_always, shortcut)
    calls = model.calls.clone()
    s = _calls_equal(model, _trusting(__name__))
    if sync_always:  # the captured path syncs too: piecewise, its Linear graphed
        assert all(r.startswith("piecewise") for r in s.eager_calls), s
        assert cg.stats(model.lin).captures == 1
    else:  # the warm-up's sync or shortcut is on a path a capture never takes: one graph
        assert (s.captures, s.replays, s.eager) == (1, 3, 0), s
    # the rehearsal's write to the buffer is undone, and a capture runs no kernel: the buffer
    # counts the 4 real calls
    assert model.calls.item() == calls.item() + 4


def test_untrusted_code_that_asks_whether_it_is_captured_keeps_the_eager_paths_plan(faithful):
    # A NaN fix-up skipped while captured: a graph of the captured path would miss it.
    x = torch.randn(2, 4)
    x[0, 0] = float("nan")
    s = _calls_equal(_SkipsAFixUpWhenCaptured(), x=x)  # default policy: test code untrusted
    assert s.eager == 4 and all(r.startswith("piecewise") for r in s.eager_calls), s


@pytest.mark.parametrize("what", ["buffer", "input"])
def test_a_captured_path_that_writes_what_the_eager_one_does_not_is_not_trusted(faithful,
                                                                                 what):
    model = _WritesOnlyWhenCaptured(what)
    s = _calls_equal(model, _trusting(__name__))
    assert s.eager == 4 and all(r.startswith("piecewise") for r in s.eager_calls), s
    assert model.count.item() == 0  # the rehearsal's write was undone


class _CountsInAPlainAttribute(nn.Module):
    """Trusted capture-aware code (its eager path syncs: planned on a rehearsal) that writes a
    tensor kept as a plain attribute (no buffer) on both paths."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = torch.zeros(())

    def forward(self, x):
        self.seen.add_(1)
        if not torch.cuda.is_current_stream_capturing() and bool((x > -1e9).all()):
            return self.lin(x) + self.seen
        return self.lin(x) + self.seen


def test_a_rehearsal_leaves_a_plain_tensor_attribute_as_the_real_call_left_it(faithful):
    # The rehearsal's write to the attribute was not undone (only parameters and buffers
    # were): it counted 5 after 4 calls, and every output after the first was off by one.
    model = _CountsInAPlainAttribute()
    ref = copy.deepcopy(model)
    g = cg.graphify(model, op_policy=_trusting(__name__))
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 4)
            assert torch.equal(g(x), ref(x))
    assert model.seen.item() == ref.seen.item() == 4
    assert cg.stats(g).replays >= 1


_SHIFT = {"t": torch.ones(4)}  # a tensor that is no argument, parameter or buffer


class _ReadsAGlobalOnItsCapturedPath(nn.Module):
    """Capture-aware code whose path while captured reads a global tensor: ``"sync"``, the
    eager path syncs (found by the warm-up: planned on a rehearsal); ``"skip"``, it returns
    early without the global (the capture's ops differ: compared with a rehearsal)."""

    def __init__(self, shortcut: str):
        super().__init__()
        self.shortcut = shortcut
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if not torch.cuda.is_current_stream_capturing():
            if self.shortcut == "sync" and bool((y > -1e9).all()):
                return y + _SHIFT["t"]
            if self.shortcut == "skip":
                return y + 1
        return y + _SHIFT["t"] if self.shortcut == "sync" else y + _SHIFT["t"].sign()


@pytest.mark.parametrize("shortcut", ["sync", "skip"])
def test_a_rehearsed_path_that_reads_a_global_tensor_is_not_graphed_whole(faithful, shortcut,
                                                                          monkeypatch):
    # Replacing the global must be seen: the rehearsal's reads from outside count as the
    # warm-up's do (a graph would keep reading the tensor it captured; "sync" then gave stale
    # results). Such a forward runs piecewise, its eager path with it.
    monkeypatch.setitem(_SHIFT, "t", torch.ones(4))
    model = _ReadsAGlobalOnItsCapturedPath(shortcut)
    ref = copy.deepcopy(model)
    g = cg.graphify(model, op_policy=_trusting(__name__))
    with torch.no_grad():
        for k in range(4):
            if k == 2:
                _SHIFT["t"] = torch.full((4,), 5.0) if shortcut == "sync" else -torch.ones(4)
            x = torch.randn(2, 4)
            torch.testing.assert_close(g(x), ref(x), rtol=0, atol=0)
    s = cg.stats(g)
    assert s.eager == 4 and all("OUTSIDE_TENSOR" in r for r in s.eager_calls), s


# -- the per-call paths ----------------------------------------------------------------------

class _Sliced(nn.Module):
    """As HF models: a new ModuleList from ``self.layers[:n]`` on every forward."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for layer in self.layers[: len(self.layers)]:
            x = layer(x)
        return x


def test_modules_built_in_forward_do_not_make_every_call_recheck_the_statics(sim):
    from cudagraphify import _statics

    ref = _Sliced()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        g(torch.randn(2, 4))
        before = _statics.generation()
        for _ in range(3):
            x = torch.randn(2, 4)
            torch.testing.assert_close(g(x), ref(x), rtol=0, atol=0)
    # the ModuleLists built by slicing belong to no graph: the guards' generation stands
    assert _statics.generation() == before
    assert cg.stats(g).replays == 3 and g._cudagraphify_state._fast is not None


def test_the_fast_path_takes_keyword_tensors_in_the_same_order(sim):
    class KW(nn.Module):
        def forward(self, x, y):
            return x * 2 + y

    g = cg.graphify(KW())
    with torch.no_grad():
        for _ in range(3):
            x, y = torch.randn(3), torch.randn(3)
            torch.testing.assert_close(g(x, y=y), x * 2 + y, rtol=0, atol=0)
        assert g._cudagraphify_state._fast is not None
        x, y = torch.randn(3), torch.randn(3)
        torch.testing.assert_close(g(y=y, x=x), x * 2 + y, rtol=0, atol=0)  # another key
    assert cg.stats(g).captures == 2


def test_an_eager_decision_never_keeps_a_graphed_signature_from_its_graph(sim):
    # calls decided eager (meta tensors: no graph there) between calls of a graphed signature
    # with the same argument types: the graphed one still replays every time
    @cg.graphify
    def f(x):
        return x * 2 + 1

    with torch.no_grad():
        x = torch.randn(3)
        f(x)
        for _ in range(3):
            f(torch.randn(3, device="meta"))
            torch.testing.assert_close(f(x), x * 2 + 1, rtol=0, atol=0)
    s = cg.stats(f)
    assert s.replays == 3 and s.eager == 3, s


def test_a_remembered_eager_decision_is_checked_cheaply_and_counted(sim):
    class Opaque:
        pass

    class Takes(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, extra):
            return self.lin(x)

    g = cg.graphify(Takes())
    o = Opaque()
    with torch.no_grad():
        for _ in range(4):
            g(torch.randn(2, 4), o)
        state = g._cudagraphify_state
        assert type(state._fast).__name__ == "EagerFast"
        x = torch.randn(2, 4)
        out = g(x, 3)  # an immutable value instead: keyable, so graphed
        g(x, 3)
    s = g._cudagraphify_state.stats()  # (the root's own: cg.stats adds its pieces')
    (reason,) = [r for r in s.eager_calls if "Opaque" in r]
    assert s.eager_calls[reason] == 4 and s.captures == 1 and s.replays == 1
    # the first opaque call planned the Linear as a piece: graphed on its own calls
    lin = cg.stats(g.lin)
    # (calls 2-4: its first sight runs eagerly, then captured in the root's implicit region,
    # where the capture call replays too)
    assert (lin.seen_once, lin.captures, lin.replays) == (1, 1, 2), lin
    torch.testing.assert_close(out, g.lin(x), rtol=0, atol=0)


def test_a_graphed_function_holds_and_guards_its_closure_tensors(sim):
    w = torch.randn(4, 4)

    @cg.graphify
    def f(x):
        return x @ w

    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 4)
            torch.testing.assert_close(f(x), x @ w, rtol=0, atol=0)
        assert cg.stats(f).replays == 2
        w = torch.randn(4, 4)  # the closure variable now names another tensor
        for _ in range(2):
            x = torch.randn(2, 4)
            torch.testing.assert_close(f(x), x @ w, rtol=0, atol=0)
    assert cg.stats(f).captures == 2


_W = torch.randn(4, 4)


def _uses_global(x):
    return x @ _W


def test_a_graphed_function_holds_and_guards_the_global_tensors_it_names(sim):
    global _W
    f = cg.graphify(_uses_global)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 4)
            torch.testing.assert_close(f(x), x @ _W, rtol=0, atol=0)
        _W = torch.randn(4, 4)
        for _ in range(2):
            x = torch.randn(2, 4)
            torch.testing.assert_close(f(x), x @ _W, rtol=0, atol=0)
        _W.resize_(2, 2)  # the same tensor, another layout: eager raises, so must the call
        with pytest.raises(RuntimeError):
            f(torch.randn(2, 4))
    assert cg.stats(f).captures == 2


class _Pool:
    """A pool id the simulated backend hands out (``new_pool``): which captures share one."""


def _pools(sim, monkeypatch):
    made = []

    def new_pool(device):
        made.append(_Pool())
        return made[-1]

    monkeypatch.setattr(sim, "new_pool", new_pool)
    return made


def test_graphs_of_one_callable_share_one_pool_when_outputs_are_copied(sim, monkeypatch):
    made = _pools(sim, monkeypatch)
    m = cg.graphify(nn.Linear(8, 8))
    with torch.no_grad():
        for b in (4, 2, 1, 4):
            assert torch.equal(m(torch.ones(b, 8)), nn.Linear.forward(m, torch.ones(b, 8)))
    assert cg.stats(m).captures == 3
    assert len(made) == 1 and [g.pool for g in sim.graphs] == made * 3
    # an invalidation releases every graph of the callable: the pool goes with them
    m._cudagraphify_state.invalidate("test")
    assert m._cudagraphify_state._pools == {}
    with torch.no_grad():
        m(torch.ones(3, 8))
    assert len(made) == 2 and sim.graphs[-1].pool is made[1]


def test_zero_copy_graphs_get_pools_of_their_own(sim, monkeypatch):
    """copy_outputs=False: the caller holds a graph's outputs until that graph replays again;
    another signature's replay must not write them, so no memory is shared."""
    made = _pools(sim, monkeypatch)
    m = cg.graphify(nn.Linear(8, 8), copy_outputs=False)
    with torch.no_grad():
        a = m(torch.ones(4, 8))
        kept = a.clone()
        m(torch.full((2, 8), 3.0))
        m(torch.full((2, 8), 5.0))
        assert torch.equal(a, kept)
    assert made == [] and [g.pool for g in sim.graphs] == [None, None]


def test_region_graphs_use_the_regions_pool(sim, monkeypatch):
    made = _pools(sim, monkeypatch)
    m = cg.graphify(nn.Linear(8, 8))
    with torch.no_grad(), cg.graph_region():
        m(torch.ones(4, 8))
        m(torch.ones(2, 8))
    assert len(made) == 1 and m._cudagraphify_state._pools == {}
    assert [g.pool for g in sim.graphs] == made * 2


def test_an_eviction_starts_a_new_pool_and_a_failed_capture_drops_its_own(sim, monkeypatch):
    made = _pools(sim, monkeypatch)
    m = cg.graphify(nn.Linear(8, 8), max_graphs=2)
    with torch.no_grad():
        for b in (1, 2, 3, 4):
            m(torch.ones(b, 8))
    # 1 and 2 in the first pool; 3 too (its put evicts 1: the pool retires); 4 in a new one
    assert [g.pool for g in sim.graphs] == [made[0]] * 3 + [made[1]]
    assert cg.stats(m).evictions == 2

    def failing(fn, device, pool=None, keep_graph=False):
        raise cg._capture.CaptureFailed("boom", False)

    monkeypatch.setattr(sim, "capture", failing)
    f = cg.graphify(nn.Linear(8, 8))
    with torch.no_grad():
        f(torch.ones(2, 8))
    assert cg.stats(f).captures == 0 and f._cudagraphify_state._pools == {}


def test_grad_mode_calls_while_backwards_are_pending_get_a_second_graph_then_run_eagerly(sim):
    """A forward under grad mode whose output is kept and never backpropagated: the next call
    of that signature captures a second training graph (the first one's activations must not
    be overwritten), the one after replays it; while both wait for their backward, the calls
    run eagerly, decided by the fast path; once one backward ran, they replay again; a no_grad
    call of the same tensors is not kept eager by that decision."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m(x)  # warm-up + capture of the training graph
        kept = m(x)  # a replay: its backward is pending while ``kept`` lives
        state = m._cudagraphify_state
        slow = state.slow
        calls = []
        state.slow = lambda *a: calls.append(1) or slow(*a)
        try:
            outs = [m(x) for _ in range(5)]
        finally:
            del state.slow
    # (the first captures a second graph, the second replays it, the third decides that the
    # last three run eagerly; the last two take the fast path)
    assert len(calls) == 3, calls
    assert all(torch.equal(o, ref(x)) for o in outs)
    s = cg.stats(m)
    assert sum(n for r, n in s.eager_calls.items() if "has not run yet" in r) == 3, s
    assert s.captures == 2 and s.replays == 2, s
    kept.sum().backward()  # its backward runs: the first graph waits no more
    replays = s.replays
    y = m(x)
    assert torch.equal(y, ref(x)) and cg.stats(m).replays == replays + 1
    y.sum().backward()
    with torch.no_grad():  # (a pending backward of grad mode keeps nothing of no_grad eager)
        keep = m(x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m(x), m(x)
        assert torch.equal(m(x), ref(x))
    assert cg.stats(m).captures == 3 and keep is not None  # (the inference graph's)
    with torch.enable_grad():
        held = m(x)
        before = cg.stats(m).eager_calls.copy()
        with torch.no_grad():
            r = cg.stats(m).replays
            assert torch.equal(m(x), ref(x))
            assert cg.stats(m).replays == r + 1  # no_grad: its graph, not the pending eager path
        assert cg.stats(m).eager_calls == before and held is not None


def test_zero_copy_outputs_resized_by_the_caller_run_eagerly_each_one_checked(sim, quiet):
    # (every static output handed out without a copy is checked, on the fast path too: here
    # the second of two)
    def fe(x):
        return x * 2, x + 1

    f = cg.graphify(fe, copy_outputs=False)
    with torch.no_grad():
        for _ in range(3):
            f(torch.randn(2, 3))
        _, b = f(torch.randn(2, 3))
        assert cg.stats(f).replays == 3
        torch.add(torch.ones(40), 1, out=b)  # an out= of another size: b's memory moves
        x = torch.randn(2, 3)
        out = f(x)
        assert all(torch.equal(o, w) for o, w in zip(out, fe(x)))
        assert b.shape == (40,) and torch.equal(b, torch.full((40,), 2.0))
    assert any("resized in place" in r for r in cg.stats(f).eager_calls)


def test_an_alias_of_an_argument_with_another_layout_and_no_view_runs_eagerly(sim, quiet):
    # (x.detach().t() is a view of the detached alias and replays; an alias made with set_ on
    # the argument's storage, in another layout, is no view: no replay can make it)
    def fe(x):
        # (set_ from a view: the view's memory and layout, no view itself; a read of
        # x.untyped_storage() is refused on its own, PYTHON_STATE)
        alias = torch.empty(0).set_(x.detach().view(-1)[:2])
        return alias, x.detach().t(), x * 2

    f = cg.graphify(fe)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 4)
            out, want = f(x), fe(x)
            assert all(torch.equal(o, w) for o, w in zip(out, want))
            assert out[0].data_ptr() == want[0].data_ptr()
    assert counts(f)[1] == 0
    assert any("no view of it" in r for r in cg.stats(f).eager_calls), cg.stats(f).eager_calls


def test_a_lazy_module_runs_its_first_call_eagerly_then_is_graphed(sim):
    # (helper-47: graphify raised ValueError on the uninitialized parameters of a LazyLinear,
    # in the scan of the statics) its first forward makes them, in place (no registry write)
    torch.manual_seed(0)
    m = nn.Sequential(nn.LazyLinear(8), nn.ReLU())
    g = cg.graphify(m)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(4):
            x = torch.randn(2, 4)
            assert torch.equal(g(x), torch.relu(x @ m[0].weight.T + m[0].bias))
    s = cg.stats(g)
    (reason,) = s.eager_calls
    assert reason.startswith("uninitialized parameters (a LazyModule)") and s.eager == 1, s
    assert (s.captures, s.replays) == (1, 2), s
    assert any(t is m[0].weight for t in g._cudagraphify_state.statics.tensors)
