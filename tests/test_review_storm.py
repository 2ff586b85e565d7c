"""Review of the last commits: the signature storm (cudagraphify/_engine.py ``_storming``,
``expect_captures``), HF caches and objects passed as they are kept in every key
(_cache.py ``CachePolicy.full_key``, ``_engine._call``'s ``set_up``), and ``state_key``'s
4096 values (_state.py ``_MAX_ITEMS``, ``_Walk.same``'s ``ptrs_equal``, ``_memo``).

CPU, simulated backend (fixture ``sim``), eager twins compared bitwise. Tests named
``test_finding_*`` failed on the reviewed code (484590c; all four about speed, none a wrong
result) and pass since the commit after it: a signature met twice during a storm ends it
(distinct signatures counted), callables sharing one cache are left out, a storm starts only
after as many captures never replayed as the cache holds, and the walks' memo is bigger and,
when half full, least recently used first; ``test_control_*`` pass (checked, found correct).
"""

from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _engine, _state
from test_rebase import fam  # noqa: F401 (a fixture: families through the reading double)
from test_share_engine import reading  # noqa: F401 (a fixture: share_graph on the CPU)

STORM = "a new signature on every call"


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _linear():
    torch.manual_seed(0)
    ref = nn.Linear(8, 8)
    return ref, cg.graphify(copy.deepcopy(ref))


_REAL_LIMIT = _engine._fruitless_limit


@pytest.fixture(autouse=True)
def _limit_of_eight(monkeypatch):
    """(Since the fix of finding 3, a storm starts after ``max(_MAX_FRUITLESS, max_graphs)``
    captures never replayed; these tests were written for ``_MAX_FRUITLESS`` (8) alone, which
    they get here; the warm-up test puts the real limit back.)"""
    monkeypatch.setattr(_engine, "_fruitless_limit", lambda policy: _engine._MAX_FRUITLESS)


def _storm_calls(g) -> int:
    return sum(v for k, v in cg.stats(g).eager_calls.items() if k.startswith(STORM))


def _start_storm(g, ref, first: int = 1) -> None:
    """``_MAX_FRUITLESS + 2`` new batch sizes in a row: the storm is on."""
    for n in range(first, first + _engine._MAX_FRUITLESS + 2):
        x = torch.randn(n, 8)
        assert torch.equal(g(x), ref(x))
    assert _storm_calls(g) > 0


# -- findings (fail on the reviewed code) --------------------------------------------------------

def test_finding_a_signature_repeated_during_the_storm_is_never_captured(sim):
    """_engine._storming counts every cache miss as "a new signature", and a signature run
    eagerly by the storm is not remembered: a signature that then repeats on every call (a
    decode step after a phase of growing shapes, an evaluation loop after variable-length
    training) misses the cache each time and runs eagerly for all 64 storm calls (no graph
    of it exists, so none can replay and end the storm). Before the commit: one capture, then
    replays. The reason text ("a new signature on every call") is then false."""
    ref, g = _linear()
    with torch.no_grad():
        _start_storm(g, ref)
        captures, storm = cg.stats(g).captures, _storm_calls(g)
        for _ in range(30):  # one signature, 30 times
            x = torch.randn(100, 8)
            assert torch.equal(g(x), ref(x))
    s = cg.stats(g)
    assert s.captures == captures + 1 and _storm_calls(g) <= storm + 1, (
        f"30 calls of ONE signature during the storm: {s.captures - captures} captures, "
        f"{_storm_calls(g) - storm} run eagerly as 'a new signature on every call'")


def test_finding_graphs_another_module_replays_from_a_shared_cache_count_as_fruitless(sim):
    """CachePolicy(shared=True): module B replays the graphs module A captured, but the replay
    is counted on B (_engine._replay / _fast.Fast.call: ``self.replays``), and A's
    ``_storming`` compares A's own counter: every graph of A looks never replayed. Two
    interchangeable modules called on each input in turn (each graph replayed once right
    after its capture) storm after 8 sizes: A runs new sizes eagerly, B captures them."""
    torch.manual_seed(0)
    ref = nn.Linear(8, 8)
    policy = cg.CachePolicy(max_graphs=64, shared=True)
    a = cg.graphify(copy.deepcopy(ref), cache_policy=policy)
    b = cg.graphify(copy.deepcopy(ref), cache_policy=policy)
    with torch.no_grad():
        for n in range(1, 21):
            x = torch.randn(n, 8)
            assert torch.equal(a(x), ref(x)) and torch.equal(b(x), ref(x))
    sa, sb = cg.stats(a), cg.stats(b)
    assert _storm_calls(a) == 0 and _storm_calls(b) == 0, (
        f"every graph was replayed (by the other module) before the next new size, yet: A "
        f"{sa.captures} captures, {_storm_calls(a)} storm-eager; B {sb.captures} captures, "
        f"{sb.replays} replays, {_storm_calls(b)} storm-eager")


def test_finding_a_warm_up_loop_over_more_than_8_sizes_leaves_captures_for_serving(
        sim, monkeypatch):
    """A server warming a graphified model up by hand (one call per bucket size, as before
    capture_sizes existed, or as a vLLM-style loop does): only the first 8 sizes are captured
    (_engine._MAX_FRUITLESS), the others are captured later, on their first request while
    serving: the latency the warm-up was meant to take off the requests. Before the commit
    the warm-up captured all 12 sizes (max_graphs is 16: nothing is evicted)."""
    monkeypatch.setattr(_engine, "_fruitless_limit", _REAL_LIMIT)
    ref, g = _linear()
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256]
    with torch.no_grad():
        for n in sizes:  # the warm-up
            g(torch.randn(n, 8))
        warm = cg.stats(g).captures
        rnd = random.Random(0)
        for _ in range(100):  # serving
            x = torch.randn(rnd.choice(sizes), 8)
            assert torch.equal(g(x), ref(x))
    s = cg.stats(g)
    assert s.captures == warm, (f"warm-up captured {warm} of {len(sizes)} sizes; "
                                f"{s.captures - warm} captures while serving")


def test_finding_state_key_memo_thrashes_with_17_live_caches_used_in_turn(sim):
    """_state._memo keeps 16 walks, evicted first-in-first-out (a hit does not refresh it):
    17 live caches used in turn (a server's sequences, one StaticCache each) miss on every
    call, and every call walks the whole cache. With _MAX_ITEMS now 4096, a walk of an
    80-layer HF StaticCache costs ~1.2 ms on the CPU (a memo hit ~60 µs), paid by every
    replay (the fast path's _mixed_ok calls state_key)."""
    import test_review_static_state as S

    caches = [S._early_init(S.static_cache()) for _ in range(17)]
    _state._memo.clear()
    walks = [0]
    freeze = _state._Walk.freeze

    def counted(self, value):
        walks[0] += 1
        return freeze(self, value)

    _state._Walk.freeze = counted
    try:
        for _ in range(4):
            for c in caches:
                _state.state_key(c)
    finally:
        _state._Walk.freeze = freeze
    assert walks[0] <= len(caches) + 2, (
        f"{walks[0]} full walks for 4 rounds over 17 unchanged caches (every call walked)")


# -- controls (pass) ------------------------------------------------------------------------------

def test_control_the_storms_decision_is_not_remembered(sim):
    """Neither the cache nor the fast path keeps a storm's eager decision: after the storm a
    call of that very signature is captured."""
    ref, g = _linear()
    with torch.no_grad():
        _start_storm(g, ref)
        x = torch.randn(77, 8)
        storm = _storm_calls(g)
        assert torch.equal(g(x), ref(x)) and _storm_calls(g) == storm + 1
        state = g._cudagraphify_state
        assert state._fast is None
        assert all("new signature" not in why for _, why in state.decisions())
        g(torch.randn(1, 8))  # a graph replays: the storm ends at the next new signature
        captures = cg.stats(g).captures
        assert torch.equal(g(x), ref(x))
        assert cg.stats(g).captures == captures + 1


@pytest.mark.parametrize("path", ["fast", "slow"])
def test_control_replays_on_the_fast_and_the_slow_path_end_the_storm(sim, path):
    """Replays count on both paths (_fast.Fast.call, _engine._replay): a graph that replays
    during the storm ends it, and the next new signature is captured."""
    torch.manual_seed(0)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, scale=(1.0,)):
            return self.lin(x) * scale[0]

    ref = M()
    g = cg.graphify(copy.deepcopy(ref))
    # (a tuple argument: no fast path, every replay through _engine._replay)
    kw = {} if path == "fast" else {"scale": (2.0,)}
    with torch.no_grad():
        for n in range(1, _engine._MAX_FRUITLESS + 3):
            g(torch.randn(n, 8), **kw)
        assert _storm_calls(g) > 0
        g(torch.randn(60, 8), **kw)  # storm
        state = g._cudagraphify_state
        replays = cg.stats(g).replays
        for _ in range(2):
            x = torch.randn(3, 8)
            assert torch.equal(g(x, **kw), ref(x, **kw))
        assert (state._fast is not None) == (path == "fast")
        assert cg.stats(g).replays == replays + 2
        captures = cg.stats(g).captures
        g(torch.randn(61, 8), **kw)
        assert cg.stats(g).captures == captures + 1


def test_control_training_graphs_storm_and_recover(sim):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    g = cg.graphify(copy.deepcopy(ref))

    def step(m, n, seed):
        torch.manual_seed(seed)
        x = torch.randn(n, 8)
        m.zero_grad(set_to_none=True)
        out = m(x)
        out.square().mean().backward()
        return out.detach(), [p.grad.clone() for p in m.parameters()]

    sizes = list(range(1, 13)) + [3, 3, 12, 20, 3, 20, 20]
    for k, n in enumerate(sizes):
        (o1, g1), (o2, g2) = step(ref, n, k), step(g, n, k)
        assert torch.equal(o1, o2) and all(torch.equal(a, b) for a, b in zip(g1, g2)), (k, n)
    s = cg.stats(g)
    # (1-8 captured, 9-12 eager, 3 replays, 12 and 20 captured after the storm)
    assert s.captures == _engine._MAX_FRUITLESS + 2 and s.replays == 5, s


def test_control_region_graphs_count_their_replays(sim):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    model = copy.deepcopy(ref)
    cg.graphify(model[0])
    with torch.no_grad(), cg.graph_region():
        for n in list(range(1, 13)) + [2, 13, 14, 15]:
            for _ in range(2 if n > 12 else 1):
                x = torch.randn(n, 8)
                assert torch.equal(model(x), ref(x))
    s = cg.stats(model[0])
    assert s.captures == _engine._MAX_FRUITLESS + 3, s  # (13-15: captured once a replay ended it)


def test_control_piecewise_pieces_storm_on_their_own_and_capture_sizes_covers_them(sim):
    """A piecewise root's pieces capture on a root signature's second call (its first call
    warms up with the pieces plain): sizes called twice each storm the pieces (their graphs
    never replay), never the root (no graph of its own); capture_sizes calls each size three
    times, so the pieces' graphs replay and it needs no exemption for them."""
    import test_chain as C

    ref, g = C._pair()
    with torch.no_grad():
        for n in range(1, 15):
            for _ in range(2):
                x = torch.randn(n, 8)
                assert torch.equal(g(x), ref(x))
        assert _storm_calls(g.mlp) > 0 and not g._cudagraphify_state._storm_keys
        ref2, g2 = C._pair()
        cg.capture_sizes(g2, lambda n: torch.randn(n, 8), range(1, 15), progress=False)
        assert _storm_calls(g2.mlp) == 0 and cg.stats(g2.mlp).captures == 14
        for n in range(1, 15):
            x = torch.randn(n, 8)
            assert torch.equal(g2(x), ref2(x))
        assert cg.stats(g2.mlp).captures == 14


def test_control_share_graph_layers_storm_together_and_replay(reading):
    """share_graph: per new shape a template, a diffed layer and retargets (counted like
    captures by each layer's storm); 12 new shapes storm every layer alike, and shapes that
    come back replay (and end it), bitwise as eager."""
    import test_share_engine as E

    ref, model, group = E._shared_gpt(3)
    with torch.no_grad():
        for seq in list(range(2, 14)) + [2, 3, 2, 3, 20, 20]:
            x = torch.randn(1, seq, 32)
            torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    assert all(_storm_calls(b) == 4 for b in model.blocks)
    assert all(cg.stats(b).replays == 5 for b in model.blocks)


@pytest.mark.parametrize("key_fn", [None, "drop-constants"])
def test_control_families_rebase_before_the_storm_and_the_held_key(fam, key_fn):
    """A new cache every generate (kept alive: new addresses): a template, a diffed second
    capture, then rebased graphs (retargets) for the next ten, with a key_fn dropping the
    constants too (the cache's key component stays; the family key is its own)."""
    import test_rebase as R

    opts = {} if key_fn is None else {"key_fn": lambda sig: None}
    ref, g = R._pair(**opts)
    kept = [R._generate(ref, g) for _ in range(12)]
    s = cg.stats(g)
    assert (s.captures, s.retargets) == (2, 10) and _storm_calls(g) == 0, (
        s.captures, s.retargets, s.eager_calls)
    del kept


def test_control_static_argnames_objects_per_call_storm_and_old_ones_replay(sim):
    import test_review_static_state as S

    ref, g = S._pair(static_argnames=("cache",))
    pairs = [(S._early_init(S.static_cache()), S._early_init(S.static_cache()))
             for _ in range(12)]
    with torch.no_grad():
        for rc, c in pairs:  # a new object every call
            S._step(ref, g, rc, c, 0)
        assert _storm_calls(g) > 0
        for t in range(1, 4):  # an early object again, several steps
            S._step(ref, g, *pairs[0], t)
    assert cg.stats(g).replays >= 2
