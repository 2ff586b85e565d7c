"""GPU tests: HF transformers ``generate()`` with a static cache under ``graphify(model)``, no
option. Tokens and logits are compared with eager's, bitwise: decode steps run eager's kernels;
a replayed prefill runs HF's captured path (an explicit mask over the whole cache, where eager
runs SDPA's causal kernel on the prompt's slice), equal on these small models. Counters prove
the decode steps replayed."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

import cudagraphify as cg

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("quiet_gpu")]

DEV = "cuda"
NEW = 12


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(DEV, torch.bfloat16).eval()
    return transformers, config, model


def _greedy(**extra):
    return dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0,
                output_logits=True, return_dict_in_generate=True, **extra)


def _same(a, b):
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        assert torch.equal(x, y)


def test_generate_with_cache_implementation_static(hf):
    transformers, config, model = hf
    g = cg.graphify(copy.deepcopy(model))
    assert g.generation_config.disable_compile is True  # generate's own compile is off
    prompt = torch.randint(0, config.vocab_size, (1, 8), device=DEV)
    made = []  # (captures, rebased graphs) of each generate
    for _ in range(5):
        want = model.generate(prompt, cache_implementation="static", disable_compile=True,
                              **_greedy())
        before = cg.stats(g)
        got = g.generate(prompt, cache_implementation="static", **_greedy())
        after = cg.stats(g)
        made.append((after.captures - before.captures, after.retargets - before.retargets))
        _same(got, want)
    s = cg.stats(g)
    # every generate makes a cache. The first one's prefill sets it up (eager); later caches
    # are set up before their prefill as the first one was (set_ups), so that their prefill
    # is graphed too. Prefill and decode step each: captured for the first two caches that
    # reach them (the second capture, diffed with the first, proves they differ only in the
    # caches' addresses), rebased to later ones at other addresses (a prefill whose diff is
    # refused keeps capturing: after two more, new caches are set up by their prefill again).
    # The output holds its cache (return_dict_in_generate) until the next generate returns:
    # each cache set up is given the memory of the one before the last (the set-up's own
    # pool), whose kept graphs it replays: the fourth and fifth generates make no graph.
    assert all("sets up" in r for r in s.eager_calls), s.eager_calls
    assert s.set_ups >= 3 and s.eager + s.set_ups == 5, (s.eager_calls, s.set_ups)
    assert s.retargets >= 1 and s.captures <= 6, (made, s.reasons)
    assert made[3:] == [(0, 0), (0, 0)], made
    assert s.evictions == 0 and s.graphs <= 4


def test_static_generates_that_drop_their_cache_replay_with_no_capture_and_no_rebase(hf):
    """Each ``generate(cache_implementation="static")`` makes a cache and drops it when it
    returns (its output holds no cache here). A cache set up before its prefill is allocated
    in the set-up's own memory pool: the next one is given the dropped one's memory, so its
    calls find the graphs of the dropped one (kept when it died) and replay them."""
    transformers, config, model = hf
    g = cg.graphify(copy.deepcopy(model))
    prompt = torch.randint(0, config.vocab_size, (1, 8), device=DEV)
    greedy = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    counts = []
    for _ in range(5):
        want = model.generate(prompt, cache_implementation="static", disable_compile=True,
                              **greedy)
        before = cg.stats(g)
        got = g.generate(prompt, cache_implementation="static", **greedy)
        after = cg.stats(g)
        assert torch.equal(got, want)
        counts.append((after.captures - before.captures, after.retargets - before.retargets,
                       after.replays - before.replays, after.set_ups - before.set_ups))
    for captures, retargets, replays, set_ups in counts[2:]:
        assert (captures, retargets, set_ups) == (0, 0, 1), counts
        assert replays >= NEW, counts  # (its prefill and every decode step)


def test_generate_with_a_kept_static_cache_reuses_its_graph(hf):
    transformers, config, model = hf
    g = cg.graphify(copy.deepcopy(model))
    prompt = torch.randint(0, config.vocab_size, (1, 8), device=DEV)
    mine = transformers.StaticCache(config=config, max_cache_len=32)
    ref = transformers.StaticCache(config=config, max_cache_len=32)
    for _ in range(3):
        mine.reset()
        ref.reset()
        want = model.generate(prompt, past_key_values=ref, disable_compile=True, **_greedy())
        got = g.generate(prompt, past_key_values=mine, **_greedy())
        _same(got, want)
    s = cg.stats(g)
    decode_graphs = [r for r in s.eager_calls if "sets up" in r]
    assert decode_graphs  # the first prefill set the cache up
    assert s.replays >= 3 * (NEW - 2)  # the decode graph served all three generates
    assert s.evictions == 0


def test_a_dropped_cache_is_not_kept_alive_by_graphs(hf):
    transformers, config, model = hf
    g = cg.graphify(copy.deepcopy(model))
    prompt = torch.randint(0, config.vocab_size, (1, 8), device=DEV)
    cache = transformers.StaticCache(config=config, max_cache_len=32)
    g.generate(prompt, past_key_values=cache, **_greedy())
    assert cg.stats(g).captures >= 1
    gone = weakref.ref(cache)
    keys = weakref.ref(cache.layers[0].keys)
    del cache
    gc.collect()
    assert gone() is None and keys() is None


def test_a_replaced_cache_tensor_is_seen_by_the_next_step(hf):
    transformers, config, model = hf
    g = cg.graphify(copy.deepcopy(model))
    prompt = torch.randint(0, config.vocab_size, (1, 8), device=DEV)
    caches = [transformers.StaticCache(config=config, max_cache_len=32) for _ in range(2)]
    runs = []
    for m, cache, kw in ((model, caches[0], {"disable_compile": True}), (g, caches[1], {})):
        out = m.generate(prompt, past_key_values=cache, **_greedy(**kw))
        for layer in cache.layers:  # moved to new memory, same contents
            layer.keys = layer.keys.clone()
            layer.values = layer.values.clone()
        nxt = out.sequences[:, -1:]
        runs.append(m(nxt, past_key_values=cache, use_cache=True).logits)
        runs.append(m(nxt, past_key_values=cache, use_cache=True).logits)
    assert torch.equal(runs[0], runs[2]) and torch.equal(runs[1], runs[3])


def test_generate_with_its_dynamic_cache_graphs_the_pieces_around_it(hf):
    # no cache option: generate() passes its DynamicCache (which grows every step) from the
    # first call on; the model runs eagerly with its norms, MLPs and projections graphed as
    # pieces, chained in the model's implicit region
    # (and the attention's rotary embedding, a function of the modeling module, as a function
    # piece: see cudagraphify/_funcpieces.py)
    from transformers.models.llama import modeling_llama

    transformers, config, model = hf
    g = cg.graphify(copy.deepcopy(model))
    rotary = None
    for length in (8, 5, 8):  # two prompts' lengths: prefill signatures of their own
        prompt = torch.randint(0, config.vocab_size, (1, length), device=DEV)
        want = model.generate(prompt, **_greedy())
        if rotary is None:  # (installed by the plan of the first call: counted from there)
            _same(g.generate(prompt, **_greedy()), want)
            rotary = modeling_llama.apply_rotary_pos_emb
            before = cg.stats(rotary).replays
            continue
        _same(g.generate(prompt, **_greedy()), want)
    assert g._cudagraphify_state._chain is not None
    for layer in g.model.layers:
        for piece in (layer.mlp, layer.input_layernorm, layer.self_attn.q_proj):
            s = cg.stats(piece)
            assert s.captures >= 1 and s.replays >= 2 * NEW, (piece, s)
    # two generates of NEW tokens, two layers: each decode step's rotary calls replayed
    assert cg.stats(rotary).replays - before >= 2 * 2 * (NEW - 2), cg.stats(rotary)


def test_dynamic_cache_generate_moves_no_output_and_has_a_rotary_copy_per_layer(hf):
    """The rotary function piece has one graphified copy per layer's call, captured in the run
    that captures the layer's pieces, in call order: once settled, a generate moves no held
    output to a copy and blocks no replay (one copy for both layers, captured at the second
    layer's call a run early, was blocked, captured again, then had its outputs moved to copies
    before each o_proj replay: a copy a layer a decode step)."""
    from cudagraphify import _funcpieces
    from transformers.models.llama import modeling_llama

    transformers, config, model = hf
    g = cg.graphify(copy.deepcopy(model))
    prompt = torch.randint(0, config.vocab_size, (1, 8), device=DEV)
    want = model.generate(prompt, **_greedy())
    for _ in range(4):  # (captures, the pieces' trials and the plan's)
        _same(g.generate(prompt, **_greedy()), want)
    chain = g._cudagraphify_state._chain
    calls = getattr(modeling_llama.apply_rotary_pos_emb, _funcpieces._ATTR)[chain]
    states = [c._self_dispatch.state for c in calls.graphed]
    assert len(states) == config.num_hidden_layers
    moved, replays = chain.moved_outputs, [s.replays for s in states]
    _same(g.generate(prompt, **_greedy()), want)
    assert chain.moved_outputs == moved
    # (a copy whose trial gave it back runs the function itself: not one a layer here)
    grew = [s.replays - r for s, r in zip(states, replays) if s.given_back is None]
    assert grew and all(n >= NEW - 1 for n in grew), [s.stats() for s in states]
    assert all(s._recaptures == 0 for s in states)


def test_dynamic_cache_generates_switch_prefill_and_decode_without_the_slow_path(
        hf, monkeypatch):
    """Each piece has a prefill's graph and a decode step's; every generate calls them in turn.
    The graph replayed before the last one is kept aside and re-checked (GraphedState._alt):
    once settled, a generate's pieces take no slow path at all (two per piece before)."""
    from cudagraphify import _engine

    transformers, config, model = hf
    g = cg.graphify(copy.deepcopy(model))
    prompt = torch.randint(0, config.vocab_size, (1, 8), device=DEV)
    want = model.generate(prompt, **_greedy())
    for _ in range(4):  # (captures, the pieces' trials and the plan's)
        _same(g.generate(prompt, **_greedy()), want)
    pieces = [m for m in g.modules() if m is not g
              and getattr(m.__dict__.get("_cudagraphify_state"), "replays", 0)]
    slow = []
    real = _engine.GraphedState.slow
    monkeypatch.setattr(_engine.GraphedState, "slow",
                        lambda self, fn, a, k: slow.append(self) or real(self, fn, a, k))
    before = {id(m): cg.stats(m).replays for m in pieces}
    _same(g.generate(prompt, **_greedy()), want)
    assert len(pieces) >= 10
    assert not [s for s in slow if s.statics.root in pieces], len(slow)
    # every piece still graphed replayed each decode step's graph (and its prefill's, where that
    # signature was not given back)
    grew = [cg.stats(m).replays - before[id(m)] for m in pieces
            if m._cudagraphify_state.given_back is None]
    assert grew and all(n in (NEW - 1, NEW) for n in grew), grew


def test_generate_with_a_sliding_window_static_cache_graphs_around_it():
    # Qwen2 with a sliding-window layer: HF's StaticSlidingWindowLayer counts the tokens it has
    # seen in a Python int, bumped by every update, so no graph of the model can replay with
    # it. The step that shows it runs eagerly and the cache is demoted (an opaque object, as a
    # DynamicCache): later steps are not probed again and run eagerly around it, with their
    # pieces graphed. Tokens and logits as eager's; the side effect learnt on two calls per
    # cache.
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128,
                                      use_sliding_window=True, sliding_window=6,
                                      max_window_layers=1, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).to(DEV, torch.bfloat16).eval()
    g = cg.graphify(copy.deepcopy(model))
    prompt = torch.randint(0, config.vocab_size, (1, 4), device=DEV)
    for _ in range(4):
        want = model.generate(prompt, cache_implementation="static", disable_compile=True,
                              **_greedy())
        _same(g.generate(prompt, cache_implementation="static", **_greedy()), want)
    s = cg.stats(g)
    # learnt by two probed calls per cache (generate() makes one per call), then demoted
    side = sum(n for r, n in s.eager_calls.items() if "side effect" in r)
    assert 1 <= side <= 2 * 4, s.eager_calls
    assert any("changes on every call" in r for r in s.eager_calls), s.eager_calls
    mlp = cg.stats(g.model.layers[0].mlp)
    assert mlp.replays >= NEW, mlp


def test_a_causal_lm_called_with_ids_is_one_graph_and_returns_its_cache(hf):
    """``model(ids)`` (use_cache on, no cache passed): forward makes a DynamicCache and returns
    it; the model is one graph, each replay returns a new cache whose keys and values are
    eager's, bitwise, and a decode step on that cache is eager's."""
    transformers, config, model = hf
    g = cg.graphify(copy.deepcopy(model))
    ids = torch.randint(0, config.vocab_size, (2, 9), device=DEV)
    caches = []
    with torch.no_grad():
        for _ in range(4):
            got, want = g(ids), model(ids)
            assert torch.equal(got.logits, want.logits)
            gc_, wc = got.past_key_values, want.past_key_values
            assert type(gc_) is type(wc) and len(gc_.layers) == len(wc.layers)
            for a, b in zip(gc_.layers, wc.layers):
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            caches.append(gc_)
        s = cg.stats(g)
        assert (s.captures, s.replays, dict(s.eager_calls)) == (1, 3, {}), s
        assert len({id(c) for c in caches}) == 4
        assert len({c.layers[0].keys.data_ptr() for c in caches}) == 4
        nxt = want.logits[:, -1:].argmax(-1)
        got, want = g(nxt, past_key_values=caches[-1]), model(nxt, past_key_values=wc)
        assert torch.equal(got.logits, want.logits)
        assert caches[-1].get_seq_length() == wc.get_seq_length() == 10
