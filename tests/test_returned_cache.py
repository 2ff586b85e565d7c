"""HF causal LMs called as ``model(ids)``: forward makes a ``DynamicCache`` and returns it
(cudagraphify/_outobjects.py), and its first keys are ``torch.tensor([], device=...)``, which
copies nothing (_policy._no_data). The whole model is one graph; each replay hands out a new
cache object of the same class, its keys and values the replay's (copies), as eager's.

CPU, simulated backend (fixture ``sim``), ``torch.cuda.is_current_stream_capturing`` answering
as the double captures (HF's mask code asks it, as on a GPU). Every output and every cache
tensor is compared with an eager twin, bitwise."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, cache_utils  # noqa: E402

import cudagraphify as cg  # noqa: E402
from cudagraphify import _outobjects  # noqa: E402


@pytest.fixture(autouse=True)
def _captured_path(sim, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: sim.capturing)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        yield


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1,
                                   vocab_size=64, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval()


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _same(got, want) -> None:
    assert torch.equal(got.logits, want.logits)
    gc, wc = got.past_key_values, want.past_key_values
    assert type(gc) is type(wc) and len(gc.layers) == len(wc.layers)
    assert vars(gc).keys() == vars(wc).keys()
    for g, w in zip(gc.layers, wc.layers):
        assert type(g) is type(w) and vars(g) .keys() == vars(w).keys()
        assert torch.equal(g.keys, w.keys) and torch.equal(g.values, w.values)
        assert (g.is_initialized, g.dtype, g.device) == (w.is_initialized, w.dtype, w.device)
    assert gc.get_seq_length() == wc.get_seq_length()


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_a_model_returning_its_dynamic_cache_is_one_graph(make):
    ref = make()
    g = cg.graphify(copy.deepcopy(ref))
    ids = torch.randint(0, 64, (2, 7))
    outs = []
    for _ in range(4):
        got, want = g(ids), ref(ids)
        _same(got, want)
        outs.append(got)
    s = cg.stats(g)
    assert (s.captures, s.replays, dict(s.eager_calls)) == (1, 3, {}), s
    # (the first call's is the object the forward made; a replay's a new one every call, on
    # memory of its own: a later replay does not change what an earlier one returned)
    first = outs[0].past_key_values
    assert not isinstance(first, _outobjects.SeenThrough)
    caches = [o.past_key_values for o in outs]
    assert len({id(c) for c in caches}) == 4
    assert len({id(c.layers[0]) for c in caches}) == 4
    assert len({c.layers[0].keys.data_ptr() for c in caches}) == 4
    kept = outs[1].past_key_values.layers[1].values.clone()
    g(torch.randint(0, 64, (2, 7)))
    assert torch.equal(outs[1].past_key_values.layers[1].values, kept)


def test_the_returned_cache_carries_on_as_eagers_does():
    ref = _llama()
    g = cg.graphify(copy.deepcopy(ref))
    ids = torch.randint(0, 64, (1, 5))
    for _ in range(3):
        got, want = g(ids), ref(ids)
    gc, wc = got.past_key_values, want.past_key_values
    for _ in range(3):  # decode steps on the returned caches (passed in: the opaque plan)
        nxt = want.logits[:, -1:].argmax(-1)
        got = g(nxt, past_key_values=gc)
        want = ref(nxt, past_key_values=wc)
        _same(got, want)
        assert got.past_key_values is gc  # (passed in: the same object, grown)
    assert gc.get_seq_length() == 8


def test_a_new_signature_captures_its_own_graph_with_its_own_cache_shapes():
    ref = _llama()
    g = cg.graphify(copy.deepcopy(ref))
    for n in (5, 9, 5, 9, 5):
        ids = torch.randint(0, 64, (1, n))
        got, want = g(ids), ref(ids)
        _same(got, want)
        assert got.past_key_values.layers[0].keys.shape[-2] == n
    assert cg.stats(g).captures == 2


class _MyCache(DynamicCache):
    """A subclass: its methods may read what a copy would lack."""


class _MyLayer(cache_utils.DynamicLayer):
    pass


class _Returns(torch.nn.Module):
    """Makes a cache the way HF's models do, or one that does not qualify."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        cache = _MyCache() if self.kind == "subclass" else DynamicCache()
        k = self.lin(x)[None, None]
        cache.update(k, k * 2, 0)
        if self.kind == "layer subclass":
            cache.layers[0].__class__ = _MyLayer
        elif self.kind == "object attribute":
            cache.note = [1, 2]  # (a list: mutable, not a value a graph can hand out again)
        return k.sum(), cache


@pytest.mark.parametrize("kind", ["subclass", "layer subclass", "object attribute"])
def test_a_cache_that_does_not_qualify_runs_eagerly_with_the_reason(kind):
    # (the module runs eagerly, the reason its output; its Linear is graphed as a piece where
    # the object is an HF cache, see _replay.opaque_output)
    ref = _Returns(kind)
    g = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    for _ in range(4):
        (out, cache), (want, wcache) = g(x), ref(x)
        assert not isinstance(cache, _outobjects.SeenThrough) and type(cache) is type(wcache)
        assert torch.equal(out, want)
        assert torch.equal(cache.layers[0].keys, wcache.layers[0].keys)
    root = g._cudagraphify_state
    assert sum(root.eager_calls.values()) == 4
    assert all("returns an object of type" in r for r in root.eager_calls), root.eager_calls
    if kind == "subclass":  # (a class of the user's: the module wholly eager)
        assert "_cudagraphify_state" not in g.lin.__dict__
    else:  # (an HF cache: the module eager, its Linear a piece)
        assert all("output [OPAQUE]" in r for r in root.eager_calls)
        lin = cg.stats(g.lin)
        assert lin.captures == 1 and lin.replays >= 2, lin


def test_a_plain_dynamic_cache_made_in_forward_replays():
    ref = _Returns("plain")
    g = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    for _ in range(3):
        (a, c), (b, d) = g(x), ref(x)
        assert torch.equal(a, b)
        assert torch.equal(c.layers[0].keys, d.layers[0].keys)
        assert torch.equal(c.layers[0].values, d.layers[0].values)
    assert cg.stats(g).replays == 2


def _made(k: torch.Tensor) -> dict:
    """An output whose cache nothing else holds (as one forward made)."""
    cache = DynamicCache()
    cache.update(k, k + 1, 0)
    return {"logits": torch.zeros(2), "cache": cache, "size": torch.Size([2, 3])}


def test_see_through_and_restore_round_trip():
    k = torch.randn(1, 1, 2, 4)
    out = _made(k)
    seen = _outobjects.see_through(out)
    assert isinstance(seen["cache"], _outobjects.SeenThrough)
    assert type(seen["size"]) is torch.Size
    leaves, spec = torch.utils._pytree.tree_flatten(seen)
    assert len(leaves) == 5  # the logits, the keys, the values, the size's two ints
    again = torch.utils._pytree.tree_unflatten([t.clone() if isinstance(t, torch.Tensor) else t
                                                for t in leaves], spec)
    assert type(again["cache"]) is DynamicCache and again["cache"] is not out["cache"]
    assert torch.equal(again["cache"].layers[0].values, k + 1)
    back = _outobjects.restore(seen, _outobjects.seeing_through(dict))  # (nodes taken back)
    assert back["cache"] is out["cache"] and type(back["size"]) is torch.Size
    run = _outobjects.seeing_through(lambda: _made(torch.randn(1, 1, 2, 4)))
    seen = run()
    assert isinstance(seen["cache"], _outobjects.SeenThrough)
    original = run.made[0][1]
    assert _outobjects.restore(seen, run) is original and not run.made  # (its own dict)
    plain = {"a": torch.zeros(1)}
    assert _outobjects.see_through(plain) is plain
    assert _outobjects.restore(plain, run) is plain


def test_a_cache_something_else_holds_is_not_seen_through():
    out = _made(torch.randn(1, 1, 2, 4))
    held = out["cache"]  # (the caller's, a module's, a global's: a replay could not return it)
    assert _outobjects.see_through(out) is out
    del held
    assert isinstance(_outobjects.see_through(out)["cache"], _outobjects.SeenThrough)
    twice = _made(torch.randn(1, 1, 2, 4))
    twice["again"] = twice["cache"]  # (one object twice: a replay would make two)
    assert _outobjects.see_through(twice) is twice
    layer = _made(torch.randn(1, 1, 2, 4))
    layer["layer"] = layer["cache"].layers[0]  # (a layer also returned on its own)
    seen = _outobjects.see_through(layer)
    assert not any(isinstance(v, _outobjects.SeenThrough) for v in seen.values())


def test_a_cache_no_replay_can_return_leaves_the_model_pieces():
    # T5 called as model(input_ids, decoder_input_ids) returns an EncoderDecoderCache (not made
    # again by a replay): the model and its decoder run eagerly with that reason, the encoder
    # is one graph and the decoder's safe submodules are pieces (before 57a36e6 its
    # attention's empty torch.tensor made it piecewise; without this rule it ran wholly eagerly)
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                num_decoder_layers=2, num_heads=4, decoder_start_token_id=0)
    ref = transformers.T5ForConditionalGeneration(cfg).eval()
    g = cg.graphify(copy.deepcopy(ref))
    ids, dec = torch.randint(0, 64, (2, 7)), torch.randint(0, 64, (2, 3))
    for _ in range(4):
        got, want = g(input_ids=ids, decoder_input_ids=dec), \
            ref(input_ids=ids, decoder_input_ids=dec)
        assert torch.equal(got.logits, want.logits)
        assert type(got.past_key_values) is type(want.past_key_values)
    root = g._cudagraphify_state
    assert root.replays == 0 and all("output [OPAQUE]" in r and "EncoderDecoderCache" in r
                                     for r in root.eager_calls), root.eager_calls
    enc = cg.stats(g.encoder)
    assert enc.captures == 1 and enc.replays >= 2, enc
    assert cg.stats(g.decoder.final_layer_norm).replays >= 2
