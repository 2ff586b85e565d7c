"""Review of the static-state change (HF StaticCache keyed by what it holds): adversarial callers.

CPU, simulated backend. Stand-ins follow tests/test_static_state.py (module name patched to
``transformers.cache_utils``). Every check compares with an eager twin (torch.equal).
"""

from __future__ import annotations

import collections
import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg


class Cache:
    def __init__(self, layers):
        self.layers = layers

    @property
    def is_compileable(self) -> bool:
        return all(layer.is_compileable for layer in self.layers)


Cache.__module__ = "transformers.cache_utils"


class StaticLayer:
    is_compileable = True

    def __init__(self, max_len: int = 6):
        self.max_len = max_len
        self.keys = None
        self.is_initialized = False

    def update(self, k, pos):
        if not self.is_initialized:
            self.keys = torch.zeros(k.shape[0], self.max_len, k.shape[-1], dtype=k.dtype)
            self.is_initialized = True
        self.keys.index_copy_(1, pos, k)
        return self.keys


class ScaledLayer(StaticLayer):
    """Another static layer class: writes twice the key."""

    def update(self, k, pos):
        return super().update(k * 2, pos)


class DynamicLayer(StaticLayer):
    is_compileable = False


class Layers(list):
    """A list subclass holding the layers."""


class ODCache(Cache):
    """A cache keeping its layers in an OrderedDict (a dict subclass), indexed 0, 1, ..."""

    def __init__(self, n=2):
        super().__init__(collections.OrderedDict((i, StaticLayer()) for i in range(n)))

    @property
    def is_compileable(self) -> bool:
        return all(layer.is_compileable for layer in self.layers.values())


def static_cache(n=2, layer=StaticLayer):
    return Cache([layer() for _ in range(n)])


class Net(nn.Module):
    def __init__(self, n: int = 2):
        super().__init__()
        self.projs = nn.ModuleList([nn.Linear(16, 16) for _ in range(n)])

    def forward(self, x, cache, pos):
        for i, proj in enumerate(self.projs):
            keys = cache.layers[i].update(proj(x), pos)
            x = x + keys.mean(1, keepdim=True)
        return x


def _pair(cls=Net, seed=0, **kw):
    torch.manual_seed(seed)
    ref = cls()
    return ref, cg.graphify(copy.deepcopy(ref), **kw)


def _keys(layer):
    return layer.keys


def _early_init(cache):
    """As ``Cache.early_initialization``: the tensors exist before the first forward."""
    layers = cache.layers.values() if isinstance(cache.layers, dict) else cache.layers
    for layer in layers:
        layer.update(torch.zeros(1, 0, 16), torch.zeros(0, dtype=torch.long))
    return cache


def _step(ref, g, rc, c, t, x=None):
    x = torch.randn(1, 1, 16) if x is None else x
    pos = torch.tensor([t])
    want = ref(x, rc, pos)
    got = g(x, c, pos)
    assert torch.equal(got, want), f"output differs at step {t}"
    pairs = zip(rc.layers.values(), c.layers.values()) if isinstance(c.layers, dict) \
        else zip(rc.layers, c.layers)
    for a, b in pairs:
        if _keys(a) is not None or _keys(b) is not None:
            assert torch.equal(_keys(a), _keys(b)), f"cache differs at step {t}"


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            yield


# -- silent wrong results ------------------------------------------------------------------------

def test_input_viewing_cache_memory_that_forward_writes(sim):
    """A plain tensor argument that is a view of the cache's memory, read after the forward
    writes the cache: eager sees the write; the graph reads the copy made before the replay."""

    class WriteThenRead(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16)

        def forward(self, x, cache, pos):
            cache.layers[0].update(self.proj(torch.ones(1, 1, 16)), pos)
            return x * 2

    ref, g = _pair(WriteThenRead)
    rc, c = Cache([StaticLayer()]), Cache([StaticLayer()])
    for t in range(2):  # set up, capture
        x = torch.randn(1, 6, 16)[:, :1]
        _step(ref, g, rc, c, t, x)
    # x is now the very cache slot the call writes (same shape and stride as before)
    pos = torch.tensor([2])
    want = ref(rc.layers[0].keys[:, 2:3], rc, pos)
    got = g(c.layers[0].keys[:, 2:3], c, pos)
    assert torch.equal(got, want), "graph read a stale copy of an input aliasing the cache"


@pytest.mark.parametrize("kind", ["list-subclass", "ordered-dict"])
def test_key_sees_tensors_inside_container_subclasses(sim, kind):
    """Two caches whose tensors sit in a list subclass (or an OrderedDict) must not share a
    graph: the key walks only exact dict/list types; subclasses are keyed as empty objects."""
    ref, g = _pair()

    def make():  # early-initialised (else every call is the set-up's remembered eager call)
        if kind == "list-subclass":
            return _early_init(Cache(Layers([StaticLayer(), StaticLayer()])))
        return _early_init(ODCache())

    ra, a = make(), make()
    for t in range(3):
        _step(ref, g, ra, a, t)
    rb, b = make(), make()
    for t in range(3):
        _step(ref, g, rb, b, t)  # B must not replay A's graph (which writes A's memory)


def test_memo_sees_a_layer_class_swap(sim):
    """``layer.__class__ = Other`` changes no dict version: the memoised key must still
    change (the walk's key includes the class; the memo does not re-check it)."""
    ref, g = _pair()
    rc, c = static_cache(), static_cache()
    for t in range(3):
        _step(ref, g, rc, c, t)
    for cc in (rc, c):
        cc.layers[0].__class__ = ScaledLayer
    for t in range(3, 5):
        _step(ref, g, rc, c, t)


def test_memo_sees_a_replaced___dict__(sim):
    """``obj.__dict__ = {...}`` replaces the dict the memo watches: its version never moves."""
    ref, g = _pair()
    rc, c = static_cache(), static_cache()
    for t in range(3):
        _step(ref, g, rc, c, t)
    for cc in (rc, c):
        layer = cc.layers[1]
        layer.__dict__ = dict(layer.__dict__, keys=layer.keys.clone())
    for t in range(3, 5):
        _step(ref, g, rc, c, t)


def test_static_argnames_list_side_effect_of_the_capture_is_undone(sim):
    """A static_argnames object whose forward appends a new tensor to a list on every call:
    the capture's own append must be undone (only dicts are restored)."""

    class Holder:
        def __init__(self):
            self.log = []

    class Logging(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16)

        def forward(self, x, h):
            y = self.proj(x)
            h.log.append(y.sum())
            return y

    torch.manual_seed(0)
    ref = Logging()
    g = cg.graphify(copy.deepcopy(ref), static_argnames=("h",))
    rh, h = Holder(), Holder()
    for _ in range(4):
        x = torch.randn(1, 16)
        assert torch.equal(ref(x, rh), g(x, h))
    assert len(h.log) == len(rh.log), (len(h.log), len(rh.log))


# -- correctness under cache surgery (expected to pass) --------------------------------------------

def test_beam_reorder_every_step(sim):
    """reorder_cache as HF does it: ``keys = keys.index_select(0, beam_idx)`` (new memory)."""
    ref, g = _pair()
    rc, c = static_cache(), static_cache()
    for t in range(6):
        x = torch.randn(2, 1, 16)
        _step(ref, g, rc, c, t, x)
        idx = torch.tensor([1, 0]) if t % 2 else torch.tensor([0, 0])
        for cc in (rc, c):
            for layer in cc.layers:
                layer.keys = layer.keys.index_select(0, idx)


def test_layers_swapped_between_caches_and_within_a_cache(sim):
    ref, g = _pair()
    pairs = [(static_cache(), static_cache()) for _ in range(2)]
    for t in range(3):
        for rc, c in pairs:
            _step(ref, g, rc, c, t)
    (ra, a), (rb, b) = pairs
    for x, y in ((ra, rb), (a, b)):
        x.layers, y.layers = y.layers, x.layers
    for t in range(3, 5):
        for rc, c in pairs:
            _step(ref, g, rc, c, t)
    for cc in (ra, a):  # layer order within one cache
        cc.layers.reverse()
    for t in range(5, 6):
        _step(ref, g, ra, a, t)


def test_keys_swapped_between_layers_and_views_with_offsets(sim):
    ref, g = _pair()
    rc, c = static_cache(), static_cache()
    for t in range(3):
        _step(ref, g, rc, c, t)
    for cc in (rc, c):
        l0, l1 = cc.layers
        l0.keys, l1.keys = l1.keys, l0.keys
    _step(ref, g, rc, c, 3)
    for cc in (rc, c):  # both layers in one storage, at offsets
        big = torch.zeros(2, 1, 6, 16)
        big[0, :] = cc.layers[0].keys
        big[1, :] = cc.layers[1].keys
        cc.layers[0].keys, cc.layers[1].keys = big[0], big[1]
    for t in range(4, 6):
        _step(ref, g, rc, c, t)


def test_shallow_copied_cache_and_layer_list_surgery(sim):
    ref, g = _pair()
    rc, c = static_cache(), static_cache()
    for t in range(3):
        _step(ref, g, rc, c, t)
    rc2, c2 = copy.copy(rc), copy.copy(c)  # shares the layers list and its tensors
    _step(ref, g, rc2, c2, 3)
    _step(ref, g, rc, c, 4)
    for cc in (rc, c):
        cc.layers.append(StaticLayer())
    _step(ref, g, rc, c, 5)
    for cc in (rc, c):
        cc.layers.pop()
    _step(ref, g, rc, c, 5)


def test_one_cache_two_graphed_models(sim):
    torch.manual_seed(0)
    r1, r2 = Net(), Net()
    g1, g2 = cg.graphify(copy.deepcopy(r1)), cg.graphify(copy.deepcopy(r2))
    rc, c = static_cache(), static_cache()
    for t in range(5):
        _step(r1, g1, rc, c, t)
        _step(r2, g2, rc, c, t)
    assert cg.stats(g1).replays > 0 and cg.stats(g2).replays > 0


def test_returned_cache_tensor_is_the_callers(sim):
    """README: an output that is an input (or a view of one) comes back as your tensor. A
    cache's own tensor returned is not made by the call: the root runs piecewise (it was
    graphed and handed out a copy before the probe stopped counting aliases of memory from
    before the call as made by it)."""

    class ReturnsKeys(Net):
        def forward(self, x, cache, pos):
            super().forward(x, cache, pos)
            return cache.layers[0].keys

    ref, g = _pair(ReturnsKeys)
    rc, c = static_cache(), static_cache()
    for t in range(4):
        x, pos = torch.randn(1, 1, 16), torch.tensor([t])
        want, got = ref(x, rc, pos), g(x, c, pos)
        assert torch.equal(want, got)
    assert want is rc.layers[0].keys
    assert got.data_ptr() == c.layers[0].keys.data_ptr(), "a copy, not the cache's tensor"
    (why,) = [r for r in cg.stats(g).eager_calls if r.startswith("piecewise")]
    assert "tensor of an object passed as it is (a cache's own tensor)" in why, why


# -- slowdowns -------------------------------------------------------------------------------------

def test_an_opaque_cache_of_the_same_type_keeps_static_ones_eager(sim):
    """EagerFast.opaque keys on the type: a Cache with a dynamic layer, then Caches (same class)
    with static layers. Correct either way; asks whether the static one is ever graphed."""
    ref, g = _pair(lambda: Net(1))
    g(torch.randn(1, 1, 16), Cache([DynamicLayer()]), torch.tensor([0]))
    rc, c = Cache([StaticLayer()]), Cache([StaticLayer()])
    for t in range(5):
        _step(ref, g, rc, c, t)
    assert cg.stats(g).captures >= 1, cg.stats(g).eager_calls


def test_sliding_window_int_counter_runs_eagerly(sim):
    """HF's StaticSlidingWindowLayer keeps ``cumulative_length_int`` (a Python int) that every
    update bumps: every step would be a new key and a 'side effect'. The first two steps that
    show it run eagerly, the cache is demoted to an opaque object, and the later steps run eagerly
    around it (their projections graphed) without being probed again."""

    class SlidingLayer(StaticLayer):
        def __init__(self):
            super().__init__()
            self.cumulative_length_int = 0

        def update(self, k, pos):
            self.cumulative_length_int += 1
            return super().update(k, pos)

    ref, g = _pair()
    rc, c = static_cache(layer=SlidingLayer), static_cache(layer=SlidingLayer)
    for t in range(6):
        _step(ref, g, rc, c, t)
    s = cg.stats(g)
    assert sum(n for r, n in s.eager_calls.items() if "side effect" in r) == 2, s.eager_calls
    assert s.replays >= 1, s  # the pieces around the cache (seen first on step 4)


def test_static_argnames_many_caches_keep_being_graphed(sim):
    """static_argnames=("cache",) with a new cache per sequence: each cache's set-up defers its
    capture once, and the engine's deferral budget (8) is never given back."""
    ref, g = _pair(static_argnames=("cache",))
    for n in range(12):
        rc, c = static_cache(), static_cache()
        before = cg.stats(g).captures
        for t in range(3):
            _step(ref, g, rc, c, t)
        assert cg.stats(g).captures == before + 1, (n, dict(cg.stats(g).eager_calls))


def test_static_argnames_object_with_an_unread_deque_is_still_graphed(sim):
    """Guarding static_argnames objects (new) walks everything they hold, read or not: a deque
    the forward never reads makes the object unguardable (graphed before the change)."""

    class Holder:
        def __init__(self):
            self.keys = torch.zeros(1, 6, 16)
            self.history = collections.deque(maxlen=4)

    class UsesKeys(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16)

        def forward(self, x, h):
            return self.proj(x) + h.keys.sum(1)

    torch.manual_seed(0)
    ref = UsesKeys()
    g = cg.graphify(copy.deepcopy(ref), static_argnames=("h",))
    rh, h = Holder(), Holder()
    for _ in range(4):
        x = torch.randn(1, 16)
        assert torch.equal(ref(x, rh), g(x, h))
    assert cg.stats(g).captures == 1, dict(cg.stats(g).eager_calls)


def test_training_step_with_a_static_cache(sim):
    """Grad mode with a static cache argument (its tensors carry the call's autograd history):
    outputs and parameter gradients as eager, and no error eager does not raise. Observed: the
    second call's backward raises 'Trying to backward through the graph a second time' (the
    capture's own backward ran through the cache's history from the real call)."""
    torch.manual_seed(0)
    ref = Net()
    g = cg.graphify(copy.deepcopy(ref))
    rc, c = static_cache(), static_cache()
    with torch.enable_grad():
        for t in range(4):
            x, pos = torch.randn(1, 1, 16), torch.tensor([t])
            outs = []
            for m, cc in ((ref, rc), (g, c)):
                m.zero_grad(set_to_none=True)
                out = m(x, cc, pos)
                out.square().sum().backward()
                outs.append(out)
                for layer in cc.layers:  # detach the cache between steps
                    layer.keys = layer.keys.detach()
            assert torch.equal(*outs), t
            for p, q in zip(ref.parameters(), g.parameters()):
                assert torch.equal(p.grad, q.grad), t


class CounterLayer(StaticLayer):
    """A static layer with a host-side position counter: a small CPU tensor (keyed by value,
    read on the host) bumped in place by every update."""

    def __init__(self, max_len: int = 6):
        super().__init__(max_len)
        self.keys = torch.zeros(1, max_len, 16)  # early-initialised
        self.is_initialized = True
        self.pos = torch.zeros((), dtype=torch.long)

    def update(self, k, pos):
        p = int(self.pos)  # a host read of a CPU tensor (not flagged on a GPU)
        self.keys[:, p] = k[:, 0]
        self.pos += 1
        return self.keys

    def reset(self):
        self.keys.zero_()
        self.pos.zero_()


def test_a_small_cpu_tensor_bumped_in_place_is_a_side_effect(sim):
    """The warm-up's StateGuard collects no tensor nested in the object (``is_constant(tensor)``
    is True, so _watch_value skips them): an in-place bump of a host counter is not seen. The
    graph is captured at pos=1 (after the warm-up) but stored under the key of pos=0; a cache
    reset to pos=0 replays it: writes slot 1, leaves pos at 0. (On a GPU the capture's own CPU
    bump also runs for real: pos is bumped twice on the first call.) The simulated device is
    the CPU, so ``int()`` of a CPU tensor is marked safe here, as it is on a GPU; the simulated
    replay then refuses the baked host read (an AssertionError) where a GPU replays it."""
    policy = cg.OpPolicy()
    policy.mark_safe(torch.Tensor.__int__)
    ref, g = _pair(op_policy=policy)
    rc, c = static_cache(layer=CounterLayer), static_cache(layer=CounterLayer)
    for t in range(3):
        _step(ref, g, rc, c, t)
    for cc in (rc, c):
        for layer in cc.layers:
            layer.reset()
    for t in range(3):
        _step(ref, g, rc, c, t)
        assert all(int(a.pos) == int(b.pos) for a, b in zip(rc.layers, c.layers)), t


@pytest.mark.parametrize("where", ["static_argnames", "module-attribute"])
def test_a_replaced_one_element_tensor_of_equal_value_is_seen(sim, where):
    """_DictCheck re-arms when a dict's items are 'the same': same() treats tensors as
    constants (is_constant(tensor) is True) and compares them with bool(a == b), which for a
    one-element tensor of equal value is True. The graph keeps reading the old tensor (held by
    the check); later in-place updates of the new one are not seen."""
    import types

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.cfg = types.SimpleNamespace(scale=torch.ones(1))

        def forward(self, x, h):
            s = h.scale if where == "static_argnames" else self.cfg.scale
            return self.lin(x) * s

    torch.manual_seed(0)
    ref = M()
    g = cg.graphify(copy.deepcopy(ref), static_argnames=("h",))
    rh, h = types.SimpleNamespace(scale=torch.ones(1)), types.SimpleNamespace(scale=torch.ones(1))
    objs = [(ref, rh), (g, h)]
    for _ in range(3):
        x = torch.randn(1, 16)
        assert torch.equal(ref(x, rh), g(x, h))
    captures = cg.stats(g).captures
    holders = [o if where == "static_argnames" else m.cfg for m, o in objs]
    for holder in holders:  # a new tensor of the same value (a call re-arms the check) ...
        holder.scale = torch.ones(1)
    x = torch.randn(1, 16)
    assert torch.equal(ref(x, rh), g(x, h))
    for holder in holders:  # ... then changed in place
        holder.scale.mul_(3)
    x = torch.randn(1, 16)
    assert torch.equal(ref(x, rh), g(x, h)), (captures, cg.stats(g).captures,
                                              dict(cg.stats(g).eager_calls))


def test_a_deque_a_forward_reads_is_guarded(sim):
    """Deques are watched like lists (their items by identity): an append after the capture
    is seen, and the capture's own append is undone."""
    from collections import deque

    class Recent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.scales = deque([1.0, 2.0], maxlen=2)

        def forward(self, x):
            return self.lin(x) * self.scales[-1]

    torch.manual_seed(0)
    ref = Recent()
    g = cg.graphify(copy.deepcopy(ref))
    for _ in range(3):
        x = torch.randn(1, 16)
        assert torch.equal(ref(x), g(x))
    assert cg.stats(g).captures == 1, dict(cg.stats(g).eager_calls)
    for m in (ref, g):
        m.scales.append(3.0)
    x = torch.randn(1, 16)
    assert torch.equal(ref(x), g(x)), "replayed the graph of the old deque"
    assert list(g.scales) == list(ref.scales)


def test_a_static_argnames_object_given_a_new___dict___is_seen(sim):
    """``obj.__dict__ = {...}`` on a static_argnames object leaves the old dict's version
    as it was: the guard checks the object still has that dict."""

    class UsesScale(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x, h):
            return self.lin(x) * h.scale

    torch.manual_seed(0)
    ref = UsesScale()
    g = cg.graphify(copy.deepcopy(ref), static_argnames=("h",))
    class Holder:
        scale = 2.0

    rh, h = Holder(), Holder()
    for _ in range(3):
        x = torch.randn(1, 16)
        assert torch.equal(ref(x, rh), g(x, h))
    assert cg.stats(g).captures == 1, dict(cg.stats(g).eager_calls)
    for o in (rh, h):
        o.__dict__ = {"scale": 5.0}
    x = torch.randn(1, 16)
    assert torch.equal(ref(x, rh), g(x, h)), "replayed with the old scale"
