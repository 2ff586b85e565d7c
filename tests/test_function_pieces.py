"""Function pieces (cudagraphify/_funcpieces.py): a plain function of a model library's modeling
module (HF's ``apply_rotary_pos_emb``) is graphed as a piece of the roots whose piecewise run
calls it, only inside such a root's implicit region; anywhere else it runs as itself.

CPU, simulated backend (``sim``). The modeling module is made here under a name that
``FUNCTIONS`` matches (``transformers.models.``), so these tests need no transformers: a model
whose forward takes an object no signature holds (as an HF ``DynamicCache``) runs eagerly with
its submodules graphed as pieces around it, and calls the module's function. Every output is
compared with an eager twin bitwise, and the function's counters prove which path ran."""

from __future__ import annotations

import copy
import sys
import types
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _funcpieces

NAME = "transformers.models.cg_fake.modeling_cg_fake"


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class Cache:
    """An object no signature holds (as an HF DynamicCache): the module it is passed to runs
    eagerly, its other submodules are pieces."""

    def __init__(self):
        self.seen = 0


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotary(q, k, cos, sin):
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _unsafe(q, k, cos, sin):
    scale = 2.0 if q.sum().item() > 1e9 else 1.0  # (a host sync: its graph is refused)
    return q * cos * scale, k * sin


def _modeling(fn=_rotary, name=NAME):
    """A fresh modeling module ``name`` holding ``apply_rotary_pos_emb`` (``fn``) and a model
    class whose attention calls it through the module's globals."""
    mod = types.ModuleType(name)
    mod.torch, mod.nn = torch, nn
    mod.apply_rotary_pos_emb = fn
    src = '''
class Attn(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x, cos, sin, cache):
        q, k = apply_rotary_pos_emb(self.q(x), self.k(x), cos, sin)
        cache.seen += 1
        return self.o(q + k)


class Model(nn.Module):
    def __init__(self, n=2, d=8):
        super().__init__()
        self.layers = nn.ModuleList(Attn(d) for _ in range(n))
        self.norm = nn.LayerNorm(d)

    def forward(self, x, cos, sin, cache):
        for layer in self.layers:
            x = x + layer(self.norm(x), cos, sin, cache)
        return x
'''
    exec(compile(src, f"<{name}>", "exec"), mod.__dict__)
    mod.Attn.__module__ = mod.Model.__module__ = name
    sys.modules[name] = mod
    return mod


@pytest.fixture
def modeling():
    mod = _modeling()
    yield mod
    sys.modules.pop(NAME, None)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g), \
        torch.randn(3, 8, generator=g)


def _twins(mod):
    torch.manual_seed(0)
    ref = mod.Model().eval()
    return ref, cg.graphify(copy.deepcopy(ref))


def _run(model, n, ctx=torch.no_grad, seed=0):
    outs = []
    with ctx():
        for i in range(n):
            x, cos, sin = _inputs(seed + i)
            outs.append(model(x, cos, sin, Cache()))
    return outs


def _same(a, b):
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_function_is_graphed_in_the_roots_piecewise_run(sim, modeling):
    original = modeling.apply_rotary_pos_emb
    ref, g = _twins(modeling)
    _same(_run(g, 8), _run(ref, 8))
    piece = modeling.apply_rotary_pos_emb
    # (one state for each of its calls in a run: the two layers')
    assert piece is not original and len(_region_states(g)) == 2
    assert piece.__wrapped__ is original  # (functools.wraps: the function it stands for)
    for s in [st.stats() for st in _region_states(g)]:
        assert s.captures == 1 and s.replays >= 5, s  # (one a call, after its capture)
    # the eager twin's calls of the same function (through the wrapper) are its own
    before = cg.stats(piece).replays
    _same(_run(ref, 3, seed=20), _run(copy.deepcopy(ref), 3, seed=20))
    assert cg.stats(piece).replays == before


def test_the_function_runs_as_itself_in_grad_mode_and_in_a_users_region(sim, modeling):
    ref, g = _twins(modeling)
    _same(_run(g, 6), _run(ref, 6))
    piece = modeling.apply_rotary_pos_emb
    before = cg.stats(piece)
    _same(_run(g, 3, ctx=torch.enable_grad, seed=10), _run(ref, 3, ctx=torch.enable_grad, seed=10))
    with torch.no_grad(), cg.graph_region():
        x, cos, sin = _inputs(30)
        got = g(x, cos, sin, Cache()).clone()
    with torch.no_grad():
        assert torch.equal(got, ref(x, cos, sin, Cache()))
    after = cg.stats(piece)
    assert (after.captures, after.replays) == (before.captures, before.replays)
    assert sum(after.eager_calls.values()) == sum(before.eager_calls.values())


def test_an_unsafe_function_runs_eagerly_with_its_reason(sim):
    mod = _modeling(_unsafe)
    try:
        ref, g = _twins(mod)
        _same(_run(g, 6), _run(ref, 6))
        s = cg.stats(mod.apply_rotary_pos_emb)
        assert s.captures == 0 and s.replays == 0, s
        assert any("item" in reason for reason in s.eager_calls), s
    finally:
        sys.modules.pop(NAME, None)


def test_installed_once_shared_by_models_and_left_in_place_by_ungraphify(sim, modeling):
    original = modeling.apply_rotary_pos_emb
    ref, g = _twins(modeling)
    g2 = cg.graphify(copy.deepcopy(ref))
    _run(g, 3), _run(g2, 3)
    piece = modeling.apply_rotary_pos_emb
    assert _funcpieces.install_for(g) == [] and _funcpieces.install_for(g2) == []
    assert modeling.apply_rotary_pos_emb is piece
    cg.ungraphify(g)
    cg.ungraphify(g2)
    before = cg.stats(piece)
    _same(_run(g, 3, seed=40), _run(ref, 3, seed=40))
    assert cg.stats(piece).replays == before.replays and piece.__wrapped__ is original
    # (another module binding the same function object gets the same wrapper)
    other = _modeling(original, NAME + "_other")
    try:
        _funcpieces.install_for(cg.graphify(other.Model()))
        assert other.apply_rotary_pos_emb is piece
    finally:
        sys.modules.pop(NAME + "_other", None)


def test_only_modules_of_the_named_libraries_are_touched(sim):
    name = "mylib.modeling"
    mod = _modeling(_rotary, name)
    try:
        ref, g = _twins(mod)
        _same(_run(g, 6), _run(ref, 6))
        assert mod.apply_rotary_pos_emb is _rotary
        assert _funcpieces.states_of(_rotary) is None
        with pytest.raises(cg.CudagraphifyUsageError):
            cg.stats(_rotary)
    finally:
        sys.modules.pop(name, None)


def test_a_whole_graph_root_installs_nothing(sim, modeling):
    """A root that is one graph (no pieces) makes no region of pieces: nothing is replaced."""
    class Whole(modeling.Model):
        def forward(self, x, cos, sin):
            return super().forward(x, cos, sin, Cache())
    Whole.__module__ = NAME
    original = modeling.apply_rotary_pos_emb
    torch.manual_seed(0)
    ref = Whole().eval()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(4):
            x, cos, sin = _inputs(i)
            assert torch.equal(g(x, cos, sin), ref(x, cos, sin))
    assert cg.stats(g).replays >= 2 and modeling.apply_rotary_pos_emb is original


def test_each_roots_region_has_its_own_graphed_function(sim, modeling):
    """Two graphified models: the function has a state in each one's region, counted apart; one
    given back (as its trial would, timed in that root's run) leaves the other's graphed."""
    ref, g = _twins(modeling)
    g2 = cg.graphify(copy.deepcopy(ref))
    _same(_run(g, 6), _run(ref, 6))
    _same(_run(g2, 6), _run(ref, 6))
    piece = modeling.apply_rotary_pos_emb
    (mine, mine2), (theirs, theirs2) = _region_states(g), _region_states(g2)
    assert not {mine, mine2} & {theirs, theirs2}
    assert all(s.replays >= 2 for s in (mine, mine2, theirs, theirs2))
    states = _funcpieces.states_of(piece)  # (and those of regions of earlier tests still alive)
    assert {mine, mine2, theirs, theirs2} <= set(states)
    assert cg.stats(piece).replays == sum(s.replays for s in states)
    mine.give_back("given back here")  # (the first layer's call in g's runs)
    before = (mine.replays, mine2.replays, theirs.replays)
    _same(_run(g, 3, seed=50), _run(ref, 3, seed=50))
    _same(_run(g2, 3, seed=50), _run(ref, 3, seed=50))
    assert mine.replays == before[0] and mine2.replays >= before[1] + 3
    assert theirs.replays >= before[2] + 3


def _region_states(model):
    """The function states whose graphs sit in ``model``'s implicit region."""
    chain = model._cudagraphify_state._chain
    per_region = getattr(sys.modules[NAME].apply_rotary_pos_emb, _funcpieces._ATTR)
    calls = per_region.get(chain)
    return [g._self_dispatch.state for g in calls.graphed] if calls is not None else []


def test_each_call_in_a_run_is_captured_in_the_order_of_the_run(sim, modeling):
    """Each layer's call of the function has its own state, captured in the run that captures
    the layer's pieces, after the pieces that make its arguments and before the one that reads
    its outputs: no replay is blocked by a held output, nothing is moved to a copy, nothing is
    captured again. (One state for both layers captured at the second layer's call, in the run
    before the pieces captured: blocked in the next runs, captured again, then every layer's
    outputs of it moved to copies before the o projection's replay.)"""
    ref, g = _twins(modeling)
    _same(_run(g, 12), _run(ref, 12))
    states = _region_states(g)
    assert len(states) == 2
    for st in states:
        s = st.stats()
        assert s.captures == 1 and not s.eager_calls.get(_VIEW), s
        assert st._recaptures == 0
    chain = g._cudagraphify_state._chain
    assert chain.moved_outputs == 0
    seqs = [e.seq for st in states for e in chain.cache_for(st).graphs()]
    q_seqs = [e.seq for layer in g.layers for e in chain.cache_for(
        layer.q._cudagraphify_state).graphs()]
    o_seqs = [e.seq for layer in g.layers for e in chain.cache_for(
        layer.o._cudagraphify_state).graphs()]
    assert all(q < f < o for q, f, o in zip(q_seqs, seqs, o_seqs)), (q_seqs, seqs, o_seqs)


_VIEW = ("an output of an earlier call in this graph_region is still referenced through a view; "
         "running eagerly so it is not overwritten (clone outputs you keep)")


def test_torch_compile_traces_the_function_itself_with_no_graph_break(modeling):
    """A compiled model of the library in the same process (not graphified) meets the wrapper:
    its trace folds ``is_compiling()`` and traces the function, with no break."""
    torch._dynamo.reset()
    piece = _funcpieces._piece_of(_rotary)

    def f(q, k, cos, sin):
        a, b = piece(q, k, cos, sin)
        return a + b

    args = [torch.randn(3, 8) for _ in range(4)]
    explained = torch._dynamo.explain(f)(*args)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    a, b = _rotary(*args)
    assert torch.equal(torch.compile(f, backend="eager")(*args), a + b)


def _chained_graphs(model):
    chain = model._cudagraphify_state._chain
    return [e for _, cache in list(chain._caches.values()) for e in cache.graphs()]


@pytest.mark.parametrize("other_thread", [False, True], ids=["alone", "another_thread"])
def test_a_capture_while_another_thread_runs_the_root_copies_its_inputs(
        sim, modeling, other_thread, monkeypatch):
    """A graph captured in a root's region reads an earlier piece's output in place (the
    function piece reads the projections'), unless another thread runs the root meanwhile: its
    code may make views of that memory during the capture, which the use counts taken around
    the capture would count as the graph's own (review finding FP-1): it copies them in."""
    from cudagraphify import _region

    if other_thread:  # (each run finds a thread in the middle of a run of the root)
        enter = _region.GraphRegion.enter_run

        def entered(self, token):
            enter(self, token)
            self.streams[-1] = token
        monkeypatch.setattr(_region.GraphRegion, "enter_run", entered)
    ref, g = _twins(modeling)
    _same(_run(g, 5), _run(ref, 5))
    graphs = _chained_graphs(g)
    assert graphs and cg.stats(g).replays >= 4
    borrowing = [e for e in graphs if getattr(e, "borrowed", None)]
    assert (not borrowing) if other_thread else borrowing


@pytest.mark.parametrize("began", [False, True], ids=["quiet", "a_run_began"])
def test_a_run_begun_during_a_capture_leaves_the_borrowed_slot_protected(sim, modeling, began,
                                                                         monkeypatch):
    """A run of the root that begins on another thread while a graph that reads a slot in place
    is captured may make views of that slot meanwhile (review finding FP-1): none of the use
    counts taken around the capture is then counted as the graph's own, so the slot stays
    protected (extra users) even with no alias held; a quiet capture counts them (none left)."""
    from cudagraphify import _region

    capture = sim.capture

    def capturing(*a, **k):
        stack = _region.stack_var().get()
        if began and stack and stack[-1].implicit:
            stack[-1].entered += 1  # (as another thread's enter_run would)
        return capture(*a, **k)
    monkeypatch.setattr(sim, "capture", capturing)
    ref, g = _twins(modeling)
    _same(_run(g, 5), _run(ref, 5))
    borrowed = [slot for e in _chained_graphs(g) for _, slot in getattr(e, "borrowed", ())]
    assert borrowed and cg.stats(g).replays >= 4
    extra = [slot.users() - slot.baseline for slot in borrowed if slot.baseline is not None]
    assert extra and (all(n > 0 for n in extra) if began else all(n == 0 for n in extra)), extra
