"""A static cache's set-up done ahead (cudagraphify/_setup.py) on a CPU.

``HFLayer`` stands for transformers' ``StaticLayer`` (its name and module, its
``lazy_initialization`` and the attributes it sets); positions are passed in (the real one
keeps a counter tensor, a CPU scalar on a CPU: host state). Through the graph-reading double
of tests/test_rebase.py, so the later caches are rebased as on a GPU."""

from __future__ import annotations

import torch
from torch import nn

import cudagraphify as cg
from test_rebase import _pair, fam  # noqa: F401 (a fixture)
from test_review_static_state import Cache
from test_share_engine import _tensors, reading  # noqa: F401 (a fixture)


class StaticLayer:
    is_compileable = True
    is_sliding = False

    def __init__(self, max_cache_len: int = 16):  # (over 64 elements: not a CPU scalar)
        self.max_cache_len = max_cache_len
        self.is_initialized = False
        self.keys = self.values = None

    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        self.keys = torch.zeros(self.batch_size, self.num_heads, self.max_cache_len,
                                self.k_head_dim, dtype=self.dtype)
        self.values = torch.zeros(self.batch_size, self.num_heads, self.max_cache_len,
                                  self.v_head_dim, dtype=self.dtype)
        self.is_initialized = True

    def update(self, k, v, pos):
        if not self.is_initialized:
            self.lazy_initialization(k, v)
        self.keys.index_copy_(2, pos, k)
        self.values.index_copy_(2, pos, v)
        return self.keys, self.values


StaticLayer.__module__ = "transformers.cache_utils"


class Attn(nn.Module):
    """Two heads of 4 over a 8-wide model; keys and values go to the cache at ``pos``."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.k = nn.ModuleList([nn.Linear(8, 8) for _ in range(layers)])
        self.v = nn.ModuleList([nn.Linear(8, 8) for _ in range(layers)])

    def forward(self, x, cache, pos):
        b, t, _ = x.shape
        for i, (k, v) in enumerate(zip(self.k, self.v)):
            keys, values = cache.layers[i].update(k(x).view(b, t, 2, 4).transpose(1, 2),
                                                  v(x).view(b, t, 2, 4).transpose(1, 2), pos)
            x = x + (keys.sum(2) * values.mean(2)).reshape(b, 1, 8)
        return x


def _cache(layers: int = 2):
    return Cache([StaticLayer() for _ in range(layers)])


def _register(c):
    for layer in c.layers:
        for t in (layer.keys, layer.values):
            if t is not None:
                _tensors[t.data_ptr()] = t


def _generate(ref, g, prompt: int = 3, steps: int = 3, batch: int = 1):
    """A new pair of caches, a prefill of ``prompt`` tokens, then decode steps (as generate
    with cache_implementation="static")."""
    rc, c = _cache(), _cache()
    x = torch.randn(batch, prompt, 8)
    pos = torch.arange(prompt)
    for t in range(steps + 1):
        want, got = ref(x, rc, pos), g(x, c, pos)
        _register(c)
        assert torch.equal(got, want), t
        for a, b in zip(rc.layers, c.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), t
        x, pos = torch.randn(batch, 1, 8), torch.tensor([prompt + t])
    return rc, c


def test_a_prefill_that_sets_the_cache_up_is_graphed_from_the_second_cache_on(fam):
    ref, g = _pair(Attn)
    kept = [_generate(ref, g)]
    s = cg.stats(g)
    assert s.captures == 1 and s.retargets == 0  # the prefill set the cache up: eager
    (why,) = [r for r in s.eager_calls if "sets up" in r]
    kept.append(_generate(ref, g))  # its prefill: set up ahead, then captured (a template)
    s = cg.stats(g)
    assert s.eager_calls[why] == 1, s.eager_calls
    for _ in range(3):
        kept.append(_generate(ref, g))
    s = cg.stats(g)
    assert s.eager_calls[why] == 1  # never again
    # two families, each a template, a diffed second cache, then rebased: decode from the
    # first generate on (captures in generates 1 and 2, rebased in 3 to 5), the prefill from
    # the second on (captures in generates 2 and 3, rebased in 4 and 5)
    assert (s.captures, s.retargets) == (2 + 2, 3 + 2)


def test_another_batch_or_prompt_length_is_set_up_by_forward(fam):
    """What was done ahead is keyed by the call's signature: a prefill of another shape (or
    batch) sets its cache up itself (eagerly) once, then is done ahead too."""
    ref, g = _pair(Attn)
    kept = [_generate(ref, g), _generate(ref, g, prompt=4), _generate(ref, g, batch=2)]
    s = cg.stats(g)
    (why,) = [r for r in s.eager_calls if "sets up" in r]
    assert s.eager_calls[why] == 3
    kept += [_generate(ref, g, prompt=4), _generate(ref, g, batch=2)]
    assert cg.stats(g).eager_calls[why] == 3


def test_nothing_is_done_ahead_for_a_layer_of_another_type(fam):
    class OtherLayer(StaticLayer):
        pass

    OtherLayer.__module__ = __name__

    def other_cache():
        return Cache([OtherLayer() for _ in range(2)])

    ref, g = _pair(Attn)
    for _ in range(3):
        rc, c = other_cache(), other_cache()
        x, pos = torch.randn(1, 3, 8), torch.arange(3)
        assert torch.equal(g(x, c, pos), ref(x, rc, pos))
    s = cg.stats(g)
    (why,) = [r for r in s.eager_calls if "sets up" in r]
    assert s.eager_calls[why] == 3 and s.captures == 0


def test_a_set_up_that_makes_something_else_is_undone(fam, monkeypatch):
    """If lazy_initialization (a new transformers) makes what was not recorded, the layer is
    put back as it was and forward sets it up (eagerly), as it would have."""
    ref, g = _pair(Attn)
    kept = [_generate(ref, g)]
    real = StaticLayer.lazy_initialization

    def wider(self, k, v):
        real(self, k, v)
        self.keys = torch.zeros(self.batch_size, self.num_heads, self.max_cache_len + 1,
                                self.k_head_dim)

    monkeypatch.setattr(StaticLayer, "lazy_initialization", wider)
    rc, c = _cache(), _cache()
    x, pos = torch.randn(1, 3, 8), torch.arange(3)
    ref(x, rc, pos)
    g(x, c, pos)
    assert c.layers[0].keys.shape[2] == 17  # forward's own set-up (done once, by forward)
    s = cg.stats(g)
    (why,) = [r for r in s.eager_calls if "sets up" in r]
    assert s.eager_calls[why] == 2
    del kept


def test_an_invalidation_forgets_what_was_set_up(fam):
    ref, g = _pair(Attn)
    kept = [_generate(ref, g)]
    state = g._cudagraphify_state
    assert state.set_ups
    state.invalidate("test")
    assert not state.set_ups
    kept.append(_generate(ref, g))
    s = cg.stats(g)
    (why,) = [r for r in s.eager_calls if "sets up" in r]
    assert s.eager_calls[why] == 2
