"""A new static cache set up before its first call, as an earlier cache's first update set it up
(``_state.SetUp``; CPU, simulated backend).

``generate(cache_implementation="static")`` makes a new HF ``StaticCache`` for every call; its
first update (the prefill) allocates its tensors inside forward, so that call runs eagerly. The
first such call is read back (HF's ``Cache.early_initialization`` arguments and the layout it
left); a later call passing a cache in the state the first one was in has it set up before the
call (kept only when the layout comes out exactly the same) and is graphed. The stand-ins follow
transformers 5's ``Cache``/``StaticLayer`` code (lazy_initialization, early_initialization);
the GPU tests run the real ones (tests/test_gpu_hf.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg
import test_static_state
from test_rebase import fam  # noqa: F401 (a fixture)
from test_share_engine import reading  # noqa: F401 (a fixture)
from cudagraphify._state import SetUp, state_key

H, D, MAX = 2, 8, 12  # heads, head size, cache length


class Cache(test_static_state.Cache):
    """transformers.cache_utils.Cache, as far as set-up goes."""

    def early_initialization(self, batch_size, num_heads, head_dim, dtype, device):
        for layer, h, d in zip(self.layers, num_heads, head_dim):
            if not layer.supports_early_init or layer.is_initialized:
                continue
            fake = torch.zeros((batch_size, h, 0, d), dtype=dtype, device=device)
            layer.lazy_initialization(fake, fake)


class StaticLayer:
    """transformers 5's StaticLayer: allocated on the first update, then written in place."""

    is_compileable = True
    supports_early_init = True

    def __init__(self, max_cache_len: int):
        self.max_cache_len = max_cache_len
        self.is_initialized = False

    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        shape = (self.batch_size, self.num_heads, self.max_cache_len)
        self.keys = torch.zeros(shape + (self.k_head_dim,), dtype=self.dtype, device=self.device)
        self.values = torch.zeros(shape + (self.v_head_dim,), dtype=self.dtype,
                                  device=self.device)
        self.is_initialized = True

    def update(self, key_states, value_states, pos):
        # (transformers 5 counts positions in a tensor of the cache's; here they are passed:
        # on the CPU, a small CPU tensor in the cache is host state, read by value)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys.index_copy_(2, pos, key_states)
        self.values.index_copy_(2, pos, value_states)
        return self.keys, self.values


class StaticCache(Cache):
    def __init__(self, n: int = 2, max_cache_len: int = MAX):
        super().__init__([StaticLayer(max_cache_len) for _ in range(n)])


class Attn(nn.Module):
    def __init__(self, n: int = 2):
        super().__init__()
        self.heads = H
        self.projs = nn.ModuleList([nn.Linear(H * D, H * D) for _ in range(n)])

    def forward(self, x, cache, pos):
        b, t, _ = x.shape
        for i, proj in enumerate(self.projs):
            k = proj(x).view(b, t, self.heads, -1).transpose(1, 2)
            keys, values = cache.layers[i].update(k, k * 2, pos)
            x = x + (keys.sum(2) + values.sum(2)).transpose(1, 2).reshape(b, 1, -1)
        return x


def _pair(seed=0, n=2):
    torch.manual_seed(seed)
    ref = Attn(n)
    return ref, cg.graphify(copy.deepcopy(ref))


@torch.no_grad()
def _generate(ref, g, batch=1, prompt=4, steps=3, make=StaticCache):
    """A prefill of ``prompt`` tokens then ``steps`` one-token steps, each on a new cache of
    its own for the model and its eager twin; outputs and caches compared bitwise."""
    ref_cache, cache = make(), make()
    x, pos = torch.randn(batch, prompt, H * D), torch.arange(prompt)
    for t in range(steps + 1):
        want, got = ref(x, ref_cache, pos), g(x, cache, pos)
        assert torch.equal(got, want), t
        for a, b in zip(ref_cache.layers, cache.layers):
            assert a.is_initialized == b.is_initialized, t
            if a.is_initialized:
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), t
        x, pos = torch.randn(batch, 1, H * D), torch.tensor([prompt + t])
    return cache


def _set_up_calls(g) -> int:
    return sum(n for r, n in cg.stats(g).eager_calls.items() if "sets up" in r)


def test_a_new_cache_is_set_up_as_the_first_was_and_its_prefill_graphed(sim):
    ref, g = _pair()
    _generate(ref, g)
    s = cg.stats(g)
    assert (_set_up_calls(g), s.set_ups, s.captures) == (1, 0, 1)  # prefill eager, step graphed
    for k in range(2):
        _generate(ref, g)
    s = cg.stats(g)
    # the first cache's prefill alone ran eagerly to set it up; each new cache was set up
    # before its prefill, which was then graphed (a capture per cache here: no rebasing in
    # this test's backend)
    assert (_set_up_calls(g), s.set_ups) == (1, 2)
    assert s.captures == 1 + 2 * 2


def test_the_set_up_is_read_back_from_what_the_call_allocated():
    cache = StaticCache(n=3)
    assert SetUp.read(cache) is None  # not set up
    for layer in cache.layers:
        layer.update(torch.zeros(2, H, 3, D, dtype=torch.float64),
                     torch.zeros(2, H, 3, D, dtype=torch.float64), torch.arange(3))
    set_up = SetUp.read(cache)
    assert set_up.kwargs == dict(batch_size=2, num_heads=[H] * 3, head_dim=[D] * 3,
                                 dtype=torch.float64, device=torch.device("cpu"))
    other = StaticCache(n=3)
    assert set_up.apply(other)
    assert all(x.keys.shape == (2, H, MAX, D) and x.keys.dtype == torch.float64
               for x in other.layers)
    odd = StaticCache(n=3)
    odd.layers[1].v_head_dim = D + 1  # keys and values of other sizes: no early_initialization
    for layer in odd.layers:
        layer.is_initialized = True
    assert SetUp.read(odd) is None


def test_a_set_up_that_comes_out_otherwise_is_undone_and_the_call_sets_up_itself(sim):
    ref, g = _pair()
    _generate(ref, g)

    class Sloppy(StaticCache):  # its early initialization allocates another dtype
        def early_initialization(self, batch_size, num_heads, head_dim, dtype, device):
            super().early_initialization(batch_size, num_heads, head_dim, torch.float64, device)

    before = Sloppy()
    cache = _generate(ref, g, make=Sloppy)  # the same key: Sloppy is keyed like StaticCache
    assert state_key(before) != state_key(StaticCache())  # (another class: another key)
    s = cg.stats(g)
    assert s.set_ups == 0 and _set_up_calls(g) == 2
    assert all(layer.keys.dtype == torch.float32 for layer in cache.layers)


def test_a_set_up_that_does_not_fit_is_put_back_as_it_was(sim):
    ref, g = _pair()
    _generate(ref, g)
    entry = next(e for _, e in g._cudagraphify_state.cache.items(g._cudagraphify_state)
                 if hasattr(e, "set_ups"))
    (i, set_up), = entry.set_ups
    cache = StaticCache()
    layers_before = [dict(layer.__dict__) for layer in cache.layers]
    wrong = SetUp(dict(set_up.kwargs, num_heads=[H + 1] * 2), set_up.layout)
    assert not wrong.apply(cache)
    assert [layer.__dict__ for layer in cache.layers] == layers_before
    assert not cache.layers[0].is_initialized


def test_another_batch_size_is_set_up_by_its_own_first_call(sim):
    ref, g = _pair()
    _generate(ref, g, batch=1)
    _generate(ref, g, batch=3)
    assert (_set_up_calls(g), cg.stats(g).set_ups) == (2, 0)
    _generate(ref, g, batch=3)
    _generate(ref, g, batch=1)
    assert (_set_up_calls(g), cg.stats(g).set_ups) == (2, 2)


def test_a_changed_attribute_forward_read_is_not_set_up_from_the_old_call(sim):
    ref, g = _pair()
    _generate(ref, g)
    for m in (ref, g):
        m.heads = 4  # another number of heads: the cache's layers would be set up otherwise
    _generate(ref, g)
    assert cg.stats(g).set_ups == 0 and _set_up_calls(g) == 2
    _generate(ref, g)
    assert cg.stats(g).set_ups == 1


@pytest.mark.parametrize("n", [1, 3])
def test_every_layer_of_a_cache_is_set_up(sim, n):
    ref, g = _pair(n=n)
    for _ in range(3):
        _generate(ref, g, make=lambda: StaticCache(n))
    assert cg.stats(g).set_ups == 2


def test_a_cache_with_a_layer_its_first_call_left_unallocated_is_not_set_up(sim):
    ref, g = _pair(n=1)
    for _ in range(3):
        _generate(ref, g, make=lambda: StaticCache(2))  # the model uses one of two layers
    assert cg.stats(g).set_ups == 0 and _set_up_calls(g) == 3


class _AsksIfCaptured(Attn):
    """HF's mask code, in small: eagerly it syncs on the cache's state (is it empty?); while
    captured it takes the path that does not ask (trusted to compute the same)."""

    def forward(self, x, cache, pos):
        if not torch.cuda.is_current_stream_capturing() and cache.layers[0].is_initialized:
            bool(cache.layers[0].keys.abs().sum() == 0)  # a host sync, on the eager path only
        return super().forward(x, cache, pos)


@pytest.fixture
def faithful(sim, monkeypatch):
    """The simulated capture answering torch.cuda.is_current_stream_capturing() "yes" while
    it captures, as a real one does."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: sim.capturing)
    return sim


@pytest.mark.parametrize("trusted", [True, False])
def test_a_call_with_a_cache_is_rehearsed_on_copies_of_the_cache(faithful, trusted):
    torch.manual_seed(0)
    ref = _AsksIfCaptured()
    policy = cg.OpPolicy()
    policy.TRUSTED_CAPTURED_PATHS = (__name__,) if trusted else ()
    g = cg.graphify(copy.deepcopy(ref), op_policy=policy)
    for _ in range(3):
        # (a rehearsal that wrote the real cache would shift every later position: the
        # comparison with the eager twin's cache, bitwise, after every call catches it)
        _generate(ref, g)
    s = cg.stats(g)
    if trusted:  # the prefill and the step are single graphs, planned on the captured path
        assert s.set_ups == 2 and not any(r.startswith("piecewise") for r in s.eager_calls), s
        assert s.captures == 1 + 2 * 2
    else:  # the eager path's sync stands: piecewise (its Linears graphed)
        assert any(r.startswith("piecewise") for r in s.eager_calls), s


def test_set_ups_stop_when_each_new_cache_captures_again(sim):
    # (this backend does not rebase a cache's graphs to another cache: each set-up prefill
    # captures; after the two a family needs, setting up only trades an eager call for a
    # capture)
    ref, g = _pair()
    for _ in range(6):
        _generate(ref, g)
    s = cg.stats(g)
    assert s.set_ups == 3 and _set_up_calls(g) == 3, (s.set_ups, s.eager_calls)


def test_set_up_prefills_are_rebased_to_each_new_cache(fam):
    # (the graph-reading double of tests/test_rebase.py: a rebased graph re-runs the
    # template's recorded ops on the new cache's tensors, found by their addresses)
    from test_share_engine import _tensors

    class Registering(StaticCache):  # the double finds a tensor by its address
        def early_initialization(self, *args, **kwargs):
            super().early_initialization(*args, **kwargs)
            for layer in self.layers:
                _tensors[layer.keys.data_ptr()] = layer.keys
                _tensors[layer.values.data_ptr()] = layer.values

    make = Registering
    ref, g = _pair()
    for _ in range(6):
        _generate(ref, g, make=make)
    s = cg.stats(g)
    assert s.set_ups == 5 and _set_up_calls(g) == 1, (s.set_ups, s.eager_calls, s.reasons)
    # prefill and step: a template and its diff each, then rebased for every later cache
    assert s.captures == 4 and s.retargets >= 2 * 3, (s.captures, s.retargets, s.reasons)


class _CountingLayer(StaticLayer):
    """transformers 5's StaticLayer with its own position count (a tensor of the cache's, as
    ``cumulative_length``; 65 elements so that, on the CPU, it is keyed as device memory and
    not by value): a second run of a call on the states that call left writes after what it
    wrote, past the end of a cache it filled more than half."""

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        self.count = torch.zeros(65, dtype=torch.long)

    def update(self, key_states, value_states, pos):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        pos = torch.arange(n) + self.count[:1]
        self.count.add_(n)
        return super().update(key_states, value_states, pos)


class _Recording(_AsksIfCaptured):
    """Records, for each run that is told it is captured (a rehearsal or a capture), whether
    the backend was capturing, the tokens passed and the position count the cache held."""

    sim = None  # the backend (set by the test)

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x, cache, pos):
        if torch.cuda.is_current_stream_capturing() and cache.layers[0].is_initialized:
            self.seen.append((_Recording.sim.capturing, x.shape[1],
                              cache.layers[0].count[:1].clone()))
        return super().forward(x, cache, pos)


def test_a_rehearsal_reruns_the_call_on_the_cache_as_the_call_found_it(faithful):
    # rehearsed on the cache the call left, a prefill of 4 would write positions 4 to 7: past
    # the end of a cache of 6 (on a GPU, a device-side assert that loses the CUDA context).
    # (This backend's capture runs forward on the cache the call left: a cache of 12 here.)
    torch.manual_seed(0)
    _Recording.sim = faithful
    ref = _Recording()
    policy = cg.OpPolicy()
    policy.TRUSTED_CAPTURED_PATHS = (__name__,)
    g = cg.graphify(copy.deepcopy(ref), op_policy=policy)
    for _ in range(3):
        _generate(ref, g, prompt=4, steps=2,
                  make=lambda: Cache([_CountingLayer(12) for _ in range(2)]))
    s = cg.stats(g)
    assert s.set_ups == 2 and not any(r.startswith("piecewise") for r in s.eager_calls), s
    rehearsals = [n.item() for capturing, t, n in g.seen if not capturing and t == 4]
    assert rehearsals and all(n == 0 for n in rehearsals), rehearsals


def test_a_new_cache_at_a_dead_caches_addresses_replays_that_caches_graph(fam):
    # generate() drops its cache; the allocator gives the next one the same memory (on the
    # H200, every set-up cache after the second): the template's graph applies to it as it
    # is, where a diff of two captures at the same addresses could prove nothing
    import gc

    from test_share_engine import _tensors

    ref, g = _pair()
    _generate(ref, g)  # sets its cache up (eager), graphs the steps
    x, pos = torch.randn(1, 4, H * D), torch.arange(4)
    kept = []

    def set_up(tensors=None):
        cache = StaticCache()
        cache.early_initialization(1, [H] * 2, [D] * 2, torch.float32, torch.device("cpu"))
        for j, layer in enumerate(cache.layers):
            if tensors is not None:  # the dead cache's memory
                layer.keys, layer.values = tensors[j]
                layer.keys.zero_()
                layer.values.zero_()
            _tensors[layer.keys.data_ptr()] = layer.keys
            _tensors[layer.values.data_ptr()] = layer.values
        return cache

    cache = set_up()
    assert torch.equal(g(x, cache, pos), ref(x, set_up(), pos))  # the prefill's template
    kept = [(layer.keys, layer.values) for layer in cache.layers]
    del cache
    gc.collect()
    before = cg.stats(g)
    for _ in range(2):
        ref_cache, cache = set_up(), set_up(kept)
        assert torch.equal(g(x, cache, pos), ref(x, ref_cache, pos))
        for a, b in zip(ref_cache.layers, cache.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        del cache
        gc.collect()
    s = cg.stats(g)
    # (the second call replays the first one's graph: the same addresses, the same graph)
    assert s.captures == before.captures and s.retargets - before.retargets >= 1, s.reasons
    assert s.replays - before.replays == 2 and not s.reasons


# -- a set-up's own memory pool (CUDA: ``SetUp._allocating``), emulated ------------------------

_in_pool = [False]  # (within SetUp._allocating's context, as patched by ``pooled_set_ups``)


class _Recycled(StaticLayer):
    """A StaticLayer whose tensors, when a set-up allocates them, come from a pool: the tensors
    a dead cache's set-up got are the next set-up's first, as a set-up's own CUDA memory pool
    gives the next cache the memory of the one dropped before it (what is allocated outside
    the set-up, copies of the cache included, is not the pool's)."""

    free: list
    given: dict

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        if _in_pool[0]:
            if len(self.free) >= 2:
                self.keys, self.values = self.free.pop(0).zero_(), self.free.pop(0).zero_()
            self.given[id(self.keys)], self.given[id(self.values)] = self.keys, self.values


def _recycling(free: list):
    given: dict = {}

    class Layer(_Recycled):
        pass
    Layer.free, Layer.given = free, given

    class Recycling(StaticCache):
        def __init__(self):
            Cache.__init__(self, [Layer(MAX) for _ in range(2)])

        def __del__(self):
            for layer in self.layers:  # (the pool's tensors back to the pool)
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                    if t is not None and given.pop(id(t), None) is t:
                        free.append(t)
    return Recycling


@pytest.fixture
def pooled_set_ups(monkeypatch):
    """``SetUp._allocating`` as on CUDA (a pool of its own), with no CUDA: the layers above
    allocate from their pool within it; the set-up's pool a placeholder."""
    import contextlib

    @contextlib.contextmanager
    def in_pool():
        _in_pool[0] = True
        try:
            yield
        finally:
            _in_pool[0] = False

    def allocating(self, marked=True):
        self.pool = "a pool"
        return in_pool(), marked
    monkeypatch.setattr(SetUp, "_allocating", allocating)
    return allocating


@torch.no_grad()
def _generate_on(ref, g, make_ref, make, prompt=4, steps=3):
    ref_cache, cache = make_ref(), make()
    x, pos = torch.randn(1, prompt, H * D), torch.arange(prompt)
    for t in range(steps + 1):
        assert torch.equal(g(x, cache, pos), ref(x, ref_cache, pos)), t
        x, pos = torch.randn(1, 1, H * D), torch.tensor([prompt + t])
    ptrs = [layer.keys.data_ptr() for layer in cache.layers]
    del cache, ref_cache
    return ptrs


def test_a_cache_set_up_in_the_pool_replays_the_graphs_of_the_dead_one_before_it(
        sim, pooled_set_ups):
    import gc
    ref, g = _pair()
    free_ref, free = [], []
    make_ref, make = _recycling(free_ref), _recycling(free)
    _generate_on(ref, g, make_ref, make)  # the first: set up by its own prefill, eagerly
    gc.collect()
    second = _generate_on(ref, g, make_ref, make)  # set up before its prefill: captured
    gc.collect()
    s = cg.stats(g)
    captures, graphs = s.captures, s.graphs
    third = _generate_on(ref, g, make_ref, make)  # given the second's memory
    gc.collect()
    assert third == second
    s = cg.stats(g)
    # its graphs were kept when the second cache died, and replay: no capture, no rebase
    assert (s.captures, s.retargets, s.set_ups) == (captures, 0, 2), s
    assert s.graphs == graphs and s.replays >= 2 * 4


def test_graphs_of_a_dead_cache_not_set_up_in_a_pool_are_released(sim, pooled_set_ups,
                                                                   monkeypatch):
    """The same memory handed on, but the set-up has no pool of its own (not CUDA): the dead
    cache's graphs were dropped, the next cache's are captured again."""
    import gc
    monkeypatch.setattr(SetUp, "_allocating", lambda self: pooled_set_ups(self, marked=False))
    ref, g = _pair()
    free_ref, free = [], []
    make_ref, make = _recycling(free_ref), _recycling(free)
    for _ in range(2):
        _generate_on(ref, g, make_ref, make)
        gc.collect()
    s = cg.stats(g)
    second = free[0].data_ptr()
    third = _generate_on(ref, g, make_ref, make)
    gc.collect()
    assert third[0] == second  # (the same memory)
    assert cg.stats(g).captures > s.captures  # (but its graphs were dropped)


class _SeenCountingLayer(StaticLayer):
    """A StaticLayer that also counts the tokens it has seen in a Python int, bumped by every
    update (as HF's sliding-window layers do): its cache changes its Python state on every
    call, and is demoted after two."""

    def update(self, key_states, value_states, pos):
        self.seen = getattr(self, "seen", 0) + key_states.shape[2]
        return super().update(key_states, value_states, pos)


class CountingCache(StaticCache):
    def __init__(self):
        Cache.__init__(self, [_SeenCountingLayer(MAX) for _ in range(2)])


def test_caches_of_a_set_up_whose_cache_was_demoted_are_passed_as_they_are_at_once(sim):
    """generate() makes such a cache per call: each would be probed on two calls before it is
    demoted. Once a cache the set-up set up was demoted, the next ones are demoted at once."""
    from cudagraphify._state import demoted
    ref, g = _pair()
    probed = []
    for _ in range(4):
        cache = _generate(ref, g, make=CountingCache)
        assert demoted(cache) is not None
        probed.append(sum(n for r, n in cg.stats(g).eager_calls.items()
                          if "forward changes argument" in r))
    # the first cache (set up by its own prefill) and the second (set up before it) are
    # probed until demoted; the third and fourth are demoted before their first call
    assert probed[2] == probed[3] == probed[1] > probed[0] > 0, probed
