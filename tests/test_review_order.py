"""Review of 303c3a0 (a region graph blocked by a later graph's held view is captured again: at
most _MAX_RECAPTURES "in a row", a row ended by _RECAPTURE_WORKED replays of the callable) and
0c8b53c (a function piece, HF's ``apply_rotary_pos_emb``, gets one graphified copy per call
index within a run of its root: ``_funcpieces._Calls``).

CPU, simulated backend (fixture ``sim``). Every output is compared with an eager twin bitwise
(``torch.equal``), kept outputs and views too. No silent wrong value was found.

``test_finding_*`` (``xfail(strict=True)``: they pass while the problem is there):

- R1 (perf). ``_recaptures`` is reset when the *callable's* replays since the last recapture
  reach 32 (``self.replays``: every graph of the callable, any signature, any region, fast
  path included), not when the recaptured graph itself replayed. Two graphs blocking each other
  (ping-pong, the case the row bound is there for) are recaptured forever as soon as either
  callable replays another graph ~8 times a step. 120 steps: 36 captures each (303c3a0^: 6).
- C1 (perf/memory, minor). ``_Calls.next`` says it runs "under the region's lock: a run of the
  root holds it"; a run holds ``chain.lock`` only around enter_run/exit_run. Two threads
  running the root at once share one counter (the later run's first call resets the count the
  earlier run is using, mid-run): more copies than calls in a run (5 for 3 here; up to 64),
  calls mapped to other layers' copies. Values stay right.

``test_control_*``: checked and found correct.
"""

from __future__ import annotations

import copy
import random
import sys
import threading
import types
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _engine, _funcpieces, _pieces

NAME = "transformers.models.cg_review_order.modeling_cg_review_order"
_VIEW = "still referenced through a view"


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# -- 303c3a0: recaptures in a row -----------------------------------------------------------

def _twin(module):
    return module, cg.graphify(copy.deepcopy(module))


def _ping_pong(steps: int, extra: int):
    """F and G each hold a view of the other's output across the other's next call (each
    recapture puts one after the other, which blocks the other), while each also replays a
    graph of another signature ``extra`` times a step (nobody blocks those). Returns F's and G's
    stats; every value (the held views included) is checked against eager."""
    torch.manual_seed(0)
    rf, gf = _twin(nn.Linear(8, 8))
    rg, gg = _twin(nn.Linear(8, 8))
    with torch.no_grad(), cg.graph_region():
        vb = rvb = None
        for t in range(steps):
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
            for _ in range(extra):
                z = torch.randn(2, 8)
                assert torch.equal(gf(z), rf(z)), t
                z = torch.randn(2, 8)
                assert torch.equal(gg(z), rg(z)), t
    return cg.stats(gf), cg.stats(gg)


def test_control_ping_pong_with_other_replays_keeps_eagers_values(sim):
    """R1's scenario: values (every output, the held views) as eager's all along (the bound on
    its captures: R1's test below)."""
    sf, sg = _ping_pong(120, 8)
    assert sf.replays > 0 and sg.replays > 0, (sf, sg)


def test_control_ping_pong_alone_is_still_bounded(sim):
    """Without other replays of F and G, the row bound holds (as the existing control)."""
    sf, sg = _ping_pong(120, 0)
    for s in (sf, sg):
        assert s.captures <= 1 + _engine._MAX_RECAPTURES, s


def test_finding_ping_pong_recaptures_forever_when_the_callable_replays_elsewhere(sim):
    """Ping-pong F/G (each recapture of one blocks the other, so no recapture "works"), each
    callable also replaying an unrelated signature 8 times a step. On 303c3a0^ each is captured
    6 times in 120 steps, then the blocked calls run eagerly; on 303c3a0 the 32 replays of the
    other signature ended the "row" after every recapture: 36 captures each, still growing
    linearly. Fixed: a row starts again only where the blocked graph itself replayed 32 times
    (its calls found blocked not counted)."""
    sf, sg = _ping_pong(120, 8)
    for s in (sf, sg):
        assert s.captures <= 2 * (1 + _engine._MAX_RECAPTURES), s


def test_control_recapture_rate_with_a_growing_blocker(sim):
    """A blocker G whose input grows every step (a new graph each call until its storm rule
    runs it eagerly) and a view of G's output held across F's call: F's recaptures come in rows
    of at most _MAX_RECAPTURES per storm of G (21 captures in 600 steps; 303c3a0^: 5), with more
    replays and fewer eager calls than before; values as eager's."""
    torch.manual_seed(0)
    rf, gf = _twin(nn.Linear(8, 8))
    rg, gg = _twin(nn.Linear(8, 8))
    with torch.no_grad(), cg.graph_region():
        v = rv = None
        for t in range(600):
            x = torch.randn(4, 8)
            a, ra = gf(x), rf(x)
            n = 1 + t % 200
            b, rb = gg(torch.cat([a, torch.ones(n, 8)])), rg(torch.cat([ra, torch.ones(n, 8)]))
            assert torch.equal(a, ra) and torch.equal(b, rb), t
            if v is not None:
                assert torch.equal(v, rv), t
            v, rv = b[:2], rb[:2]
            del a, b
    s = cg.stats(gf)
    assert s.captures <= 1 + 6 * _engine._MAX_RECAPTURES, s
    assert s.replays >= 500, s


def test_control_recapture_releases_while_aliases_of_every_generation_are_held(sim):
    """G's weight reassigned every 40 steps (each time F is blocked anew and recaptured, the
    commit's own scenario), while the caller keeps F's and G's full outputs from every fifth
    step (moved to copies when their graph replays or is released) and G's views from the last
    two steps: every kept tensor keeps eager's values to the end."""
    torch.manual_seed(0)
    rf, gf = _twin(nn.Linear(8, 8))
    rg, gg = _twin(nn.Linear(8, 8))
    kept, views = [], []
    with torch.no_grad(), cg.graph_region():
        for t in range(130):
            if t % 40 == 20:
                w = torch.randn(8, 8)
                rg.weight, gg.weight = nn.Parameter(w.clone()), nn.Parameter(w.clone())
            x = torch.randn(4, 8)
            a, ra = gf(x), rf(x)
            b, rb = gg(a), rg(ra)
            assert torch.equal(a, ra) and torch.equal(b, rb), t
            for got, want in views:
                assert torch.equal(got, want), t
            views = views[-1:] + [(b[:2], rb[:2])]
            if t % 5 == 0:
                kept += [(a, ra), (b, rb)]
            del a, b
        for got, want in kept:
            assert torch.equal(got, want)
    s = cg.stats(gf)
    assert s.captures >= 4 and s.replays >= 60, s


# -- 0c8b53c: one copy of the function per call in a run --------------------------------------

class Cache:
    """Opaque (as an HF DynamicCache): the root runs eagerly, its submodules are pieces. Its
    Python attributes steer the forward: layers skipped, a second call of the function, a
    layer that raises, outputs kept (the output and a view), calls per layer, a hook."""

    def __init__(self, skip=(), twice=(), fail_at=None, keep=False, calls=1, hook=None):
        self.skip, self.twice, self.fail_at, self.keep, self.calls = set(skip), set(twice), \
            fail_at, keep, calls
        self.hook = hook
        self.kept = []


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotary(q, k, cos, sin):
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


SRC = '''
class Attn(nn.Module):
    def __init__(self, i, d=8):
        super().__init__()
        self.i = i
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x, cos, sin, cache):
        if self.i == cache.fail_at:
            raise RuntimeError("boom")
        q, k = self.q(x), self.k(x)
        for _ in range(cache.calls):
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if self.i in cache.twice:
            q, k = apply_rotary_pos_emb(q, k, sin, cos)
        if cache.hook is not None:
            cache.hook(self.i)
        if cache.keep:
            cache.kept.append((q, k[:, :3]))   # an output itself, and a view of one
        return self.o(q + k)


class Model(nn.Module):
    def __init__(self, n=3, d=8):
        super().__init__()
        self.layers = nn.ModuleList(Attn(i, d) for i in range(n))
        self.norm = nn.LayerNorm(d)

    def forward(self, x, cos, sin, cache):
        for layer in self.layers:
            if layer.i in cache.skip:
                continue
            x = x + layer(self.norm(x), cos, sin, cache)
        return x
'''


def _modeling(name=NAME):
    mod = types.ModuleType(name)
    mod.torch, mod.nn = torch, nn
    mod.apply_rotary_pos_emb = _rotary
    exec(compile(SRC, f"<{name}>", "exec"), mod.__dict__)
    mod.Attn.__module__ = mod.Model.__module__ = name
    sys.modules[name] = mod
    return mod


@pytest.fixture
def modeling():
    mod = _modeling()
    yield mod
    sys.modules.pop(NAME, None)


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 8, generator=g) for _ in range(3)]


def _twins(mod, n=3):
    torch.manual_seed(0)
    ref = mod.Model(n).eval()
    return ref, cg.graphify(copy.deepcopy(ref))


def _copies(model):
    """The function's graphified copies' states in ``model``'s implicit region, by index."""
    chain = model._cudagraphify_state._chain
    per_region = getattr(sys.modules[NAME].apply_rotary_pos_emb, _funcpieces._ATTR)
    calls = per_region.get(chain)
    return [g._self_dispatch.state for g in calls.graphed] if calls is not None else []


def _totals(model):
    stats = [s.stats() for s in _copies(model) if s is not None]
    return (sum(s.captures for s in stats), sum(s.replays for s in stats),
            sum(sum(s.eager_calls.values()) for s in stats))


def _step(ref, g, seed, **kw):
    x, cos, sin = _inputs(seed)
    cr, cgr = Cache(**kw), Cache(**kw)
    with torch.no_grad():
        want = ref(x, cos, sin, cr)
        got = g(x, cos, sin, cgr)
    assert torch.equal(got, want), seed
    return cr, cgr


def test_control_calls_that_skip_layers_and_repeat_map_to_other_copies(sim, modeling):
    """Random layers skipped and random layers calling the function twice: the nth call of a
    run is another layer's from run to run. Values as eager's; no more copies than the most
    calls a run made; the copies replay."""
    ref, g = _twins(modeling, 4)
    rnd = random.Random(0)
    most = 0
    for t in range(60):
        skip = {i for i in range(4) if rnd.random() < 0.3}
        twice = {i for i in range(4) if rnd.random() < 0.2}
        most = max(most, (4 - len(skip)) + len(twice - skip))
        _step(ref, g, t, skip=skip, twice=twice)
    assert len(_copies(g)) <= most
    captures, replays, _ = _totals(g)
    assert captures >= 4 and replays >= 100, (captures, replays)


def test_control_a_run_that_raises_midway_starts_the_next_run_at_copy_zero(sim, modeling):
    """Every third run raises in layer 1 (after layer 0's call): the region's ``entered`` is
    bumped on every run, the failed one included, so the next run's first call is copy 0."""
    ref, g = _twins(modeling, 3)
    runs = 0
    for t in range(30):
        if t % 3 == 1:
            x, cos, sin = _inputs(t)
            with torch.no_grad(), pytest.raises(RuntimeError):
                g(x, cos, sin, Cache(fail_at=1))
        else:
            _step(ref, g, t)
        runs += 1
    chain = g._cudagraphify_state._chain
    assert chain.entered == runs - 1  # (the first call is the probed plan, outside the region)
    assert len(_copies(g)) == 3
    captures, replays, _ = _totals(g)
    assert captures == 3 and replays >= 3 * 15, (captures, replays)


def test_control_outputs_and_views_kept_across_runs_keep_their_values(sim, modeling):
    """Each run keeps every call's first output and a view of its second in the cache object
    (held across later runs and later replays of the same copy), with one layer calling the
    function twice (which layer changes each run, so the copies' call sites change). The
    views held for good leave the copies blocked (eager, with the reason) after a replay or
    two: values as eager's."""
    ref, g = _twins(modeling, 3)
    kept = []
    for t in range(30):
        cr, cgr = _step(ref, g, t, keep=True, twice={t % 3})
        kept.append((cr, cgr))
        for a, b in kept:
            assert len(a.kept) == len(b.kept)
            for (q1, k1), (q2, k2) in zip(a.kept, b.kept):
                assert torch.equal(q1, q2) and torch.equal(k1, k2), t
    _, replays, eager = _totals(g)
    assert replays >= 1 and eager >= 30, (replays, eager)  # (views held for good: eager)


def test_control_more_calls_than_the_cap_share_the_last_copy(sim, modeling):
    """80 calls a run (40 in each of 2 layers): 64 copies, the calls past the 64th share the
    last one (replayed several times in one run while its earlier outputs are held)."""
    ref, g = _twins(modeling, 2)
    for t in range(5):
        _step(ref, g, t, calls=40)
    assert len(_copies(g)) == _funcpieces._MAX_CALLS
    last = _copies(g)[-1].stats()
    assert last.replays >= 2 * 17, last


def test_control_a_copy_given_back_runs_plain_wherever_its_index_falls(sim, modeling):
    """Copy 1 given back (as its trial would): layer 1's call runs the function itself; then
    layer 0 is skipped, and layer 2's call (now the second) runs it itself too; values as
    eager's, the other copies go on replaying."""
    ref, g = _twins(modeling, 3)
    for t in range(5):
        _step(ref, g, t)
    states = _copies(g)
    states[1].give_back("given back here")
    before = [s.replays for s in states]
    for t in range(6):
        _step(ref, g, 10 + t, skip={0} if t % 2 else ())
    after = [s.replays for s in states]
    assert after[1] == before[1]
    assert after[0] > before[0] and after[2] > before[2]


def test_control_threads_running_the_root_at_once(sim, modeling):
    """Four threads run the root at once: the call indices of concurrent runs mix (see C1);
    every output as eager's."""
    ref, g = _twins(modeling, 3)
    for t in range(4):
        _step(ref, g, t)
    errors = []

    def work(k):
        try:
            for t in range(30):
                x, cos, sin = _inputs(100 * k + t)
                with torch.no_grad():
                    got = g(x, cos, sin, Cache(twice={t % 3}))
                    want = ref(x, cos, sin, Cache(twice={t % 3}))
                if not torch.equal(got, want):
                    errors.append((k, t))
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))
    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert len(_copies(g)) <= _funcpieces._MAX_CALLS


def _interleaved(ref, g, reps):
    """Thread A runs the root; once A's layer-0 call is made, thread B starts a run, makes its
    layer-0 call and waits for A's run to end before it goes on. Returns the copies' indices
    each thread's calls got, per rep."""
    got_index = []
    real_next = _funcpieces._Calls.next

    def spy(calls, region, make):
        graphed = real_next(calls, region, make)
        got_index.append((threading.current_thread().name,
                          next(i for i, x in enumerate(calls.graphed) if x is graphed)))
        return graphed
    _funcpieces._Calls.next = spy
    try:
        for rep in range(reps):
            a_at0, b_at0, a_done = threading.Event(), threading.Event(), threading.Event()

            def hook_a(i):
                if i == 0:
                    a_at0.set()
                    assert b_at0.wait(10)

            def hook_b(i):
                if i == 0:
                    b_at0.set()
                    assert a_done.wait(10)
            (xa, ca, sa), (xb, cb, sb) = _inputs(50 + rep), _inputs(60 + rep)
            out = {}

            def run_a():
                try:
                    with torch.no_grad():
                        out["a"] = g(xa, ca, sa, Cache(hook=hook_a))
                finally:
                    a_done.set()

            def run_b():
                with torch.no_grad():
                    out["b"] = g(xb, cb, sb, Cache(hook=hook_b))
            ta = threading.Thread(target=run_a, name="A")
            tb = threading.Thread(target=run_b, name="B")
            ta.start()
            assert a_at0.wait(10)
            tb.start()
            ta.join()
            tb.join()
            with torch.no_grad():
                assert torch.equal(out["a"], ref(xa, ca, sa, Cache()))
                assert torch.equal(out["b"], ref(xb, cb, sb, Cache()))
    finally:
        _funcpieces._Calls.next = real_next
    return got_index


def test_control_interleaved_runs_of_two_threads_values(sim, modeling):
    """C1's scenario: values as eager's; each thread's run counts its own calls: A's got copies
    0, 1, 2, and so did B's (on 0c8b53c B's got 0, 3, 4: B's enter_run reset the count A's run
    was using, then both runs counted on one counter)."""
    ref, g = _twins(modeling, 3)
    for t in range(4):
        _step(ref, g, t)
    idx = _interleaved(ref, g, 3)
    assert idx[:6] == [("A", 0), ("B", 0), ("A", 1), ("A", 2), ("B", 1), ("B", 2)], idx
    assert len(_copies(g)) == 3


def test_finding_concurrent_runs_make_more_copies_than_calls_in_a_run(sim, modeling):
    """Three calls in every run; after three interleaved pairs of runs (thread B's run begins
    while thread A's is between its first and second call), five copies exist and B's second
    and third calls went to copies 3 and 4, which no sequential run reaches: each captures its
    own graphs at their second sight (a 32-layer model served by a few threads: up to 64
    copies, each with its graphs in the pool, and calls no longer ordered after their layer's
    pieces, the blocked replays 0c8b53c set out to remove)."""
    ref, g = _twins(modeling, 3)
    for t in range(4):
        _step(ref, g, t)
    _interleaved(ref, g, 3)
    assert len(_copies(g)) <= 3


def test_control_runs_that_do_not_bump_entered_share_the_capped_copies(sim, modeling,
                                                                       monkeypatch):
    """Where a run has no stream (``_pieces._run_stream`` None: a device the backend does not
    drive), ``enter_run`` is not called and ``region.entered`` never changes: the count runs on
    across runs up to _MAX_CALLS copies, then every call shares the last one. Values as eager's
    (a cost only; not reachable with a backend that graphs the device, as far as found)."""
    monkeypatch.setattr(_pieces, "_run_stream", lambda device: None)
    ref, g = _twins(modeling, 3)
    for t in range(30):
        _step(ref, g, t)
    assert g._cudagraphify_state._chain.entered == 0
    assert len(_copies(g)) == _funcpieces._MAX_CALLS
    assert _copies(g)[-1].stats().replays >= 10


def test_control_a_users_region_and_grad_mode_run_the_function_itself(sim, modeling):
    ref, g = _twins(modeling, 3)
    for t in range(4):
        _step(ref, g, t)
    before = _totals(g)
    x, cos, sin = _inputs(40)
    with torch.no_grad(), cg.graph_region():
        for _ in range(3):
            got = g(x, cos, sin, Cache()).clone()
    with torch.no_grad():
        assert torch.equal(got, ref(x, cos, sin, Cache()))
    got = g(x, cos, sin, Cache())
    assert torch.equal(got, ref(x, cos, sin, Cache()))
    assert _totals(g) == before


def test_control_deepcopy_of_a_graphified_model_gets_copies_of_its_own(sim, modeling):
    ref, g = _twins(modeling, 3)
    for t in range(5):
        _step(ref, g, t)
    g2 = copy.deepcopy(g)
    for t in range(5):
        _step(ref, g2, 10 + t)
        _step(ref, g, 20 + t)
    assert len(_copies(g)) == 3 and len(_copies(g2)) == 3
    assert not set(map(id, _copies(g))) & set(map(id, _copies(g2)))


def test_control_hf_llama_early_exit_changes_the_number_of_calls(sim):
    """HF Llama with a DynamicCache, decode steps with ``config.num_hidden_layers`` changed
    between runs (what assisted generation's ``assistant_early_exit`` does): the number of
    rotary calls per run changes; logits as eager's."""
    transformers = pytest.importorskip("transformers")
    from transformers import DynamicCache
    from transformers.models.llama import modeling_llama
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=4, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=128,
                                      pad_token_id=0)
    ref = transformers.LlamaForCausalLM(config).eval()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for n in range(3):
            ref.model.config.num_hidden_layers = g.model.config.num_hidden_layers = 4
            rc, c = DynamicCache(config=ref.config), DynamicCache(config=ref.config)
            x = torch.randint(1, 64, (1, 3 + n % 2), generator=torch.Generator().manual_seed(n))
            for t in range(8):
                k = [4, 2, 3, 4, 1][t % 5] if n else 4
                ref.model.config.num_hidden_layers = g.model.config.num_hidden_layers = k
                want = ref(x, past_key_values=rc, use_cache=True).logits
                got = g(x, past_key_values=c, use_cache=True).logits
                assert torch.equal(got, want), (n, t)
                x = want[:, -1:].argmax(-1)
    per_region = getattr(modeling_llama.apply_rotary_pos_emb, _funcpieces._ATTR)
    calls = per_region.get(g._cudagraphify_state._chain)
    assert calls is not None and len(calls.graphed) == 4
    assert sum(st.replays for st in (x._self_dispatch.state for x in calls.graphed)) >= 10
