"""Review of segments around calls that vary (a dropped plan records twice and compares; the
calls that differ run alone, eagerly; views of eagerly made tensors run alone; calls with an
opaque argument use segments). CPU, simulated backend, bitwise against an eager twin."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _segcalls, _segrun


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class _Cache:
    """A growing KV cache (an object no signature holds) with a step counter."""

    def __init__(self):
        self.k = None
        self.step = 0


class _Model(nn.Module):
    """Projections around an attention over a cache that grows every step; ``roll``: a call whose
    shift changes every step (an int argument, not a shape) feeding a view of fixed shape."""

    def __init__(self, roll: bool = False, parity: bool = False):
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.roll, self.parity = roll, parity

    def forward(self, x, cache):
        h = self.norm(x)
        k = self.k(h)
        cache.k = k if cache.k is None else torch.cat([cache.k, k], dim=1)
        a = torch.softmax(self.q(h) @ cache.k.transpose(1, 2), -1) @ cache.k
        if self.roll:
            r = torch.roll(a, shifts=cache.step % 5 + 1, dims=-1)  # varies: runs alone
            v = r.view(a.shape[0], -1)  # a view of an eagerly made tensor
            v = v.view(a.shape)  # a view of that view
            a = v * 2.0 + a
        if self.parity and cache.step % 2:
            a = a.tanh() * 0.5  # another call sequence every other step
        cache.step += 1
        return x + self.out(a)


def _generate(m, x, steps, cache=None):
    cache = cache or _Cache()
    outs = []
    with torch.no_grad():
        h = m(x, cache)
        outs.append(h)
        for _ in range(steps):
            h = m(h[:, -1:], cache)
            outs.append(h)
    return outs, cache


def _pair(**kw):
    torch.manual_seed(0)
    ref = _Model(**kw).eval()
    return ref, cg.graphify(copy.deepcopy(ref), segments=True)


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b))


def _item(g):
    (item,) = g._cudagraphify_state.segments._plans.values()
    return item


def test_growing_cache_generations_match_eager_and_graph_the_runs_between(sim):
    ref, g = _pair()
    for n in (3, 3, 1, 5, 3):  # a prompt of 1: its first step matches a decode step's shapes
        x = torch.randn(1, n, 8)
        assert _same(_generate(g, x, 12)[0], _generate(ref, x, 12)[0])
    plan = _item(g)[1]
    assert plan is not None and plan.replays > 0
    assert any(s.refused == _segrun.VARYING for s in plan.segments)
    assert any(s.graph is not None for s in plan.segments)


def test_two_caches_interleaved_and_batch_changes_match_eager(sim):
    ref, g = _pair()
    xa, xb = torch.randn(1, 4, 8), torch.randn(1, 2, 8)
    ca, cb, ra, rb = _Cache(), _Cache(), _Cache(), _Cache()
    with torch.no_grad():
        ha, hb, ea, eb = g(xa, ca), g(xb, cb), ref(xa, ra), ref(xb, rb)
        assert torch.equal(ha, ea) and torch.equal(hb, eb)
        for _ in range(12):  # two conversations, one step of each in turn
            ha, hb = g(ha[:, -1:], ca), g(hb[:, -1:], cb)
            ea, eb = ref(ea[:, -1:], ra), ref(eb[:, -1:], rb)
            assert torch.equal(ha, ea) and torch.equal(hb, eb)
    x = torch.randn(3, 2, 8)  # another batch size
    assert _same(_generate(g, x, 6)[0], _generate(ref, x, 6)[0])


def test_views_of_an_eagerly_made_tensor_run_alone(sim):
    ref, g = _pair(roll=True)
    for n in (3, 4):
        x = torch.randn(1, n, 8)
        assert _same(_generate(g, x, 10)[0], _generate(ref, x, 10)[0])
    plan = _item(g)[1]
    why = [s.refused or "" for s in plan.segments]
    assert sum("returns a view of a tensor from calls that run eagerly" in w for w in why) == 2
    assert any(s.graph is not None for s in plan.segments) and plan.replays > 0


def test_a_call_sequence_that_differs_every_other_step_stays_correct_and_bounded(sim):
    ref, g = _pair(parity=True)
    for _ in range(3):
        x = torch.randn(1, 3, 8)
        assert _same(_generate(g, x, 12)[0], _generate(ref, x, 12)[0])
    assert _item(g)[2] <= _segrun.MAX_PLANS


def test_a_cache_reused_across_generations_matches_eager(sim):
    ref, g = _pair()
    x = torch.randn(1, 3, 8)
    a, ca = _generate(g, x, 6)
    b, cb = _generate(ref, x, 6)
    assert _same(a, b)
    for _ in range(2):  # continue the same cache (a chat's next turn), then crop it
        y = torch.randn(1, 2, 8)
        a, ca = _generate(g, y, 6, ca)
        b, cb = _generate(ref, y, 6, cb)
        assert _same(a, b)
        ca.k, cb.k = ca.k[:, :-3], cb.k[:, :-3]  # cropped: a view


class _Watched(_Model):
    """Calls ``watch()`` (Python only: no torch call) at the end of each forward."""

    watch = None

    def forward(self, x, cache):
        out = super().forward(x, cache)
        if self.watch is not None:
            self.watch(cache)
        return out


def _held_copies(plan, cache) -> int:
    """Bytes the plan being recorded holds in tensors other than the cache's own."""
    own = cache.k.untyped_storage().data_ptr()
    seen, total = set(), 0
    tensors = [t for c in plan.calls for t in c.eager_out]
    tensors += [r[2] for c in plan.calls for r in c.refs
                if r[0] == _segcalls.X and len(r) > 2 and isinstance(r[2], torch.Tensor)]
    storages = [t.untyped_storage() for t in tensors] + list(plan.copied_held)
    for st in storages:
        if st.data_ptr() not in seen and st.data_ptr() != own:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def test_recording_a_decode_step_holds_no_copy_of_the_cache(sim):
    # (review finding 1, fixed: calls with an opaque argument, a growing cache, make a dry
    # record first and compare the next with it; no record copies the cache)
    torch.manual_seed(0)
    ref = _Watched().eval()
    g = cg.graphify(copy.deepcopy(ref), segments=True)
    worst = []

    def watch(cache):
        items = list(g._cudagraphify_state.segments._plans.values())
        plan = items[0][1] if items else None
        if plan is not None and not plan.ready:  # (a record in progress)
            worst.append((_held_copies(plan, cache), cache.k.untyped_storage().nbytes()))

    g.watch = watch
    _generate(g, torch.randn(1, 2048, 8), 10)
    assert worst
    assert all(held < cache for held, cache in worst), worst


def test_hf_generate_batch_beam_continued_and_cropped_cache_match_eager(sim):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=256,
                                      eos_token_id=None, pad_token_id=0)
    m = transformers.LlamaForCausalLM(config).eval()
    m.generation_config.eos_token_id, m.generation_config.pad_token_id = None, 0
    g = cg.graphify(copy.deepcopy(m), segments=True)
    kw = dict(max_new_tokens=8, do_sample=False)
    with torch.no_grad():
        ids = torch.randint(1, 64, (2, 5))
        mask = torch.ones_like(ids)
        mask[0, :2] = 0
        assert torch.equal(m.generate(ids, attention_mask=mask, **kw),
                           g.generate(ids, attention_mask=mask, **kw))
        assert torch.equal(m.generate(ids[:1], num_beams=3, **kw),
                           g.generate(ids[:1], num_beams=3, **kw))
        ra = m.generate(ids, return_dict_in_generate=True, **kw)
        rb = g.generate(ids, return_dict_in_generate=True, **kw)
        for _ in range(2):  # the next turns of a chat, on the same DynamicCache
            more = torch.randint(1, 64, (2, 3))
            ra = m.generate(torch.cat([ra.sequences, more], 1), past_key_values=ra.past_key_values,
                            return_dict_in_generate=True, **kw)
            rb = g.generate(torch.cat([rb.sequences, more], 1), past_key_values=rb.past_key_values,
                            return_dict_in_generate=True, **kw)
            assert torch.equal(ra.sequences, rb.sequences)
        ra.past_key_values.crop(-4)
        rb.past_key_values.crop(-4)
        assert torch.equal(m.generate(ra.sequences[:, :-4], past_key_values=ra.past_key_values, **kw),
                           g.generate(rb.sequences[:, :-4], past_key_values=rb.past_key_values, **kw))


def test_the_comparing_record_holds_no_copy_of_the_growing_cache(sim):
    # (finding 1, the part fixed: the record made against an earlier one copies nothing of the
    # calls whose arguments changed since, the cache's cat; with a dry first
    # record, no record does)
    torch.manual_seed(0)
    ref = _Watched().eval()
    g = cg.graphify(copy.deepcopy(ref), segments=True)
    seen = []

    def watch(cache):
        items = list(g._cudagraphify_state.segments._plans.values())
        plan = items[0][1] if items else None
        if plan is not None and not plan.ready and plan.earlier is not None:
            seen.append((_held_copies(plan, cache), cache.k.untyped_storage().nbytes()))

    g.watch = watch
    _generate(g, torch.randn(1, 2048, 8), 12)
    assert seen, "no comparing record was made"
    assert all(held < cache for held, cache in seen), seen
