"""Review of 1405f39, 77d414e and c5bfd67 (unkeyable static caches demoted to opaque objects;
per-object guards of the first call, ``changed_again`` and unremembered side-effect calls, the
replay's stream ordering; ``entry.uses`` thrash accounting, ``thrashing_now``, recapture after
``_BLOCKED_CALLS`` blocked calls in a row).

CPU, simulated backend (fixture ``sim``); every output is compared bitwise (``torch.equal``)
with an eager twin (``copy.deepcopy`` before ``cg.graphify``).

``test_finding_*``: failed on the code reviewed, each a silent speed regression (values stay
eager's). F1 and F2's minimal case are fixed (uses pending in the owner's fast path are counted
at the eviction; the blocked streak counts this graph's uses, not the callable's replays); F2
on T5, where the one signature replays and is blocked in turn, is fixed since: blocked calls
count towards a recapture when at most one use of the graph came between them (on one thread):

* F1 ``entry.uses`` misses fast-path replays when another callable of a shared cache evicts
  the graph: ``Fast.base`` is settled only at the *owner's* next slow-path call, so a graph
  replayed 49 times counts as "evicted before it was used 4 times", and after two such phases
  the owner's signature runs eagerly for good ("thrashing").
* F2 "three blocked calls in a row" is measured as "no replay of this callable between": a
  callable called twice per step (T5's shared ``decoder.dropout``, a norm or activation module
  reused) replays its other signature between every two blocked calls, so the streak never
  reaches ``_BLOCKED_CALLS`` and the blocked graph runs eagerly forever (before c5bfd67: one
  blocked call, then one recapture, then replays).

``test_control_*``: scenarios checked and found correct (they pass).
"""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _state
from cudagraphify._fast import Fast

from test_static_state import DeepCache, Net, StaticCache, StaticLayer, _decode, _pair


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            yield


THRASH = "evicted 2 times before"
VIEW = "still referenced through a view"


def _twin(m):
    return m, cg.graphify(copy.deepcopy(m))


def _run(ref, g, sizes, rounds=1):
    for _ in range(rounds):
        for n in sizes:
            x = torch.randn(n, 8)
            assert torch.equal(g(x), ref(x)), n


# -- F1: fast-path replays uncounted when another callable evicts -----------------------------

def _shared_phases():
    """Shared policy, max_graphs=2: A serves size 1 for 50 calls (1 capture, ~49 replays, most
    through the fast path), then B serves sizes 2 and 3 for 50 rounds (evicting A's graph),
    four times over. Returns A's stats."""
    policy = cg.CachePolicy(max_graphs=2, shared=True)
    torch.manual_seed(0)
    a_ref, b_ref = nn.Linear(8, 8), nn.Linear(8, 8)
    a = cg.graphify(copy.deepcopy(a_ref), cache_policy=policy)
    b = cg.graphify(copy.deepcopy(b_ref), cache_policy=policy)
    for _ in range(4):
        _run(a_ref, a, [1], rounds=50)
        _run(b_ref, b, [2, 3], rounds=50)
    return cg.stats(a)


def test_finding_fast_path_replays_uncounted_when_a_shared_cache_evicts(sim):
    s = _shared_phases()
    assert not any(THRASH in r for r in s.eager_calls), dict(s.eager_calls)


def test_control_the_same_phases_on_the_slow_path_never_thrash(sim, monkeypatch):
    """F1's phases with no fast path: every replay counted, no thrash, no eager call."""
    monkeypatch.setattr(Fast, "make", staticmethod(lambda *a, **k: None))
    s = _shared_phases()
    assert not s.eager_calls, dict(s.eager_calls)


def test_control_a_single_callables_phases_count_their_fast_replays(sim):
    """One callable, max_graphs=2, phases {1,2} / {3,4} of 50 rounds: its own slow-path call
    settles the fast path's replays before its capture evicts: no thrash."""
    torch.manual_seed(0)
    ref, g = _twin(nn.Linear(8, 8))
    g = cg.graphify(copy.deepcopy(ref), max_graphs=2)
    for phase in range(6):
        _run(ref, g, [1, 2] if phase % 2 == 0 else [3, 4], rounds=25)
    assert not any(THRASH in r for r in cg.stats(g).eager_calls), cg.stats(g).eager_calls


# -- F2: a callable called twice per step is never "blocked in a row" ---------------------------

def _twice_per_step(steps: int):
    """In a user's region: F(x), G(F's output), F(w) (another signature, captured after G);
    the caller keeps a view of G's output across the next step, which blocks F(x)'s graph
    (captured before G). Values checked against eager's; returns F's eager calls blocked by
    the view and its recaptures."""
    torch.manual_seed(0)
    rf, gf = _twin(nn.Linear(8, 8))
    rg, gg = _twin(nn.Linear(8, 8))
    kept = []
    with cg.graph_region():
        v = rv = None
        for t in range(steps):
            x, w = torch.randn(4, 8), torch.randn(2, 8)
            a, ra = gf(x), rf(x)
            b, rb = gg(a), rg(ra)
            c, rc = gf(w), rf(w)
            assert torch.equal(a, ra) and torch.equal(b, rb) and torch.equal(c, rc), t
            if v is not None:
                assert torch.equal(v, rv), t
                kept.append((v, rv))
            v, rv = b[:2], rb[:2]
            del a, b, c
            for got, want in kept[-3:]:
                assert torch.equal(got, want), t
    blocked = sum(n for r, n in cg.stats(gf).eager_calls.items() if VIEW in r)
    return blocked, gf._cudagraphify_state._recaptures


def test_finding_a_callable_called_twice_per_step_stays_blocked_forever(sim):
    blocked, recaptures = _twice_per_step(40)
    assert recaptures == 1 and blocked <= 3, (blocked, recaptures)  # (_BLOCKED_CALLS)


def test_finding_one_signature_twice_per_step_replays_and_is_blocked_in_turn(sim):
    """T5's pattern without transformers: F(x), G, F(G's output) with F's one signature, H;
    the caller keeps a view of H's output (H captured after F) until F's first call of the
    next step. F's graph is blocked on that call and replays on the second, every step: with
    "blocked calls in a row" it never came to a recapture (39 blocked calls of 40 steps)."""
    torch.manual_seed(0)
    (rf, gf), (rg, gg), (rh, gh) = (_twin(nn.Linear(8, 8)) for _ in range(3))
    with cg.graph_region():
        v = rv = None
        for t in range(40):
            x = torch.randn(4, 8)
            a, ra = gf(x), rf(x)
            if v is not None:
                assert torch.equal(v, rv), t
            v = rv = None  # (let go between F's two calls)
            b, rb = gg(a), rg(ra)
            c, rc = gf(b), rf(rb)
            d, rd = gh(c), rh(rc)
            assert all(torch.equal(p, q) for p, q in ((a, ra), (b, rb), (c, rc), (d, rd))), t
            v, rv = d[:2], rd[:2]
            del a, b, c, d
    blocked = sum(n for r, n in cg.stats(gf).eager_calls.items() if VIEW in r)
    assert gf._cudagraphify_state._recaptures == 1 and blocked <= 3, blocked  # (_BLOCKED_CALLS)


def test_control_twice_per_step_values_are_eagers(sim):
    """F2's scenario, short: every value (the kept views too) as eager's."""
    _twice_per_step(8)


@pytest.fixture
def hf_static(monkeypatch):
    """transformers, with HF's static layer as on a GPU (test_review_hfcache's
    DevStaticLayer: its position counter keyed by address)."""
    transformers = pytest.importorskip("transformers")
    from test_review_hfcache import DevStaticLayer
    from transformers import cache_utils

    monkeypatch.setitem(cache_utils.STATIC_LAYER_TYPE_MAPPING, "full_attention", DevStaticLayer)
    return transformers


def _static_generates(model, lengths, new_tokens):
    """``generate(cache_implementation="static")`` of an eager twin and of ``model``
    graphified, for a prompt of each length: tokens and logits bitwise; the graphified model."""
    ref = copy.deepcopy(model)
    g = cg.graphify(model)
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
               pad_token_id=0, output_logits=True, return_dict_in_generate=True,
               cache_implementation="static")
    for n in lengths:
        ids = torch.randint(4, 64, (1, n))
        a, b = ref.generate(ids, **gen), g.generate(ids, **gen)
        assert torch.equal(a.sequences, b.sequences)
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    return g


def test_finding_t5_decoder_dropout_is_blocked_on_every_step(sim, hf_static):
    """F2 on HF T5 (static cache): T5Stack calls its one decoder.dropout twice per step with
    one signature; its graph replayed on one call and was blocked on the other, so no three
    blocked calls came in a row and it was never captured again (before c5bfd67: one blocked
    call, a recapture); values stayed eager's."""
    torch.manual_seed(0)
    cfg = hf_static.T5Config(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                             num_decoder_layers=2, num_heads=2, pad_token_id=0,
                             decoder_start_token_id=0, eos_token_id=1)
    g = _static_generates(hf_static.T5ForConditionalGeneration(cfg).eval(), [5], 10)
    drop = g.decoder.dropout
    blocked = sum(n for r, n in cg.stats(drop).eager_calls.items() if VIEW in r)
    assert blocked <= 3 and drop._cudagraphify_state._recaptures >= 1, blocked


# -- controls: 1405f39, unkeyable static caches demoted to opaque objects ----------------------

class _WithExtra(Net):
    def forward(self, x, cache, pos, extra=None):
        return super().forward(x, cache, pos)


def test_control_unkeyable_cache_with_another_unkeyable_leaf_recurses_once(sim):
    """A DeepCache and a list holding a plain object (unkeyable too): the cache is demoted,
    _call recurses once, the opaque plan runs; a second DeepCache is demoted in its turn."""
    torch.manual_seed(0)
    ref = _WithExtra()
    g = cg.graphify(copy.deepcopy(ref))
    marker = [object()]
    for _ in range(2):
        rc, c = DeepCache(), DeepCache()
        for t in range(5):
            x, pos = torch.randn(1, 1, 16), torch.tensor([t])
            assert torch.equal(g(x, c, pos, extra=marker), ref(x, rc, pos, extra=marker)), t
            for a, b in zip(rc.layers, c.layers):
                assert torch.equal(a.keys, b.keys), t
        assert _state.demoted(c) is not None
    assert cg.stats(g).replays >= 3, cg.stats(g)


class _Helped(StaticCache):
    """Unkeyable (holds a module) until its first forward drops the module: keyable later."""

    def __init__(self):
        super().__init__()
        self.helper = nn.Linear(1, 1)


class _Dropping(Net):
    def forward(self, x, cache, pos):
        if getattr(cache, "helper", None) is not None:
            cache.helper = None
        return super().forward(x, cache, pos)


def test_control_a_cache_that_becomes_keyable_stays_opaque_and_exact(sim):
    torch.manual_seed(0)
    ref = _Dropping()
    g = cg.graphify(copy.deepcopy(ref))
    rc, c = _Helped(), _Helped()
    _decode(ref, g, rc, c, 6)
    assert _state.demoted(c) is not None and _state.demoted(rc) is None
    rc2, c2 = StaticCache(), StaticCache()  # a keyable one of the same family: graphed
    _decode(ref, g, rc2, c2, 6)
    assert _state.is_static_state(c2) and cg.stats(g).replays >= 3


class _SlotCacheBase:
    __slots__ = ("layers", "helper")

    def __init__(self, layers):
        self.layers = layers
        self.helper = nn.Linear(1, 1)

    is_compileable = True


_SlotCache = type("Cache", (_SlotCacheBase,), {"__slots__": (),
                                               "__module__": "transformers.cache_utils"})


def test_control_unkeyable_cache_without_weak_references_runs_eagerly_without_recursion(sim):
    """No weak reference: demote cannot mark it; no endless recursion, every call eager and
    exact."""
    ref, g = _pair()
    rc, c = _SlotCache([StaticLayer(6) for _ in range(2)]), \
        _SlotCache([StaticLayer(6) for _ in range(2)])
    assert _state.is_static_state(c)
    _decode(ref, g, rc, c, 5)
    assert _state.is_static_state(c) and cg.stats(g).captures == 0


def test_control_threads_each_with_its_own_unkeyable_cache(sim):
    torch.manual_seed(0)
    ref = Net()
    g = cg.graphify(copy.deepcopy(ref))
    errors = []

    def work(seed):
        try:
            gen = torch.Generator().manual_seed(seed)
            rc, c = DeepCache(), DeepCache()
            for t in range(6):
                x, pos = torch.randn(1, 1, 16, generator=gen), torch.tensor([t])
                got, want = g(x, c, pos), ref(x, rc, pos)
                if not torch.equal(got, want):
                    errors.append((seed, t))
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    with torch.no_grad():
        threads = [threading.Thread(target=work, args=(s,)) for s in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert not errors, errors


# -- controls: 77d414e, per-object guards and changed_again -----------------------------------

class _FlagOnce(Net):
    """Sets a flag on the cache on its first call only (after the set-up)."""

    def forward(self, x, cache, pos):
        out = super().forward(x, cache, pos)
        if pos.item() == 1 and not getattr(cache, "warm", False):
            cache.warm = True
        return out


class _Counter:
    def __init__(self):
        self.n = 0


class _TwoObjects(Net):
    """Changes a static_argnames object on every call and a cache's Python state once."""

    def forward(self, x, cache, pos, counter=None):
        counter.n += 1
        return super().forward(x, cache, pos) + counter.n


def test_control_a_flag_set_once_keeps_the_cache_graphed(sim):
    torch.manual_seed(0)
    ref = _FlagOnce()
    g = cg.graphify(copy.deepcopy(ref))
    rc, c = StaticCache(), StaticCache()
    _decode(ref, g, rc, c, 6)
    assert _state.demoted(c) is None and getattr(c, "warm", False)
    assert cg.stats(g).replays >= 2, cg.stats(g)


def test_control_a_changing_static_argnames_object_next_to_a_cache_set_up(sim):
    torch.manual_seed(0)
    ref = _TwoObjects()
    g = cg.graphify(copy.deepcopy(ref), static_argnames=("counter",))
    rk, k = _Counter(), _Counter()
    for _ in range(2):
        rc, c = StaticCache(), StaticCache()
        for t in range(5):
            x, pos = torch.randn(1, 1, 16), torch.tensor([t])
            assert torch.equal(g(x, c, pos, counter=k), ref(x, rc, pos, counter=rk)), t
            assert k.n == rk.n
            for a, b in zip(rc.layers, c.layers):
                assert torch.equal(a.keys, b.keys), t


# -- control: HF EncoderDecoderCache of static caches (BART), the commit's case ----------------

def test_control_bart_static_generate_is_bitwise(sim, hf_static):
    torch.manual_seed(0)
    cfg = hf_static.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0,
        decoder_start_token_id=2, bos_token_id=1, eos_token_id=3)
    g = _static_generates(hf_static.BartForConditionalGeneration(cfg).eval(), [4, 4], 5)
    s = cg.stats(g)
    assert s.replays > 0 and any("cannot be keyed" in r for r in s.eager_calls), s
