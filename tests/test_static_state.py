"""Static state passed as an argument (an HF StaticCache), with no option (CPU, simulated backend).

A cache whose layers are all static is recognised (``is_static_state``), read and written in
place, and keyed by what it holds (``state_key``: its tensors' addresses and layouts, its other
values), never held by a graph. Its first update allocates its tensors (inside forward): that
call runs eagerly, the next one captures. The stand-in classes below follow transformers 5's
``Cache``/``StaticLayer`` (a list of layers, tensors allocated on the first update, then written
in place); the GPU tests run the real ones (tests/test_gpu_hf.py).
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify._state import StateUnkeyable, is_static_state, state_key


# (features of 16: a CPU tensor of up to 64 elements in a cache is keyed by value, as host-side
# state; the simulated graphs run on the CPU, where the caches' tensors are the device's)


class Cache:
    """Stands in for ``transformers.cache_utils.Cache``: what ``is_static_state`` looks for is
    a class of that name in that module among the object's classes."""

    def __init__(self, layers):
        self.layers = layers

    @property
    def is_compileable(self) -> bool:
        return all(layer.is_compileable for layer in self.layers)


Cache.__module__ = "transformers.cache_utils"


class StaticLayer:
    is_compileable = True

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.keys = None
        self.is_initialized = False

    def update(self, k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if not self.is_initialized:  # as transformers 5: allocated on the first update
            self.keys = torch.zeros(k.shape[0], self.max_len, k.shape[-1], dtype=k.dtype)
            self.is_initialized = True
        self.keys.index_copy_(1, pos, k)
        return self.keys

    def reset(self) -> None:
        if self.is_initialized:
            self.keys.zero_()


class DynamicLayer(StaticLayer):
    is_compileable = False


class StaticCache(Cache):
    def __init__(self, n: int = 2, max_len: int = 6):
        super().__init__([StaticLayer(max_len) for _ in range(n)])

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()


class Net(nn.Module):
    def __init__(self, n: int = 2):
        super().__init__()
        self.projs = nn.ModuleList([nn.Linear(16, 16) for _ in range(n)])

    def forward(self, x, cache, pos):
        for i, proj in enumerate(self.projs):
            keys = cache.layers[i].update(proj(x), pos)
            x = x + keys.mean(1, keepdim=True)
        return x


class Counting(Net):
    """Changes the cache's Python state on every call (a step count)."""

    def forward(self, x, cache, pos):
        cache.steps = getattr(cache, "steps", 0) + 1
        return super().forward(x, cache, pos)


def _pair(seed=0):
    torch.manual_seed(seed)
    ref = Net()
    return ref, cg.graphify(copy.deepcopy(ref))


@torch.no_grad()
def _decode(ref, g, ref_cache, cache, steps, start=0):
    for t in range(start, start + steps):
        x, pos = torch.randn(1, 1, 16), torch.tensor([t])
        want = ref(x, ref_cache, pos)
        got = g(x, cache, pos)
        assert torch.equal(got, want), t
        for a, b in zip(ref_cache.layers, cache.layers):
            assert torch.equal(a.keys, b.keys), t


def test_a_static_cache_is_recognised_and_a_dynamic_one_is_not():
    assert is_static_state(StaticCache())
    assert not is_static_state(Cache([DynamicLayer(4)]))
    assert not is_static_state(object()) and not is_static_state([torch.zeros(1)])


def test_the_key_follows_addresses_layouts_and_values_not_identity():
    a, b = StaticCache(), StaticCache()
    assert state_key(a) == state_key(b)  # nothing allocated yet: the same state
    for c in (a, b):
        c.layers[0].update(torch.ones(1, 1, 16), torch.tensor([0]))
    assert state_key(a) != state_key(b)  # tensors at other addresses
    k = state_key(a)
    a.layers[0].keys.add_(1)  # values written in place: the same key
    assert state_key(a) == k
    a.layers[0].keys.resize_(1, 3, 16)
    assert state_key(a) != k
    a.layers[1].max_len = 99
    assert state_key(a) != k
    with pytest.raises(StateUnkeyable, match="module"):
        state_key(Cache([nn.Linear(1, 1)]))


def test_decode_with_a_static_cache_is_graphed_with_no_option(sim):
    ref, g = _pair()
    ref_cache, cache = StaticCache(), StaticCache()
    _decode(ref, g, ref_cache, cache, 5)
    s = cg.stats(g)
    # the first call allocates the cache (eager), the second captures, the others replay
    assert (s.captures, s.replays) == (1, 3)
    (reason,) = s.eager_calls
    assert "sets up argument 1" in reason


def test_a_reset_in_place_keeps_the_graph(sim):
    ref, g = _pair()
    ref_cache, cache = StaticCache(), StaticCache()
    _decode(ref, g, ref_cache, cache, 3)
    ref_cache.reset()
    cache.reset()
    _decode(ref, g, ref_cache, cache, 4)
    assert (cg.stats(g).captures, cg.stats(g).replays) == (1, 5)


def test_a_new_cache_gets_its_own_graph_and_the_dead_ones_graph_is_released(sim):
    ref, g = _pair()
    ref_cache, cache = StaticCache(), StaticCache()
    _decode(ref, g, ref_cache, cache, 3)
    gone = weakref.ref(cache)
    ref_cache, cache = StaticCache(), StaticCache()  # the first one is dropped
    gc.collect()
    assert gone() is None  # no graph kept it alive
    _decode(ref, g, ref_cache, cache, 3)
    s = cg.stats(g)
    assert s.captures == 2 and s.graphs == 1 and s.evictions == 0


def test_two_caches_in_turn_each_replay_their_own_graph(sim):
    ref, g = _pair()
    caches = [(StaticCache(), StaticCache()) for _ in range(2)]
    for t in range(4):
        for ref_cache, cache in caches:
            _decode(ref, g, ref_cache, cache, 1, start=t)
    s = cg.stats(g)
    assert (s.captures, s.graphs) == (2, 2) and s.replays == 4


def test_a_replaced_cache_tensor_is_seen(sim):
    ref, g = _pair()
    ref_cache, cache = StaticCache(), StaticCache()
    _decode(ref, g, ref_cache, cache, 3)
    for c in (ref_cache, cache):
        c.layers[1].keys = c.layers[1].keys.clone()  # new memory, same values
    _decode(ref, g, ref_cache, cache, 2, start=3)
    assert cg.stats(g).captures == 2


def test_a_forward_that_changes_the_caches_python_state_is_refused_and_put_back(sim):
    """A forward that changes a cache's Python state (a step count): the calls that show it
    run eagerly (their probed runs put back); once two did, the cache is no static state but
    an opaque object (``_state.demote``): no call probes it again (each would be a new key),
    the root runs eagerly around it and its pieces are graphed, as with a DynamicCache."""
    torch.manual_seed(0)
    ref = Counting()
    g = cg.graphify(copy.deepcopy(ref))
    ref_cache, cache = StaticCache(), StaticCache()
    with torch.no_grad():
        for t in range(6):
            x, pos = torch.randn(1, 1, 16), torch.tensor([t])
            assert torch.equal(g(x, cache, pos), ref(x, ref_cache, pos)), t
            for a, b in zip(ref_cache.layers, cache.layers):
                assert torch.equal(a.keys, b.keys), t
    assert cache.steps == 6  # the real calls only
    s = cg.stats(g)
    assert sum(s.eager_calls.values()) == 6  # the root: never one graph
    changes = [n for r, n in s.eager_calls.items()
               if "forward changes argument 1" in r and "side effect" in r]
    assert changes == [2], s.eager_calls  # learnt on two calls, not on every call
    assert any("has Python state that the forward changes on every call" in r
               for r in s.eager_calls), s.eager_calls
    assert not is_static_state(cache) and is_static_state(StaticCache())
    assert s.captures >= 1 and s.replays >= 2, s  # the projections, around the cache


def test_a_dynamic_cache_runs_eagerly_with_the_reason(sim):
    torch.manual_seed(0)
    g = cg.graphify(Net(1))
    cache = Cache([DynamicLayer(6)])
    with torch.no_grad():
        for t in range(3):
            g(torch.randn(1, 1, 16), cache, torch.tensor([t]))
    (reason,) = cg.stats(g).eager_calls
    assert "argument 1 of type Cache is not a tensor" in reason


def test_a_cache_holding_what_cannot_be_keyed_runs_eagerly_around_it(sim):
    # (no graph of the call as a whole: the cache is passed as an opaque object, see
    # test_a_static_cache_that_cannot_be_keyed_is_passed_as_an_opaque_object)
    ref, g = _pair()
    ref_cache, cache = StaticCache(), StaticCache()
    cache.helper = nn.Linear(1, 1)
    _decode(ref, g, ref_cache, cache, 3)
    s = cg.stats(g)
    assert sum(s.eager_calls.values()) == 3
    assert all("holds a module" in r for r in s.eager_calls), s.eager_calls


class _Generating(nn.Module):
    """A model with an HF-style ``generation_config``."""

    class Config:
        disable_compile = None

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.generation_config = self.Config()

    def forward(self, x):
        return self.lin(x)


def test_graphify_turns_generates_compile_off_and_ungraphify_back():
    m = _Generating()
    cg.graphify(m)
    assert m.generation_config.disable_compile is True
    cg.ungraphify(m)
    assert m.generation_config.disable_compile is None
    m.generation_config.disable_compile = True  # the user's own choice stays
    cg.graphify(m)
    cg.ungraphify(m)
    assert m.generation_config.disable_compile is True


# -- the per-call fast path, for keyword calls with flags, None and a cache ---------------------

class KwNet(Net):
    """An HF-style call: keywords, a flag, None, a float and a cache."""

    def forward(self, x, cache=None, pos=None, use_cache=True, extra=None, scale=1.0):
        y = super().forward(x, cache, pos)
        return y * scale if use_cache else -y


def _fast_of(module):
    from cudagraphify._wrap import STATE
    return module.__dict__[STATE]._fast


@torch.no_grad()
def test_keyword_calls_with_values_and_a_cache_take_the_fast_path(sim):
    torch.manual_seed(0)
    ref = KwNet()
    g = cg.graphify(copy.deepcopy(ref))
    ref_cache, cache = StaticCache(), StaticCache()

    def call(m, c, t, **kw):
        return m(torch.full((1, 1, 16), float(t)), cache=c, pos=torch.tensor([t % 6]), **kw)

    for t in range(4):
        assert torch.equal(call(g, cache, t), call(ref, ref_cache, t))
    assert _fast_of(g) is not None and _fast_of(g).mixed is not None
    before = cg.stats(g).replays
    assert torch.equal(call(g, cache, 4), call(ref, ref_cache, 4))
    assert cg.stats(g).replays == before + 1
    # another value of a flag, a float with other bits, another cache: not the same graph
    for kw in ({"use_cache": False}, {"scale": -0.0}, {"scale": 0.0}, {"extra": 1}):
        assert torch.equal(call(g, cache, 5, **kw), call(ref, ref_cache, 5, **kw)), kw
    other, other_ref = StaticCache(), StaticCache()
    for t in range(3):
        assert torch.equal(call(g, other, t), call(ref, other_ref, t))
        assert torch.equal(call(g, cache, t), call(ref, ref_cache, t))
    s = cg.stats(g)
    assert s.captures >= 2 and not any("side effect" in r for r in s.eager_calls)


@torch.no_grad()
def test_the_fast_path_sees_a_cache_tensor_replaced_in_place(sim):
    torch.manual_seed(0)
    ref = KwNet()
    g = cg.graphify(copy.deepcopy(ref))
    ref_cache, cache = StaticCache(), StaticCache()
    for t in range(3):
        x = torch.randn(1, 1, 16)
        assert torch.equal(g(x, cache=cache, pos=torch.tensor([t])),
                           ref(x, cache=ref_cache, pos=torch.tensor([t])))
    assert _fast_of(g) is not None
    for c in (cache, ref_cache):
        c.layers[0].keys.set_(c.layers[0].keys.clone())  # new memory behind the same tensor
    x = torch.randn(1, 1, 16)
    assert torch.equal(g(x, cache=cache, pos=torch.tensor([3])),
                       ref(x, cache=ref_cache, pos=torch.tensor([3])))
    assert torch.equal(cache.layers[0].keys, ref_cache.layers[0].keys)


@pytest.mark.parametrize("layers", [40, 80])
def test_the_cache_of_a_deep_model_is_keyable(layers):
    """HF's own StaticCache of a 40- and 80-layer model, allocated: within what ``state_key``
    walks (it refused beyond 32 layers: such a model's every call ran eagerly), and its key
    still follows a tensor moved in one layer."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100,
                                   max_position_embeddings=64)
    cache = transformers.StaticCache(config=cfg, max_cache_len=32)
    cache.early_initialization(1, 2, 16, torch.float32, torch.device("cpu"))
    key = state_key(cache)
    assert state_key(cache) == key  # (the memo's answer)
    cache.layers[-1].keys = cache.layers[-1].keys.clone()
    assert state_key(cache) != key


def test_a_demoted_cache_is_its_own_and_leaves_with_its_life(sim):
    """Demotion is of one object: another cache of the same class is still static state (its
    first calls probe it, and it is demoted once its own forward changes it), and a demoted
    cache that dies leaves no entry behind."""
    from cudagraphify import _state

    torch.manual_seed(0)
    ref = Counting()
    g = cg.graphify(copy.deepcopy(ref))
    gc.collect()  # (caches demoted by earlier tests, dead by now)
    before = len(_state._changing)
    for n in range(2):
        ref_cache, cache = StaticCache(), StaticCache()
        assert is_static_state(cache)
        with torch.no_grad():
            for t in range(4):
                x, pos = torch.randn(1, 1, 16), torch.tensor([t])
                assert torch.equal(g(x, cache, pos), ref(x, ref_cache, pos)), (n, t)
        assert not is_static_state(cache) and _state.demoted(cache)
        changes = sum(v for r, v in cg.stats(g).eager_calls.items() if "side effect" in r)
        assert changes == 2 * (n + 1), cg.stats(g).eager_calls  # on two calls per cache
        ref_cache = cache = None
        gc.collect()
        assert len(_state._changing) == before


class _Box:
    def __init__(self, inner):
        self.inner = inner


class DeepCache(Cache):
    """A static cache whose layers sit deeper than a key walks (as HF's EncoderDecoderCache
    holds two caches): unkeyable."""

    def __init__(self):
        super().__init__([StaticLayer(6) for _ in range(2)])
        self.boxed = _Box(_Box(_Box(self.layers)))

    @property
    def is_compileable(self) -> bool:
        return True


def test_a_static_cache_that_cannot_be_keyed_is_passed_as_an_opaque_object(sim):
    """state_key refuses it: the call was eager as a whole; now the cache is demoted (with the
    reason) and the pieces around it are graphed, as around a DynamicCache."""
    from cudagraphify import _state

    with pytest.raises(StateUnkeyable):
        state_key(DeepCache())
    ref, g = _pair()
    ref_cache, cache = DeepCache(), DeepCache()
    _decode(ref, g, ref_cache, cache, 6)
    s = cg.stats(g)
    assert _state.demoted(cache) and not is_static_state(cache) and is_static_state(DeepCache())
    assert all("cannot be keyed as static state" in r for r in s.eager_calls), s.eager_calls
    assert s.captures >= 1 and s.replays >= 3, s  # the projections, around the cache
