"""Review of share_graph with a static cache (KV cache passed as is): adversarial layers and callers.

CPU, through the graph-reading double of test_share_engine (``ideal_pool``: each capture's
allocations at virtual addresses in allocation order). Every test compares the shared model with
an eager twin bitwise (outputs and every cache tensor) over several steps. A failing test is a
bug found: the assertion states the correct behaviour.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _share
from test_share_engine import reading, ideal_pool, _register, _tensors  # noqa: F401


# -- a fake HF static cache (recognised as a static state) ------------------------------------

class Cache:
    def __init__(self, layers, **extra):
        self.layers = layers
        for k, v in extra.items():
            setattr(self, k, v)

    @property
    def is_compileable(self) -> bool:
        return all(layer.is_compileable for layer in self.layers)


Cache.__module__ = "transformers.cache_utils"


class KV:
    """A static layer: keys and values allocated on first update, written in place."""

    is_compileable = True

    def __init__(self, max_len: int = 8, values_first: bool = False):
        self.max_len = max_len
        self.values_first = values_first
        self.keys = None
        self.values = None
        self.is_initialized = False

    def init(self, k):
        shape = (k.shape[0], self.max_len, k.shape[-1])
        if self.values_first:
            self.values = torch.zeros(shape, dtype=k.dtype)
            self.keys = torch.zeros(shape, dtype=k.dtype)
        else:
            self.keys = torch.zeros(shape, dtype=k.dtype)
            self.values = torch.zeros(shape, dtype=k.dtype)
        self.is_initialized = True

    def update(self, k, v, pos):
        if not self.is_initialized:
            self.init(k)
        self.keys.index_copy_(1, pos, k)
        self.values.index_copy_(1, pos, v)
        return self.keys, self.values


def kv_cache(n, **kw):
    return Cache([KV(**kw) for _ in range(n)])


def ready(cache, d=16):
    """Allocated up front (as HF's early_initialization)."""
    for layer in cache.layers:
        if not layer.is_initialized:
            layer.init(torch.zeros(1, 1, d))
    return cache


# -- layers ---------------------------------------------------------------------------------

class Attn(nn.Module):
    """HF-like: picks its cache part with self.layer_idx."""

    def __init__(self, idx, d=16):
        super().__init__()
        self.layer_idx = idx
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)

    def forward(self, x, past_key_values=None, pos=None):
        keys, values = past_key_values.layers[self.layer_idx].update(self.k(x), self.v(x), pos)
        att = torch.softmax(x @ keys.transpose(1, 2), -1)
        return x + att @ values


class Model(nn.Module):
    def __init__(self, layer=Attn, n=4, order=None):
        super().__init__()
        self.layers = nn.ModuleList([layer(i) for i in range(n)])
        self.order = order

    def forward(self, x, cache, pos):
        order = self.order if self.order is not None else range(len(self.layers))
        for i in order:
            x = self.layers[i](x, past_key_values=cache, pos=pos)
        return x


def _tensors_of(cache):
    out = []
    for layer in cache.layers:
        for name, v in sorted(vars(layer).items()):
            if isinstance(v, torch.Tensor):
                out.append(v)
    for name, v in sorted(vars(cache).items()):
        if isinstance(v, torch.Tensor):
            out.append(v)
    return out


def _same_cache(rc, c, where):
    a, b = _tensors_of(rc), _tensors_of(c)
    assert len(a) == len(b), where
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"cache tensor {i} differs {where}"


def _twins(layer=Attn, n=4, seed=0, **kw):
    torch.manual_seed(seed)
    ref = Model(layer, n, **kw).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model = copy.deepcopy(ref)
    _register(model)
    group = cg.share_graph(model.layers)
    return ref, model, group


def _decode(ref, model, rc, c, steps, start=0, prefill=0, gen=None):
    gen = gen or torch.Generator().manual_seed(1)
    with torch.no_grad():
        if prefill:
            x = torch.randn(1, prefill, 16, generator=gen)
            pos = torch.arange(prefill)
            want, got = ref(x, rc, pos), model(x, c, pos)
            assert torch.equal(got, want), "prefill output differs"
            _same_cache(rc, c, "after prefill")
            start = prefill
        for t in range(start, start + steps):
            x = torch.randn(1, 1, 16, generator=gen)
            pos = torch.tensor([t])
            want, got = ref(x, rc, pos), model(x, c, pos)
            assert torch.equal(got, want), f"output differs at step {t}"
            _same_cache(rc, c, f"at step {t}")


def _shared_some(group):
    s = group.stats()
    return s.retargets > 0, s


# -- baseline: HF-like layers share and equal eager ------------------------------------------

def test_baseline_layer_idx_cache_shares_and_equals_eager(ideal_pool):
    ref, model, group = _twins()
    _decode(ref, model, kv_cache(4), kv_cache(4), 6)
    ok, s = _shared_some(group)
    assert ok, s.reasons


# -- non-idempotent writes ------------------------------------------------------------------

class Accumulate(Attn):
    """keys += k at pos (index_add_): a replay applied twice would double it."""

    def forward(self, x, past_key_values=None, pos=None):
        layer = past_key_values.layers[self.layer_idx]
        if not layer.is_initialized:
            layer.init(x)
        layer.keys.index_add_(1, pos, self.k(x))
        layer.values.mul_(0.5).index_add_(1, pos, self.v(x))
        att = torch.softmax(x @ layer.keys.transpose(1, 2), -1)
        return x + att @ layer.values


def test_non_idempotent_cache_writes(ideal_pool):
    ref, model, group = _twins(Accumulate)
    _decode(ref, model, ready(kv_cache(4)), ready(kv_cache(4)), 6)


class Roll(Attn):
    """A ring buffer: roll the keys left, write the newest at the end."""

    def forward(self, x, past_key_values=None, pos=None):
        layer = past_key_values.layers[self.layer_idx]
        if not layer.is_initialized:
            layer.init(x)
        layer.keys.copy_(torch.roll(layer.keys, -1, 1))
        layer.keys[:, -1:].copy_(self.k(x))
        att = torch.softmax(x @ layer.keys.transpose(1, 2), -1)
        return x + att @ layer.keys


def test_ring_buffer_roll(ideal_pool):
    ref, model, group = _twins(Roll)
    _decode(ref, model, ready(kv_cache(4)), ready(kv_cache(4)), 6)


# -- a tensor shared by every layer ---------------------------------------------------------

class Counter(Attn):
    """Writes at the cache's shared position counter, then advances it (every layer)."""

    def forward(self, x, past_key_values=None, pos=None):
        c = past_key_values
        layer = c.layers[self.layer_idx]
        layer.keys.index_copy_(1, c.cursor[:1] % layer.max_len, self.k(x))
        c.cursor[:1].add_(1)
        att = torch.softmax(x @ layer.keys.transpose(1, 2), -1)
        return x + att @ layer.keys


def _counter_cache():
    c = ready(kv_cache(4))
    c.cursor = torch.zeros(80, dtype=torch.long)  # (> 64: not keyed by value)
    return c


def test_shared_counter_written_by_every_layer(ideal_pool):
    ref, model, group = _twins(Counter)
    _decode(ref, model, _counter_cache(), _counter_cache(), 6)
    print(group.stats().reasons, group.stats().retargets)


class ReadShared(Attn):
    """Every layer reads a table kept in the cache (read only) besides its own keys."""

    def forward(self, x, past_key_values=None, pos=None):
        c = past_key_values
        layer = c.layers[self.layer_idx]
        layer.keys.index_copy_(1, pos, self.k(x) * c.scale[:16])
        return x + layer.keys.mean(1, keepdim=True)


def test_shared_read_only_tensor_changed_by_the_user(ideal_pool):
    ref, model, group = _twins(ReadShared)
    rc, c = ready(kv_cache(4)), ready(kv_cache(4))
    rc.scale = torch.ones(80)  # (> 64 elements: not keyed by value)
    c.scale = torch.ones(80)
    _decode(ref, model, rc, c, 3)
    with torch.no_grad():
        rc.scale.fill_(3.0)
        c.scale.fill_(3.0)
    _decode(ref, model, rc, c, 3, start=3)
    assert group.stats().retargets > 0, group.stats().reasons


# -- parts read in another order than walked -------------------------------------------------

class NextLayer(Attn):
    """Writes its own keys, reads the next layer's keys (wrapping round)."""

    def forward(self, x, past_key_values=None, pos=None):
        c = past_key_values
        own = c.layers[self.layer_idx]
        nxt = c.layers[(self.layer_idx + 1) % len(c.layers)]
        own.keys.index_copy_(1, pos, self.k(x))
        return x + own.keys.mean(1, keepdim=True) + nxt.keys.mean(1, keepdim=True) * 0.5


def test_reads_next_layer_part_wrapping(ideal_pool):
    ref, model, group = _twins(NextLayer)
    _decode(ref, model, ready(kv_cache(4)), ready(kv_cache(4)), 6)


def test_reads_next_layer_part_template_is_layer_one(ideal_pool):
    ref, model, group = _twins(NextLayer, order=[1, 2, 3, 0])
    _decode(ref, model, ready(kv_cache(4)), ready(kv_cache(4)), 6)


def test_keys_values_walked_in_another_order_for_one_layer(ideal_pool):
    ref, model, group = _twins()

    def cache():
        return Cache([KV(values_first=(i == 3)) for i in range(4)])

    _decode(ref, model, cache(), cache(), 6)


# -- layer_idx used for something besides the cache part -------------------------------------

class Scaled(Attn):
    def forward(self, x, past_key_values=None, pos=None):
        keys, values = past_key_values.layers[self.layer_idx].update(self.k(x), self.v(x), pos)
        return x * (1.0 + (self.layer_idx == 3)) + values.mean(1, keepdim=True)


def test_layer_idx_selects_a_scale(ideal_pool):
    ref, model, group = _twins(Scaled)
    _decode(ref, model, kv_cache(4), kv_cache(4), 5)


class PicksIntermediate(Attn):
    """Both intermediates computed, layer_idx chooses which is used (same kernels)."""

    def forward(self, x, past_key_values=None, pos=None):
        keys, values = past_key_values.layers[self.layer_idx].update(self.k(x), self.v(x), pos)
        a = keys.mean(1, keepdim=True)
        b = values.mean(1, keepdim=True)
        h = a if self.layer_idx < 2 else b
        return x + h * 1.0


def test_layer_idx_picks_intermediate(ideal_pool):
    ref, model, group = _twins(PicksIntermediate)
    _decode(ref, model, kv_cache(4), kv_cache(4), 5)


class FutureSlot(Attn):
    """Layer 3 also reads a cache slot not yet written at the check (zero then)."""

    def forward(self, x, past_key_values=None, pos=None):
        keys, values = past_key_values.layers[self.layer_idx].update(self.k(x), self.v(x), pos)
        j = 4 if self.layer_idx == 3 else 0
        return x + keys.mean(1, keepdim=True) + values[:, j:j + 1]


def test_layer_idx_picks_a_slot_that_is_zero_at_the_check(ideal_pool):
    ref, model, group = _twins(FutureSlot)
    _decode(ref, model, ready(kv_cache(4)), ready(kv_cache(4)), 7)


# -- outputs aliasing the cache --------------------------------------------------------------

class ReturnsKeys(Attn):
    def forward(self, x, past_key_values=None, pos=None):
        keys, values = past_key_values.layers[self.layer_idx].update(self.k(x), self.v(x), pos)
        return x + values.mean(1, keepdim=True), keys[:, :2]


class ModelPair(Model):
    def forward(self, x, cache, pos):
        outs = []
        for layer in self.layers:
            x, k = layer(x, past_key_values=cache, pos=pos)
            outs.append(k.clone())
        return torch.cat([x] + outs, 1)


def test_layer_returns_a_view_of_its_cache(ideal_pool):
    torch.manual_seed(0)
    ref = ModelPair(ReturnsKeys).eval()
    model = copy.deepcopy(ref)
    _register(model)
    cg.share_graph(model.layers)
    _decode(ref, model, kv_cache(4), kv_cache(4), 5)


class ReturnsUntouched(Attn):
    """Writes its keys; returns its values tensor untouched (the model writes values)."""

    def forward(self, x, past_key_values=None, pos=None):
        layer = past_key_values.layers[self.layer_idx]
        layer.keys.index_copy_(1, pos, self.k(x))
        return x + layer.keys.mean(1, keepdim=True), layer.values


class ModelWritesValues(Model):
    def forward(self, x, cache, pos):
        outs = []
        for i, layer in enumerate(self.layers):
            if int(pos[0]) >= 3:  # (the model fills values from step 3 on)
                cache.layers[i].values.index_copy_(1, pos, x * (i + 1))
            x, v = layer(x, past_key_values=cache, pos=pos)
            outs.append(v.sum(1, keepdim=True))
        return torch.cat([x] + outs, 1)


def test_layer_returns_a_cache_tensor_it_does_not_touch(ideal_pool):
    torch.manual_seed(0)
    ref = ModelWritesValues(ReturnsUntouched).eval()
    model = copy.deepcopy(ref)
    _register(model)
    cg.share_graph(model.layers)
    _decode(ref, model, ready(kv_cache(4)), ready(kv_cache(4)), 6)


# -- the user's cache handling ---------------------------------------------------------------

def test_new_cache_every_generation(ideal_pool):
    """generate() with a fresh StaticCache per call: stays right, and the dead caches go."""
    ref, model, group = _twins()
    refs = []
    for g in range(20):
        rc, c = kv_cache(4), kv_cache(4)
        _decode(ref, model, rc, c, 3, prefill=2, gen=torch.Generator().manual_seed(g))
        refs.append(weakref.ref(c))
        del rc, c
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive <= 1, f"{alive} dead caches kept alive"


def test_new_cache_every_generation_keeps_sharing(ideal_pool):
    """Speed: a template per cache (keyed by addresses) is never dropped when its cache dies:
    after max_graphs caches, no layer shares any more (and the dead templates' graphs and pool
    memory stay until release)."""
    ref, model, group = _twins()
    for g in range(20):
        _decode(ref, model, kv_cache(4), kv_cache(4), 3, prefill=2,
                gen=torch.Generator().manual_seed(g))
    s = group.stats()
    late = [r for r in s.reasons if "max_graphs" in r]
    assert not late, s.reasons


def test_reset_between_generations(ideal_pool):
    ref, model, group = _twins()
    rc, c = kv_cache(4), kv_cache(4)
    for g in range(3):
        _decode(ref, model, rc, c, 4, prefill=2, gen=torch.Generator().manual_seed(g))
        with torch.no_grad():
            for cache in (rc, c):
                for layer in cache.layers:
                    layer.keys.zero_()
                    layer.values.zero_()


def test_two_caches_interleaved(ideal_pool):
    ref, model, group = _twins()
    rc1, c1, rc2, c2 = (kv_cache(4) for _ in range(4))
    gen = torch.Generator().manual_seed(3)
    for t in range(5):
        _decode(ref, model, rc1, c1, 1, start=t, gen=gen)
        _decode(ref, model, rc2, c2, 1, start=t, gen=gen)


def test_cache_tensors_replaced_by_user(ideal_pool):
    """The user swaps one layer's keys for a new tensor (a crop by re-allocation)."""
    ref, model, group = _twins()
    rc, c = kv_cache(4), kv_cache(4)
    _decode(ref, model, rc, c, 3)
    for cache in (rc, c):
        cache.layers[2].keys = cache.layers[2].keys.clone()
    _decode(ref, model, rc, c, 3, start=3)


def test_layers_called_in_reverse_order(ideal_pool):
    ref, model, group = _twins(order=[3, 2, 1, 0])
    _decode(ref, model, kv_cache(4), kv_cache(4), 5)


def test_max_templates_one_with_prefill_and_decode(ideal_pool):
    torch.manual_seed(0)
    ref = Model().eval()
    model = copy.deepcopy(ref)
    _register(model)
    cg.share_graph(model.layers, max_graphs=1) if "max_graphs" in \
        cg.share_graph.__code__.co_varnames else cg.share_graph(model.layers)
    rc, c = kv_cache(4), kv_cache(4)
    _decode(ref, model, rc, c, 2, prefill=3)
    _decode(ref, model, rc, c, 2, start=5)


def test_unshare_midway(ideal_pool):
    ref, model, group = _twins()
    rc, c = kv_cache(4), kv_cache(4)
    _decode(ref, model, rc, c, 3)
    group.unshare()
    _decode(ref, model, rc, c, 3, start=3)


def test_release_midway(ideal_pool):
    ref, model, group = _twins()
    rc, c = kv_cache(4), kv_cache(4)
    _decode(ref, model, rc, c, 3)
    group.release()
    _decode(ref, model, rc, c, 3, start=3)


# -- failures midway through make ------------------------------------------------------------

@pytest.mark.parametrize("error", [RuntimeError, "CaptureFailed"])
@pytest.mark.parametrize("where", ["_prove_same_memory", "_retarget", "_partner_on_copy"])
def test_failure_midway_leaves_the_cache_as_eager(ideal_pool, monkeypatch, where, error):
    """An unexpected error inside make (the real call already ran): the cache must be what
    eager left, and the call must return eager's result (sharing refused, not a crash)."""
    from cudagraphify._errors import CaptureFailed
    error = CaptureFailed if error == "CaptureFailed" else error
    real = getattr(_share.ShareGroup, where)
    calls = [0]

    def boom(self, *a, **kw):
        calls[0] += 1
        if calls[0] == 1:
            raise error("boom")
        return real(self, *a, **kw)

    monkeypatch.setattr(_share.ShareGroup, where, boom)
    ref, model, group = _twins()
    rc, c = kv_cache(4), kv_cache(4)
    raised = []
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in range(5):
            x = torch.randn(1, 1, 16, generator=gen)
            pos = torch.tensor([t])
            want = ref(x, rc, pos)
            try:
                got = model(x, c, pos)
            except RuntimeError as e:  # (the rest of the model's layers did not run)
                raised.append(f"step {t}: {type(e).__name__}: {e}")
                break
            assert torch.equal(got, want), f"output differs at step {t}"
            _same_cache(rc, c, f"at step {t}")
    assert calls[0] >= 1
    assert not raised, raised
    s = group.stats()
    assert s.retargets + s.per_layer > 0, s


# -- caches whose parts share memory ----------------------------------------------------------

def test_layers_parts_are_views_of_one_tensor(ideal_pool):
    ref, model, group = _twins()

    def cache():
        c = kv_cache(4)
        big = torch.zeros(8, 1, 8, 16)
        for i, layer in enumerate(c.layers):
            layer.keys, layer.values = big[2 * i], big[2 * i + 1]
            layer.is_initialized = True
        return c

    _decode(ref, model, cache(), cache(), 5)


# -- a part the layer reads but does not write; two caches per call ---------------------------

class ReadsOnly(Attn):
    def forward(self, x, past_key_values=None, pos=None):
        keys = past_key_values.layers[self.layer_idx].keys
        return x + torch.softmax(self.k(x) @ keys.transpose(1, 2), -1) @ keys


class ModelWritesKeys(Model):
    def forward(self, x, cache, pos):
        for i, layer in enumerate(self.layers):
            cache.layers[i].keys.index_copy_(1, pos, x * (i + 1))
            x = layer(x, past_key_values=cache, pos=pos)
        return x


def test_part_read_not_written_by_the_layer(ideal_pool):
    torch.manual_seed(0)
    ref = ModelWritesKeys(ReadsOnly).eval()
    model = copy.deepcopy(ref)
    _register(model)
    group = cg.share_graph(model.layers)
    _decode(ref, model, ready(kv_cache(4)), ready(kv_cache(4)), 6)
    assert group.stats().retargets > 0, group.stats().reasons


class TwoCaches(Attn):
    def forward(self, x, past_key_values=None, pos=None, cross=None):
        keys, values = past_key_values.layers[self.layer_idx].update(self.k(x), self.v(x), pos)
        ck = cross.layers[self.layer_idx].keys
        return x + values.mean(1, keepdim=True) + ck.mean(1, keepdim=True)


class ModelTwo(Model):
    def forward(self, x, cache, pos):
        self_c, cross_c = cache
        for layer in self.layers:
            x = layer(x, past_key_values=self_c, pos=pos, cross=cross_c)
        return x


def test_two_cache_objects_per_call(ideal_pool):
    torch.manual_seed(0)
    ref = ModelTwo(TwoCaches).eval()
    model = copy.deepcopy(ref)
    _register(model)
    group = cg.share_graph(model.layers)

    def caches():
        cross = ready(kv_cache(4))
        with torch.no_grad():
            for i, layer in enumerate(cross.layers):
                layer.keys.normal_(generator=torch.Generator().manual_seed(i))
        return ready(kv_cache(4)), cross

    rc, c = caches(), caches()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in range(6):
            x = torch.randn(1, 1, 16, generator=gen)
            pos = torch.tensor([t])
            assert torch.equal(model(x, c, pos), ref(x, rc, pos)), f"step {t}"
            for a, b in zip(rc, c):
                _same_cache(a, b, f"step {t}")
    assert group.stats().retargets > 0, group.stats().reasons
