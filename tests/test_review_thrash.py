"""Review: the eviction-thrash rule and kind demotions (commits d21c591 and 99043f9).

- d21c591: ``GraphCache.thrashing(key)`` (cudagraphify/_cache.py): a key whose graph was
  evicted ``THRASH_EVICTIONS`` = 2 times gets an ``EagerEntry`` in ``_engine._call`` and runs
  eagerly from then on; ``_MAX_RECAPTURES`` lowered from 8 to 2 (c6fd56d's recapture of a
  region graph blocked by a later-captured graph's held output).
- 99043f9: ``_state.kind_of``, ``GraphedState.demoted_kinds`` and ``_demote_known``: once a
  callable's forward changed the Python state of two static caches of one kind, a new cache
  of that kind passed to it is demoted (an opaque object) before its first call.

CPU, simulated backend (fixture ``sim``): every output is compared BITWISE (``torch.equal``)
with an eager twin (``copy.deepcopy`` before ``cg.graphify``). No wrong value was found: every
finding below is about speed (signatures kept eager for good where graphs would fit and replay,
or captures that never replay), one about a misleading reason.

``test_finding_*``: each failed on the code reviewed (HEAD 0a9ee33, which has helper-44's
demotion fixes on top of the two commits); all pass since: an eviction counts towards thrash
only where the graph was used fewer than ``THRASH_USES`` times, no eager entry is stored for a
thrashing key, the counts are forgotten when the cache is cleared or a shared cache's owner is
gone, the reason names the cache's own ``max_graphs``, ``_MAX_RECAPTURES`` is 4, and the kind
rule (99043f9) was withdrawn. The numbers quoted in their docstrings
as "before" were measured with the new rule switched off (``_cache.THRASH_EVICTIONS`` or
``_engine._KIND_DEMOTIONS`` set to 10**9, ``_engine._MAX_RECAPTURES`` back to 8): each test
then passes.
``test_control_*``: scenarios checked and found correct (they pass).
GPU reproductions: .ci/review/thrash/.
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

from test_opaque_plan import _Cache as _OpaqueCache, _Inner
from test_static_state import Cache, Net, StaticCache, StaticLayer


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            yield


THRASH = "evicted 2 times before"


def _counts(g):
    s = cg.stats(g)
    return s.captures, s.replays, sum(s.eager_calls.values())


def _delta(g, before):
    return tuple(a - b for a, b in zip(_counts(g), before))


def _linear(**options):
    torch.manual_seed(0)
    ref = nn.Linear(8, 8)
    return ref, cg.graphify(copy.deepcopy(ref), **options)


def _run(ref, g, sizes, rounds=1):
    for _ in range(rounds):
        for n in sizes:
            x = torch.randn(n, 8)
            assert torch.equal(g(x), ref(x)), n


class Scaled(nn.Module):
    """A Python attribute read by forward: each value is a variant of one key (module state)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = 1.0

    def forward(self, x):
        return self.lin(x) * self.scale


# -- findings: d21c591, the thrash rule ------------------------------------------------------------

def test_finding_phases_that_each_fit_max_graphs_end_eager_for_good(sim):
    """Sizes {1,2,3} and {4,5,6} in turn, 300 calls a phase, max_graphs=4: each phase's
    working set fits. Every switch evicts graphs that replayed ~100 times each (no thrash: LRU
    at its best), but each eviction counts; after four phases sizes 1 and 2 are "thrashing"
    and run eagerly for the rest of the callable's life: from phase 5 on every {1,2,3} phase
    is 200 eager calls and 100 replays, although 3 graphs fit in 4 (before: 3 captures and 297
    replays per phase, forever). A training loop's train and validation buckets, a server's
    day and night shapes, are such phases."""
    ref, g = _linear(max_graphs=4)
    for phase in range(7):
        before = _counts(g)
        _run(ref, g, [1, 2, 3] if phase % 2 == 0 else [4, 5, 6], rounds=100)
        captures, replays, eager = _delta(g, before)
    assert eager == 0 and replays >= 290, (captures, replays, eager, cg.stats(g).eager_calls)


def test_finding_a_thrash_decision_shadows_the_graphs_kept_for_other_variants(sim):
    """One input signature under three values of a module attribute (three variants of one
    key, see GraphCache), max_graphs=2, 50 calls per value in turn. The key's variants evict
    each other, the key is "thrashing", and ``cache.put(key, EagerEntry(reason, self))`` (no
    state, no flags: it fits every variant) becomes the most recently used entry of the key:
    from the second round every call runs eagerly, while the cache still holds two graphs that
    fit their calls (0 replays of 150 calls a round; README: "the graphs kept go on
    replaying"). Before: 3 captures and 147 replays a round."""
    torch.manual_seed(0)
    ref = Scaled()
    g = cg.graphify(copy.deepcopy(ref), max_graphs=2)
    for _ in range(3):
        before = _counts(g)
        for v in range(3):
            ref.scale = g.scale = float(v + 1)
            for _ in range(50):
                x = torch.randn(4, 8)
                assert torch.equal(g(x), ref(x))
        captures, replays, eager = _delta(g, before)
    assert cg.stats(g).graphs == 2
    assert replays >= 50, (captures, replays, eager, cg.stats(g).eager_calls)


def test_finding_an_attribute_set_four_times_turns_every_size_eager_for_good(sim):
    """Default max_graphs=16, eight sizes, a Python attribute the forward reads set to a new
    value now and then (a temperature, a LoRA scale). Each value needs eight graphs (fit);
    the graphs of the values before are stale and LRU drops them, which counts as an eviction
    of each size's key. After the third change every key was "evicted twice": at the fourth
    every call runs eagerly for good (160 of 160 calls a value), with 16 stale graphs kept.
    Before: 8 captures and 152 replays per value (until max_evictions=64, at the ninth)."""
    torch.manual_seed(0)
    ref = Scaled()
    g = cg.graphify(copy.deepcopy(ref))
    for change in range(5):
        ref.scale = g.scale = 1.0 + change / 8
        before = _counts(g)
        for _ in range(20):
            for n in range(1, 9):
                x = torch.randn(n, 8)
                assert torch.equal(g(x), ref(x))
        captures, replays, eager = _delta(g, before)
    assert replays >= 150, (change, captures, replays, eager, cg.stats(g).eager_calls)


def test_finding_thrash_marks_survive_an_invalidation_and_refuse_capture_sizes(sim):
    """Six sizes through max_graphs=4 (the commit's own case) mark sizes 1 and 2. The model is
    then reloaded (``load_state_dict(assign=True)``: new parameter memory, so every graph and
    every eager decision is dropped) and the server warms up again for the sizes it will now
    serve, four, with ``cg.capture_sizes`` (which refuses more sizes than max_graphs, and
    exempts them from the storm guard). Sizes 1 and 2 come back eager ("its graph was evicted
    2 times ... raise max_graphs"), and stay so: half the calls of a working set that fits run
    eagerly for good. Before: all four graphed, every later call replays."""
    ref, g = _linear(max_graphs=4)
    _run(ref, g, range(1, 7), rounds=3)
    g.load_state_dict({k: v.clone() for k, v in ref.state_dict().items()}, assign=True)
    done = cg.capture_sizes(g, lambda n: torch.randn(n, 8), [1, 2, 3, 4], progress=False)
    before = _counts(g)
    _run(ref, g, [1, 2, 3, 4], rounds=25)
    captures, replays, eager = _delta(g, before)
    assert cg.stats(g).invalidations == 1
    assert not done.eager and eager == 0, (dict(done.eager), captures, replays, eager)


def test_finding_a_shared_policy_hands_thrash_marks_to_the_next_module(sim):
    """``CachePolicy(shared=True, max_graphs=2)``: module A cycles three sizes (size 1
    thrashes), then A is deleted (its graphs are orphaned and dropped) and module C (another
    model: the user reloaded it) is graphified with the same policy and serves two sizes.
    Size 1 runs eagerly for every call of C (20 of 40), with "raise max_graphs to graph it":
    the marks are keyed by signature in the policy's one cache, whoever made them. Before:
    2 captures, 38 replays."""
    policy = cg.CachePolicy(max_graphs=2, shared=True)
    torch.manual_seed(0)
    a_ref = nn.Linear(8, 8)
    a = cg.graphify(copy.deepcopy(a_ref), cache_policy=policy)
    _run(a_ref, a, [1, 2, 3], rounds=3)
    del a
    gc.collect()
    c_ref = nn.Linear(8, 8)
    c = cg.graphify(copy.deepcopy(c_ref), cache_policy=policy)
    _run(c_ref, c, [1, 2], rounds=20)
    assert not any(THRASH in r for r in cg.stats(c).eager_calls), cg.stats(c).eager_calls


def test_finding_the_thrash_reason_names_the_wrong_max_graphs_in_a_region(sim):
    """A region's cache bounds a callable's graphs by the region's ``max_graphs``
    (_region.cache_for copies the policy with it); the reason is built from
    ``self.policy.max_graphs`` (the callable's own, 16 here): "more distinct signatures come
    round than max_graphs=16 holds ... (raise max_graphs to graph it)" for three sizes. (Low:
    a misleading diagnostic; the values are right.)"""
    ref, g = _linear()
    with cg.graph_region(max_graphs=2):
        _run(ref, g, [1, 2, 3], rounds=4)
    reasons = [r for r in cg.stats(g).eager_calls if THRASH in r]
    assert reasons and all("max_graphs=2 " in r for r in reasons), reasons


class _Wrap(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, cache):
        return self.inner(x, cache)


class _Top(nn.Module):
    """tests/test_opaque_plan.py's _Top (a head reading a view of a final norm's output, the
    norm inside an opaque model) with the norm two wrappers deeper."""

    def __init__(self):
        super().__init__()
        self.inner = _Wrap(_Wrap(_Inner()))
        self.head = nn.Linear(8, 5)

    def forward(self, x, cache):
        return self.head(self.inner(x, cache)[:, -1:, :])


def test_finding_two_recaptures_leave_a_nested_heads_third_signature_eager(sim):
    """(Low; synthetic nesting.) Each plan level delays its pieces' captures by a call, so the
    head (in the root's plan) is captured for batch sizes 1, 2 and 3 before the norm (three
    plans down), whose later captures then block each of the head's graphs (c6fd56d): each
    needs one recapture. With the limit lowered from 8 to 2, the third stays blocked: a third
    of the head's calls (30 of 90) run eagerly for good; with 8: 3 eager calls in all. HF
    models put the final norm one or two plans below the head (Llama, Llava), which 2 covers;
    a third level (a wrapper's wrapper around the language model) does not."""
    torch.manual_seed(0)
    ref = _Top().eval()
    g = cg.graphify(copy.deepcopy(ref))
    caches = {b: (_OpaqueCache(), _OpaqueCache()) for b in (1, 2, 3)}
    for t in range(45):
        b = t % 3 + 1
        rc, c = caches[b]
        x = torch.randn(b, 1, 8)
        assert torch.equal(g(x, c), ref(x, rc)), t
    head = cg.stats(g.head)
    # (three blocked calls per signature)
    assert sum(head.eager_calls.values()) <= 9, (head.eager_calls, head.replays)


# -- findings: 99043f9, kinds --------------------------------------------------------------------

def _qwen2_sliding():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=4,
        max_window_layers=1, pad_token_id=0, max_position_embeddings=256)
    ref = transformers.Qwen2ForCausalLM(config).eval()
    ref.generation_config.pad_token_id = 0
    return ref, config


_GEN = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True)


def _same_generate(a, b) -> bool:
    return torch.equal(a.sequences, b.sequences) and len(a.logits) == len(b.logits) and all(
        torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def _generate(ref, g, ids, what):
    want = ref.generate(ids, cache_implementation="static", disable_compile=True, **_GEN)
    got = g.generate(ids, cache_implementation="static", **_GEN)
    assert _same_generate(got, want), what


def _all_counts(g):
    """Captures, replays and eager calls of g and of every piece graphified under it."""
    states = [m.__dict__.get("_cudagraphify_state") for m in g.modules()]
    states = [s for s in states if s is not None]
    return (sum(s.captures for s in states), sum(s.replays for s in states),
            sum(sum(s.eager_calls.values()) for s in states))


def test_finding_kind_demoted_prefills_capture_every_new_prompt_length(sim):
    """HF Qwen2 with a sliding-window layer (StaticSlidingWindowLayer bumps a Python int on
    every update), ``generate(cache_implementation="static")`` with a new prompt length per
    request (as a server sees). From the third generate the new cache is demoted before its
    first call, so its prefill (before: the cache's set-up call, run eagerly) runs eagerly
    around the cache with the plan's pieces, and each piece captures the prompt's shape: 18
    captures in every generate here (2 layers), none ever replayed; the storm guard never
    fires, since the pieces' decode graphs replay in between. Before 99043f9: 0 captures a
    generate from the fourth on. On a GPU each capture is a warm-up, a capture and an
    instantiation per piece (a 32-layer model has ~200 pieces).
    And the pieces' LRU evicts those graphs: once ``max_evictions`` (64) is spent in a
    piece's cache, every new signature of it runs eagerly for good. Measured (8 new tokens a
    generate, 100 prompt lengths, then four generates of a batch of two): 18 captures in
    each generate from the third to the 81st, then batch 2 made 0 captures and 0 replays in
    the pieces (672 eager piece calls); with the rule off: 0 captures a generate after the
    first, and batch 2 made 36 captures and 385 replays (77 eager). CPU double: 56.7 s
    against 38.8 s. GPU: .ci/review/thrash/b_kind_prefill.py."""
    ref, _ = _qwen2_sliding()
    g = cg.graphify(copy.deepcopy(ref))
    per_generate = []
    for n in range(7):
        before = _all_counts(g)
        _generate(ref, g, torch.randint(1, 64, (1, 2 + n)), f"prompt {2 + n}")
        per_generate.append(_delta_all(g, before)[0])
    assert sum(per_generate[4:]) < 18, per_generate  # (three generates)


def _delta_all(g, before):
    return tuple(a - b for a, b in zip(_all_counts(g), before))


# -- controls: the thrash rule -----------------------------------------------------------------

def test_control_the_commits_cycle_is_bitwise_and_keeps_its_graphs_replaying(sim):
    ref, g = _linear(max_graphs=4)
    _run(ref, g, range(1, 7), rounds=40)
    s = cg.stats(g)
    assert s.captures <= 12 and s.replays >= 150 and s.graphs == 4, s
    assert s.evictions <= 8 and not any("more than" in r for r in s.eager_calls)


def test_control_discards_are_not_evictions(sim):
    """Invalidations (parameters moved, ten times), ungraphify and graphify again, and graphs
    keyed to a static cache that died: none counts toward thrash."""
    ref, g = _linear(max_graphs=4)
    for k in range(10):
        _run(ref, g, [1, 2, 3], rounds=2)
        g.load_state_dict({n: v.clone() for n, v in ref.state_dict().items()}, assign=True)
    assert cg.stats(g).invalidations >= 9
    assert not any(THRASH in r for r in cg.stats(g).eager_calls), cg.stats(g).eager_calls
    # ungraphify, graphify again: a new state and cache
    ref2, g2 = _linear(max_graphs=2)
    _run(ref2, g2, [1, 2, 3], rounds=3)
    assert any(THRASH in r for r in cg.stats(g2).eager_calls)
    cg.ungraphify(g2)
    cg.graphify(g2, max_graphs=2)
    _run(ref2, g2, [1, 2], rounds=5)
    assert not any(THRASH in r for r in cg.stats(g2).eager_calls) and cg.stats(g2).replays >= 8
    # static caches that die: their graphs are discarded, not evicted
    torch.manual_seed(0)
    net = Net()
    gn = cg.graphify(copy.deepcopy(net), max_graphs=2)
    for seq in range(6):
        rc, c = StaticCache(), StaticCache()
        for t in range(3):
            x, pos = torch.randn(1, 1, 16), torch.tensor([t])
            assert torch.equal(gn(x, c, pos), net(x, rc, pos)), (seq, t)
        del rc, c
        gc.collect()
    assert not any(THRASH in r for r in cg.stats(gn).eager_calls), cg.stats(gn).eager_calls


def test_control_region_caches_start_fresh_and_stay_bitwise(sim):
    ref, g = _linear()
    for _ in range(2):
        with cg.graph_region(max_graphs=2):
            for _ in range(4):
                for n in (1, 2, 3):
                    x = torch.randn(n, 8)
                    y = g(x)
                    assert torch.equal(y.clone(), ref(x)), n
    # the second region thrashed as the first did: its marks were its own cache's
    thrash = sum(v for r, v in cg.stats(g).eager_calls.items() if THRASH in r)
    assert thrash == 4, cg.stats(g).eager_calls  # two per region


def test_control_share_graph_and_train_eval_variants_under_thrash_are_bitwise(sim):
    torch.manual_seed(0)
    ref = nn.Sequential(*[nn.Linear(8, 8) for _ in range(2)])
    m = copy.deepcopy(ref)
    cg.share_graph(m, max_graphs=2)
    _run(ref, m, [1, 2, 3], rounds=4)
    assert all(cg.stats(layer).replays > 0 for layer in m)
    torch.manual_seed(0)
    ref2 = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.0), nn.BatchNorm1d(8))
    g2 = cg.graphify(copy.deepcopy(ref2), max_graphs=2)
    for r in range(12):
        for mod in (ref2, g2):
            mod.train(r % 2 == 0)
        _run(ref2, g2, [2, 3], rounds=2)
        assert torch.equal(ref2[2].running_mean, g2[2].running_mean), r


def test_control_storm_then_thrash_then_capture_sizes(sim):
    """A storm (a new size every call), then a cycle longer than max_graphs (thrash), then
    capture_sizes of sizes never evicted: the storm ends, thrash keeps the graphs replaying,
    and capture_sizes graphs what was never marked; every value bitwise."""
    ref, g = _linear(max_graphs=8)
    _run(ref, g, range(20, 60))
    s = cg.stats(g)
    assert any("a new signature on every call" in r for r in s.eager_calls), s.eager_calls
    _run(ref, g, range(1, 11), rounds=5)
    before = _counts(g)
    _run(ref, g, range(1, 11), rounds=5)  # 10 sizes through 8 graphs: settled
    captures, replays, eager = _delta(g, before)
    assert captures == 0 and replays >= 35, (captures, replays, eager, cg.stats(g).eager_calls)
    done = cg.capture_sizes(g, lambda n: torch.randn(n, 8), [64, 65], progress=False)
    assert done.graphed == [65, 64], dict(done.eager)
    _run(ref, g, [64, 65], rounds=3)


def test_control_max_evictions_is_spared_and_threads_agree(sim):
    """The cycle no longer spends max_evictions; two threads cycling sizes through one callable
    get their own results bitwise."""
    ref, g = _linear(cache_policy=cg.CachePolicy(max_graphs=3, max_evictions=10))
    _run(ref, g, range(1, 6), rounds=30)
    assert cg.stats(g).evictions <= 10 and not any("more than 10" in r for r in
                                                   cg.stats(g).eager_calls)
    errors = []

    def worker(seed):
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _ in range(30):
                for n in (1, 2, 3, 4, 5):
                    x = torch.randn(n, 8, generator=gen)
                    if not torch.equal(g(x), ref(x)):
                        errors.append(n)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


# -- controls: kinds ---------------------------------------------------------------------------

class SlidingLayer(StaticLayer):
    """A layer whose updates count tokens in a Python int (HF's StaticSlidingWindowLayer)."""

    def update(self, k, pos):
        self.seen = getattr(self, "seen", 0) + k.shape[1]
        return super().update(k, pos)


def _cache(layer=StaticLayer, n=2):
    return Cache([layer(6) for _ in range(n)])


def _steps(ref, g, rc, c, steps=3):
    for t in range(steps):
        x, pos = torch.randn(1, 1, 16), torch.tensor([t])
        assert torch.equal(g(x, c, pos), ref(x, rc, pos)), t
        for a, b in zip(rc.layers, c.layers):
            assert torch.equal(a.keys, b.keys), t


def test_control_hf_sliding_generates_with_new_prompt_lengths_are_bitwise(sim):
    """The values of the finding above: every generate bitwise as eager's (the kind rule was
    withdrawn: each generate's new cache is set up by its own prefill)."""
    ref, _ = _qwen2_sliding()
    g = cg.graphify(copy.deepcopy(ref))
    for n in range(4):
        _generate(ref, g, torch.randint(1, 64, (1, 3 + n)), n)
    s = cg.stats(g)
    assert sum(v for r, v in s.eager_calls.items() if "sets up" in r) == 4, s.eager_calls
