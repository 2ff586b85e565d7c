"""Review of b8e0eed (a static cache whose Python state the forward changes is demoted to an
opaque object: cudagraphify/_state.py ``demote``/``demoted``, _first_call.py ``warm_up``,
_signature.py ``_opaque_reason``) and c6fd56d (a region graph blocked by the held output of a
graph captured after it is captured again: _region.py ``blocked_by``, _engine.py ``_replay``,
bounded by ``_MAX_RECAPTURES``).

CPU, simulated backend (fixture ``sim``). Every output is compared with an eager twin
(``copy.deepcopy`` before graphify), bitwise (``torch.equal``), caches too.

``test_finding_*``: a problem on the reviewed code (each failed there; all fixed since: one
guard per passed object finds the one that changed, and a static state is demoted once two
calls changed it, see ``_state.changed_again``). All are performance losses with correct
values (no silent wrong value was found on the CPU double):

- F1 (three tests). ``FirstCall.warm_up`` looks for the passed object that changed with
  ``next(... if not StateGuard([], objects=[(where, obj)]).valid() ..., passed[0])``. A
  StateGuard built after the call checks against the state as it is now, so ``valid()`` is
  always True, ``next`` never finds anything, and it always returns ``passed[0]`` (the
  ``static_argnames`` objects, then the static states, in argument order). This line was there
  before b8e0eed, but b8e0eed now calls ``demote(passed[0])``, which lasts as long as the
  object does and applies to every callable. So a cache that never changed is demoted (a second
  cache's ordinary lazy set-up is enough), the cache that did change is not (its calls are
  still each a new key with a probed first call, the slowdown b8e0eed set out to remove), and
  the reason names the wrong argument.
- F2 (two tests). A cache whose Python state changes once (a flag set by its first decode
  step, as HF's
  ``has_previous_state`` or ``is_updated``) and never again is demoted for good. Before
  b8e0eed, one call ran eagerly and the whole model graphed after that. Now the root runs
  eagerly around the cache from then on, and the reason says "changes on every call". Since
  99043f9 (a callable that demoted two caches of a kind demotes the next one of that kind
  before its first call), every later cache of that kind never graphs at all.

``test_control_*``: scenarios checked and found correct (they pass).
"""

from __future__ import annotations

import copy
import gc
import threading
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _engine, _state

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, StaticCache as HFStaticCache, cache_utils  # noqa: E402

from test_review_hfcache import DevStaticLayer  # noqa: E402
from test_review_static_state import Net  # noqa: E402


# -- stand-ins (transformers 5's Cache/StaticLayer shape; classes of this file only) ----------

class Cache:
    def __init__(self, layers):
        self.layers = layers

    @property
    def is_compileable(self) -> bool:
        return all(layer.is_compileable for layer in self.layers)

    def reset(self):
        for layer in self.layers:
            layer.reset()


Cache.__module__ = "transformers.cache_utils"  # (what is_static_state looks for)


class Layer:
    is_compileable = True

    def __init__(self, max_len: int = 32):
        self.max_len = max_len
        self.keys = None
        self.is_initialized = False

    def update(self, k, pos):
        if not self.is_initialized:  # allocated on the first update
            self.keys = torch.zeros(k.shape[0], self.max_len, k.shape[-1], dtype=k.dtype)
            self.is_initialized = True
        self.keys.index_copy_(1, pos, k)
        return self.keys

    def reset(self):
        if self.is_initialized:
            self.keys.zero_()


class SlidingLayer(Layer):
    """HF's StaticSlidingWindowLayer's trait: a Python int bumped by every update."""

    def __init__(self, max_len: int = 32):
        super().__init__(max_len)
        self.count = 0

    def update(self, k, pos):
        self.count += 1
        return super().update(k, pos)

    def reset(self):
        super().reset()
        self.count = 0


def cache(n=2, layer=Layer):
    return Cache([layer() for _ in range(n)])


class TwoCaches(nn.Module):
    """A forward given two static caches (a target's and a draft's, say)."""

    def __init__(self, counts_b: bool = False):
        super().__init__()
        self.a, self.b = Net(), Net()
        self.counts_b = counts_b

    def forward(self, x, ca, cb, pos):
        if self.counts_b:  # only cb's Python state changes
            cb.steps = getattr(cb, "steps", 0) + 1
        return self.a(x, ca, pos) + self.b(x, cb, pos)


def _twin(module, **options):
    return module, cg.graphify(copy.deepcopy(module), **options)


def _same_caches(a, b) -> bool:
    return all((x.keys is None and y.keys is None) or torch.equal(x.keys, y.keys)
               for x, y in zip(a.layers, b.layers))


def _own(g):
    """``g``'s own GraphedState (cg.stats adds its pieces' counters); None before a call."""
    return g.__dict__.get("_cudagraphify_state")


def _count(g, *words) -> int:
    return sum(n for r, n in cg.stats(g).eager_calls.items() if any(w in r for w in words))


OPAQUE = "has Python state that the forward changes"
SIDE = "side effect"


@pytest.fixture(autouse=True)
def _quiet_no_grad():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            yield


@pytest.fixture(autouse=True)
def _no_global_leak():
    """Whatever process-wide demotion state exists is put back (a demotion must not leak
    into the other test files)."""
    saved = {name: dict(getattr(_state, name)) for name in ("_changing", "_changed_once")
             if isinstance(getattr(_state, name, None), dict)}
    yield
    for name, d in saved.items():
        now = getattr(_state, name)
        for k in [k for k in now if k not in d]:
            now.pop(k, None)


@pytest.fixture
def device_counter(monkeypatch):
    monkeypatch.setitem(cache_utils.STATIC_LAYER_TYPE_MAPPING, "full_attention", DevStaticLayer)


# -- findings (failed on the code reviewed; fixed: per-object guards, two strikes) -------------

def test_finding_a_second_caches_set_up_demotes_the_first(sim):
    """No Python state changes anywhere: a persistent cache ``ca`` and a new cache ``cb`` per
    request (allocated by its first update). The request's first call is a set-up of cb, but
    the object examined is passed[0] = ca, which allocated nothing: "side effect", and ca is
    demoted for good. Before b8e0eed the root graphed again from the request's second call."""
    ref, g = _twin(TwoCaches())
    rca, ca = cache(), cache()
    for n in range(3):
        rcb, cb = cache(), cache()
        for t in range(4):
            x, pos = torch.randn(1, 1, 16), torch.tensor([4 * n + t])
            assert torch.equal(g(x, ca, cb, pos), ref(x, rca, rcb, pos)), (n, t)
            assert _same_caches(rca, ca) and _same_caches(rcb, cb), (n, t)
    assert not _state.demoted(ca), "a cache whose Python state never changed was demoted"
    assert _count(g, OPAQUE) == 0, cg.stats(g).eager_calls


def test_finding_the_changed_cache_is_not_the_one_demoted(sim):
    ref, g = _twin(TwoCaches(counts_b=True))
    rca, rcb, ca, cb = cache(), cache(), cache(), cache()
    for t in range(6):
        x, pos = torch.randn(1, 1, 16), torch.tensor([t])
        assert torch.equal(g(x, ca, cb, pos), ref(x, rca, rcb, pos)), t
        assert _same_caches(rca, ca) and _same_caches(rcb, cb), t
    side = [r for r in cg.stats(g).eager_calls if SIDE in r]
    # another graphified model given ca alone: its forward never changes ca's Python state
    net = Net()
    rnet, gnet = _twin(net)
    rca2 = copy.deepcopy(ca)
    for t in range(6, 12):
        x, pos = torch.randn(1, 1, 16), torch.tensor([t])
        assert torch.equal(gnet(x, ca, pos), rnet(x, rca2, pos)), t
    found = dict(ca_demoted=_state.demoted(ca), cb_demoted=_state.demoted(cb), side=side,
                 net=cg.stats(gnet).eager_calls)
    assert _state.demoted(cb) and not _state.demoted(ca), found
    assert all("argument 2" in r for r in side), found  # (cb is argument 2)
    assert _count(gnet, OPAQUE) == 0, found


def test_finding_a_static_argnames_object_keeps_a_sliding_cache_probed_every_step(sim):
    """b8e0eed: "no probed first call per decode step". With any ``static_argnames`` object
    in the call, passed[0] is that object: the cache is not demoted, every step is a new key
    whose first call runs the probe and ends "side effect", blamed on the object, not the
    cache."""

    class Aux:
        def __init__(self):
            self.bias = torch.zeros(1, 1, 16)

    class M(Net):
        def forward(self, x, c, pos, aux):
            return super().forward(x, c, pos) + aux.bias

    ref, g = _twin(M(), static_argnames=("aux",))
    rc, c, aux = cache(layer=SlidingLayer), cache(layer=SlidingLayer), Aux()
    for t in range(12):
        x, pos = torch.randn(1, 1, 16), torch.tensor([t])
        assert torch.equal(g(x, c, pos, aux=aux), ref(x, rc, pos, aux)), t
        assert _same_caches(rc, c) and [l.count for l in rc.layers] == \
            [l.count for l in c.layers], t
    found = dict(demoted=_state.demoted(c), eager=cg.stats(g).eager_calls)
    assert _state.demoted(c), found
    assert _count(g, SIDE) <= 2, found  # (the set-up, the step that shows it)
    assert not any("'aux'" in r and SIDE in r for r in cg.stats(g).eager_calls), found


def test_finding_a_python_change_made_once_demotes_the_cache_for_good(sim):

    class Once(Net):
        def forward(self, x, c, pos):
            if c.layers[0].is_initialized and not getattr(c, "warm", False):
                c.warm = True  # set once (as HF's has_previous_state / is_updated), then never
            return super().forward(x, c, pos)

    ref, g = _twin(Once())
    rc, c = cache(), cache()
    for t in range(12):
        x, pos = torch.randn(1, 1, 16), torch.tensor([t])
        assert torch.equal(g(x, c, pos), ref(x, rc, pos)), t
        assert _same_caches(rc, c), t
    s = cg.stats(g)
    # the parent of b8e0eed: the set-up call and the call that set the flag eager, then the
    # whole model captured once and replayed (9 of 12 calls)
    assert sum(s.eager_calls.values()) <= 2, s.eager_calls
    assert not any("on every call" in r for r in s.eager_calls), s.eager_calls


def test_finding_caches_that_change_once_demote_their_whole_kind(sim):

    class Once(Net):
        def forward(self, x, c, pos):
            if c.layers[0].is_initialized and not getattr(c, "warm", False):
                c.warm = True
            return super().forward(x, c, pos)

    ref, g = _twin(Once())
    for n in range(3):
        rc, c = cache(), cache()
        before = _own(g).replays if _own(g) is not None else 0
        for t in range(8):
            x, pos = torch.randn(1, 1, 16), torch.tensor([t])
            assert torch.equal(g(x, c, pos), ref(x, rc, pos)), (n, t)
            assert _same_caches(rc, c), (n, t)
    # before b8e0eed: each cache's set-up and flag calls eager, its 6 other steps replayed
    assert _own(g).replays - before >= 5, cg.stats(g).eager_calls


# -- controls: demotion (pass: checked and found correct) --------------------------------------

def _decode(ref, g, rc, c, steps, start=0, **kw):
    for t in range(start, start + steps):
        x, pos = torch.randn(1, 1, 16), torch.tensor([t])
        assert torch.equal(g(x, c, pos, **kw), ref(x, rc, pos, **kw)), t
        assert _same_caches(rc, c), t
        assert [getattr(l, "count", 0) for l in rc.layers] == \
            [getattr(l, "count", 0) for l in c.layers], t


def test_control_sliding_cache_demoted_once_then_reset_and_passed_again(sim):
    """Demoted on its third call (set up, then two calls that change it); then reset (its
    count back to 0) and decoded again, twice:
    still demoted (no new probe), values and caches as eager's, the pieces replay."""
    ref, g = _twin(Net())
    rc, c = cache(layer=SlidingLayer), cache(layer=SlidingLayer)
    _decode(ref, g, rc, c, 5)
    assert _state.demoted(c) and not _state.is_static_state(c)
    for _ in range(2):
        rc.reset()
        c.reset()
        _decode(ref, g, rc, c, 5)
    assert _count(g, SIDE) == 2 and _state.demoted(c), cg.stats(g).eager_calls
    assert cg.stats(g).replays >= 20, cg.stats(g)


def test_control_a_demoted_cache_that_dies_leaves_nothing_and_its_id_is_not_inherited(sim):
    ref, g = _twin(Net())
    gc.collect()
    before = len(_state._changing)
    seen = set()
    for n in range(4):
        rc, c = cache(layer=SlidingLayer), cache(layer=SlidingLayer)
        seen.add(id(c))
        _decode(ref, g, rc, c, 4)
        assert _state.demoted(c)
        rc = c = None
        gc.collect()
        assert len(_state._changing) == before, n
        fresh = cache(layer=SlidingLayer)  # (often at a dead one's address)
        assert not _state.demoted(fresh) and _state.is_static_state(fresh), n
        del fresh
    # a full-attention cache of the same classes of layer is static state, keyed as before
    rc, c = cache(), cache()
    _decode(ref, g, rc, c, 4)
    assert not _state.demoted(c) and _state.is_static_state(c)


def test_control_two_models_share_a_demoted_cache_and_a_graphified_function(sim):
    """Model A bumps the cache's count, model B and a graphified function only read and write
    its tensors; calls interleaved on one cache: every output and the cache as eager's."""

    class Counting(Net):
        def forward(self, x, c, pos):
            c.steps = getattr(c, "steps", 0) + 1
            return super().forward(x, c, pos)

    torch.manual_seed(0)
    ra, ga = _twin(Counting())
    rb, gb = _twin(Net())
    inner, rinner = Net(), None
    rinner = copy.deepcopy(inner)

    @cg.graphify
    def f(x, c, pos):
        return inner(x, c, pos) * 2

    rc, c = cache(), cache()
    for t in range(12):
        x, pos = torch.randn(1, 1, 16), torch.tensor([t])
        if t % 3 == 0:
            got, want = ga(x, c, pos), ra(x, rc, pos)
        elif t % 3 == 1:
            got, want = gb(x, c, pos), rb(x, rc, pos)
        else:
            got, want = f(x, c, pos), rinner(x, rc, pos) * 2
        assert torch.equal(got, want), t
        assert _same_caches(rc, c) and getattr(c, "steps", 0) == getattr(rc, "steps", 0), t
    assert _state.demoted(c)
    assert _count(gb, OPAQUE) > 0 and _count(f, OPAQUE) > 0


class Block(nn.Module):
    """A layer given the cache: its own slot of it, then an MLP."""

    def __init__(self, i):
        super().__init__()
        self.i = i
        self.proj = nn.Linear(16, 16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x, c, pos):
        x = x + c.layers[self.i].update(self.proj(x), pos).mean(1, keepdim=True)
        return x + self.mlp(x)


def test_control_a_piecewise_root_whose_layer_pieces_demote_the_cache_mid_forward(sim):
    """The root has a host sync (piecewise); its layers are pieces given the cache as static
    state. Layer 0's first call that bumps the count demotes the cache in the middle of the
    root's forward: layer 1 then finds it opaque and plans around it. Values as eager's."""

    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(0), Block(1)])
            self.head = nn.Linear(16, 16)

        def forward(self, x, c, pos):
            for b in self.blocks:
                x = b(x, c, pos)
            if x.sum().item() > 1e9:  # a host sync: the root is piecewise
                x = x * 0
            return self.head(x[:, -1:])

    torch.manual_seed(0)
    ref, g = _twin(Root().eval())
    for n in range(3):
        rc, c = cache(layer=SlidingLayer), cache(layer=SlidingLayer)
        _decode(ref, g, rc, c, 6)
        assert _state.demoted(c)
    assert cg.stats(g.blocks[1].mlp).replays >= 4, cg.stats(g.blocks[1].mlp)


def test_control_share_graph_layers_given_a_demoted_cache(sim):
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(i) for i in range(3)])

        def forward(self, x, c, pos):
            for b in self.blocks:
                x = b(x, c, pos)
            return x

    torch.manual_seed(0)
    ref = Root().eval()
    m = copy.deepcopy(ref)
    group = cg.share_graph(m.blocks)
    for n in range(2):
        rc, c = cache(3, SlidingLayer), cache(3, SlidingLayer)
        _decode(ref, m, rc, c, 5)
        assert _state.demoted(c)
    assert group.stats().pieces["mlp"].replays >= 12, group.stats()


def test_control_a_demoted_cache_under_grad_mode_and_in_a_users_region(sim):
    ref, g = _twin(Net())
    rc, c = cache(layer=SlidingLayer), cache(layer=SlidingLayer)
    _decode(ref, g, rc, c, 3)
    assert _state.demoted(c)
    with torch.enable_grad():
        for t in range(3, 5):
            x, pos = torch.randn(1, 1, 16, requires_grad=True), torch.tensor([t])
            got, want = g(x, c, pos), ref(x, rc, pos)
            assert torch.equal(got, want), t
            gx, = torch.autograd.grad(got.sum(), x)
            wx, = torch.autograd.grad(want.sum(), x)
            assert torch.equal(gx, wx), t
    with cg.graph_region():
        _decode(ref, g, rc, c, 3, start=5)
    _decode(ref, g, rc, c, 3, start=8)


def test_control_threads_each_with_its_own_sliding_cache(sim):
    ref, g = _twin(Net())
    errors = []

    def run(seed):
        try:
            gen = torch.Generator().manual_seed(seed)
            rc, c = cache(layer=SlidingLayer), cache(layer=SlidingLayer)
            with torch.no_grad():
                for t in range(8):
                    x, pos = torch.randn(1, 1, 16, generator=gen), torch.tensor([t])
                    got, want = g(x, c, pos), ref(x, rc, pos)
                    if not (torch.equal(got, want) and _same_caches(rc, c)):
                        errors.append((seed, t))
            if not _state.demoted(c):
                errors.append((seed, "not demoted"))
        except Exception as e:  # noqa: BLE001
            errors.append((seed, repr(e)))

    threads = [threading.Thread(target=run, args=(s,)) for s in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors


def _qwen_sliding():
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, use_sliding_window=True,
                                      sliding_window=4, max_window_layers=1, pad_token_id=0,
                                      max_position_embeddings=128)
    model = transformers.Qwen2ForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model, config


_GEN = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True)


def _same_generate(a, b) -> bool:
    return torch.equal(a.sequences, b.sequences) and len(a.logits) == len(b.logits) and all(
        torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def test_control_hf_sliding_window_generate_static_prompts_and_batch(sim, device_counter):
    """Qwen2 with a sliding layer (HF's StaticSlidingWindowLayer), generate() with a new
    static cache per call, prompts past the window, batch 2: tokens and logits as eager's."""
    ref, _ = _qwen_sliding()
    g = cg.graphify(copy.deepcopy(ref))
    for n, (batch, length) in enumerate([(1, 3), (1, 6), (2, 3)]):
        ids = torch.randint(1, 64, (batch, length), generator=torch.Generator().manual_seed(n))
        want = ref.generate(ids, cache_implementation="static", disable_compile=True, **_GEN)
        got = g.generate(ids, cache_implementation="static", **_GEN)
        assert _same_generate(got, want), n
    # (each new cache: a set-up and two probed steps first)
    assert cg.stats(g.model.layers[0].mlp).replays >= 5


def test_control_hf_sliding_cache_kept_reset_and_shared_with_a_dynamic_cache(sim,
                                                                             device_counter):
    """A kept sliding StaticCache reset between generations (demoted on the first), with a
    DynamicCache generation between them: tokens, logits and the cache as eager's."""
    ref, config = _qwen_sliding()
    g = cg.graphify(copy.deepcopy(ref))
    rc = HFStaticCache(config=config, max_cache_len=16)
    c = HFStaticCache(config=config, max_cache_len=16)
    for n in range(3):
        ids = torch.randint(1, 64, (1, 5), generator=torch.Generator().manual_seed(10 + n))
        if n == 1:
            want = ref.generate(ids, past_key_values=DynamicCache(config=config),
                                disable_compile=True, **_GEN)
            got = g.generate(ids, past_key_values=DynamicCache(config=config), **_GEN)
        else:
            rc.reset()
            c.reset()
            want = ref.generate(ids, past_key_values=rc, disable_compile=True, **_GEN)
            got = g.generate(ids, past_key_values=c, **_GEN)
            for x, y in zip(rc.layers, c.layers):
                assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values), n
        assert _same_generate(got, want), n
    assert _state.demoted(c)
    assert _count(g, SIDE) == 2, cg.stats(g).eager_calls  # (two calls show it)


# -- controls: recapture after a later blocker (c6fd56d) ---------------------------------------

_VIEW = "still referenced through a view"


def test_control_region_graph_blocked_by_a_later_graphs_view_is_captured_again(sim):
    """In a user's region: F, then G (reads F's output in place); the caller keeps a view of
    G's output across the next F call. F is released and captured again (after G), then
    replays; every value (kept views included) as eager's."""
    torch.manual_seed(0)
    rf, gf = _twin(nn.Linear(8, 8))
    rg, gg = _twin(nn.Linear(8, 8))
    kept = []
    with cg.graph_region():
        v = rv = None
        for t in range(10):
            x = torch.randn(4, 8)
            a, ra = gf(x), rf(x)
            b, rb = gg(a), rg(ra)
            assert torch.equal(a, ra) and torch.equal(b, rb), t
            if v is not None:
                assert torch.equal(v, rv), t
                kept.append((v, rv))
            v, rv = b[:2], rb[:2]  # the view held across the next F call
            del a, b
            for got, want in kept[-3:]:
                assert torch.equal(got, want), t
    s = cg.stats(gf)
    assert s.captures == 2 and s.replays >= 6, s  # (captured again after three blocked calls)
    assert gf._cudagraphify_state._recaptures == 1


def test_a_recapture_that_worked_does_not_use_up_the_budget(sim):
    """F, then G (reads F's output in place), a view of G's output held across the next F call;
    G's weight is reassigned six times, 40 steps apart: each time G is captured anew after F,
    which blocks F again. Each recapture of F was followed by many replays (it worked), so F is
    captured again each time, and replays in the end; before, the fifth blocked F ran eagerly
    for the callable's life (HF Llama's apply_rotary_pos_emb in the differential, a piecewise
    function piece, after the fourth signature or parameter change: 1.05x eager)."""
    torch.manual_seed(0)
    rf, gf = _twin(nn.Linear(8, 8))
    rg, gg = _twin(nn.Linear(8, 8))
    with cg.graph_region():
        v = rv = None
        for t in range(240):
            if t % 40 == 20:
                w = torch.randn(8, 8)
                rg.weight = nn.Parameter(w.clone())
                gg.weight = nn.Parameter(w.clone())
            if t == 230:  # (after the last reassignment and its recapture)
                before = cg.stats(gf)
            x = torch.randn(4, 8)
            a, ra = gf(x), rf(x)
            b, rb = gg(a), rg(ra)
            assert torch.equal(a, ra) and torch.equal(b, rb), t
            if v is not None:
                assert torch.equal(v, rv), t
            v, rv = b[:2], rb[:2]  # the view held across the next F call
            del a, b
    after = cg.stats(gf)
    assert gf._cudagraphify_state._recaptures == 7, after
    assert after.captures == 8, after  # (the first, its recapture, one after each reassignment)
    assert after.replays - before.replays == 10, (before, after)  # (the last 10 steps)
    assert sum(after.eager_calls.values()) == sum(before.eager_calls.values()), after


def test_control_recaptures_are_bounded_when_two_graphs_block_each_other(sim):
    """Ping-pong: a view of G's output is held across F's call and a view of F's across G's:
    each recapture puts one after the other, and the other is then blocked. At most
    _MAX_RECAPTURES per callable, then eager (as before c6fd56d); values as eager's."""
    torch.manual_seed(0)
    rf, gf = _twin(nn.Linear(8, 8))
    rg, gg = _twin(nn.Linear(8, 8))
    with cg.graph_region():
        vb = rvb = None
        for t in range(24):
            x, y = torch.randn(4, 8), torch.randn(4, 8)
            a, ra = gf(x), rf(x)
            if vb is not None:
                assert torch.equal(vb, rvb), t
            va, rva = a[:1], ra[:1]
            del vb, a
            b, rb = gg(y), rg(y)
            assert torch.equal(b, rb) and torch.equal(va, rva), t
            vb, rvb = b[:1], rb[:1]
            del va, b
    for m in (gf, gg):
        st = m._cudagraphify_state
        assert st._recaptures <= _engine._MAX_RECAPTURES
        assert cg.stats(m).captures <= 1 + _engine._MAX_RECAPTURES, cg.stats(m)


def test_control_recapture_while_the_caller_holds_its_own_output_and_a_view(sim):
    """F is released while the caller holds F's own output (moved to a copy) and a view of
    it (its memory kept protected): both keep eager's values through later replays."""
    torch.manual_seed(0)
    rf, gf = _twin(nn.Linear(8, 8))
    rg, gg = _twin(nn.Linear(8, 8))
    with cg.graph_region():
        x = torch.randn(4, 8)
        a0, ra0 = gf(x), rf(x)
        b0, rb0 = gg(a0), rg(ra0)
        vb, rvb = b0[:2], rb0[:2]  # blocks F (captured before G)
        del b0
        a1, ra1 = gf(x + 1), rf(x + 1)  # F blocked by G's view: released; a0 moved to a copy
        assert torch.equal(a1, ra1)
        va0, rva0 = a0[1:], ra0[1:]
        for t in range(6):
            y = torch.randn(4, 8)
            a, ra = gf(y), rf(y)
            b, rb = gg(a), rg(ra)
            assert torch.equal(a, ra) and torch.equal(b, rb), t
            for got, want in ((a0, ra0), (va0, rva0), (vb, rvb), (a1, ra1)):
                assert torch.equal(got, want), t
            del a, b
    assert gf._cudagraphify_state._recaptures == 1


def test_control_no_recapture_in_grad_mode_or_with_copied_outputs(sim):
    torch.manual_seed(0)
    rf, gf = _twin(nn.Linear(8, 8))
    rg, gg = _twin(nn.Linear(8, 8))
    with torch.enable_grad(), cg.graph_region():  # training graphs: never chained
        for _ in range(4):
            x = torch.randn(4, 8)
            v = gg(gf(x))[:2]
            assert torch.equal(v, rg(rf(x))[:2])
    with cg.graph_region(chain=False):  # outputs copied: nothing to block
        for _ in range(4):
            x = torch.randn(4, 8)
            v = gg(gf(x))[:2]
            assert torch.equal(v, rg(rf(x))[:2])
    assert gf._cudagraphify_state._recaptures == 0


def test_control_hf_head_reading_a_view_of_the_norm_with_a_dynamic_cache(sim):
    """Llama decode with a DynamicCache (the opaque plan c6fd56d was made for): the head is
    captured again after the norm, then replays; logits as eager's."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=128,
                                      pad_token_id=0)
    ref = transformers.LlamaForCausalLM(config).eval()
    g = cg.graphify(copy.deepcopy(ref))
    for n in range(2):
        rc, c = DynamicCache(config=config), DynamicCache(config=config)
        x = torch.randint(1, 64, (1, 4), generator=torch.Generator().manual_seed(n))
        for t in range(6):
            want = ref(x, past_key_values=rc, use_cache=True).logits
            got = g(x, past_key_values=c, use_cache=True).logits
            assert torch.equal(got, want), (n, t)
            x = want[:, -1:].argmax(-1)
    head = cg.stats(g.lm_head)
    assert head.replays >= 6, head
    assert g.lm_head._cudagraphify_state._recaptures <= _engine._MAX_RECAPTURES
