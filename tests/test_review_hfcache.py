"""Review: HF transformers cache objects passed to a graphified model (cudagraphify/_state.py
``is_static_state`` / ``state_key`` / ``SetUp``; their use in _engine.py, _fast.py, _first_call.py).

CPU, simulated backend (fixture ``sim``), real transformers 5 models and caches. Every check
runs an eager twin (``copy.deepcopy`` before graphify) with its own cache and compares outputs
and cache contents bitwise (``torch.equal``).

Device counter. On a GPU, HF's ``StaticLayer.lazy_initialization`` moves the layer's position
counter (``cumulative_length``, a 0-dim tensor) to the device: ``state_key`` keys it by address
and a graph reads and bumps it in place. On the CPU double every tensor is a CPU tensor, and a
0-dim CPU tensor is a host scalar, keyed by value: every step is then a new key whose call
changes the cache's "Python state", so real StaticCaches never graph on the CPU (checked by
``test_control_cpu_static_cache_without_the_device_counter_runs_eagerly``). Fixture
``device_counter`` swaps HF's static layer for a subclass (``DevStaticLayer``) whose counter,
once initialised, is a view of a 65-element tensor (keyed by address, as a CUDA tensor is);
before initialisation it is HF's host scalar, as on a GPU. Everything else is HF's code. Only
transformers' layer mapping is patched, nothing of cudagraphify.

Tests named ``test_finding_*`` failed on the code reviewed (a bug; both fixed: the objects
passed as they are stay in every key, ``_cache.CachePolicy.full_key``, and a SetUpEntry found
again after its set-up runs eagerly, ``_engine._call``); ``test_control_*`` pass (scenarios
checked and found correct).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, StaticCache, cache_utils  # noqa: E402

import cudagraphify as cg  # noqa: E402


class DevStaticLayer(cache_utils.StaticLayer):
    """HF's StaticLayer, its position counter in "device" memory once initialised (see the
    module docstring): a view of a 65-element tensor, which state_key keys by address."""

    @property
    def cumulative_length(self):
        d = self.__dict__
        return d["_dev"][0] if d.get("_dev") is not None else d["_host"]

    @cumulative_length.setter
    def cumulative_length(self, v):
        d = self.__dict__
        if d.get("keys") is None:  # HF's __init__: a host scalar, as on a GPU
            d["_host"], d["_dev"] = v, None
        elif d.get("_dev") is None or \
                v.untyped_storage().data_ptr() != d["_dev"].untyped_storage().data_ptr():
            dev = torch.zeros(65, dtype=v.dtype, device=v.device)  # lazy_initialization's .to()
            dev[0] = v
            d["_dev"] = dev


@pytest.fixture
def device_counter(monkeypatch):
    monkeypatch.setitem(cache_utils.STATIC_LAYER_TYPE_MAPPING, "full_attention", DevStaticLayer)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            yield


def _config(**kw):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                pad_token_id=0)
    base.update(kw)
    return transformers.LlamaConfig(**base)


_MODELS: dict = {}


def _llama(config_cls=None, **kw):
    """A tiny HF model (built once per config) and its eager twin's pristine copy."""
    key = (config_cls, tuple(sorted(kw.items())))
    if key not in _MODELS:
        torch.manual_seed(0)
        if config_cls is None:
            model = transformers.LlamaForCausalLM(_config(**kw)).eval()
        else:
            model = transformers.AutoModelForCausalLM.from_config(config_cls(**kw)).eval()
        model.generation_config.pad_token_id = 0
        _MODELS[key] = model
    ref = copy.deepcopy(_MODELS[key])
    return ref, ref.config


def _pair(**options):
    ref, config = _llama()
    return ref, cg.graphify(copy.deepcopy(ref), **options), config


def _static(config, n=16):
    return StaticCache(config=config, max_cache_len=n)


def _same_cache(a, b) -> bool:
    for x, y in zip(a.layers, b.layers):
        if (x.keys is None) != (y.keys is None):
            return False
        if x.keys is not None and not (torch.equal(x.keys, y.keys)
                                       and torch.equal(x.values, y.values)):
            return False
        if hasattr(x, "cumulative_length") and not torch.equal(
                torch.as_tensor(x.cumulative_length), torch.as_tensor(y.cumulative_length)):
            return False
    return True


def _check(got, want, rc, c, what):
    """Bitwise equal logits and caches, or a short failure message."""
    if not torch.equal(got, want):
        pytest.fail(f"{what}: logits differ from eager's (max abs diff "
                    f"{(got - want).abs().max().item():.3g})")
    if not _same_cache(rc, c):
        pytest.fail(f"{what}: the cache differs from the eager twin's")


def _decode(ref, g, rc, c, ids, steps=4, positional=False, what=""):
    """A prefill of ``ids`` then one-token steps (greedy), eager twin against graphed."""
    x = ids
    for t in range(steps):
        if positional:  # (input_ids, attention_mask, position_ids, past_key_values, ...)
            want = ref(x, None, None, rc, None, None, True).logits
            got = g(x, None, None, c, None, None, True).logits
        else:
            want = ref(x, past_key_values=rc, use_cache=True).logits
            got = g(x, past_key_values=c, use_cache=True).logits
        _check(got, want, rc, c, f"{what} step {t}")
        x = want[:, -1:].argmax(-1)


def _stats(g) -> str:
    s = cg.stats(g)
    return (f"captures={s.captures} replays={s.replays} set_ups={s.set_ups} "
            f"eager={dict(s.eager_calls)}")


_GEN = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True)


def _same_generate(a, b) -> bool:
    return torch.equal(a.sequences, b.sequences) and len(a.logits) == len(b.logits) and all(
        torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def _early(cache, config, batch=1):
    head_dim = config.hidden_size // config.num_attention_heads
    cache.early_initialization(batch, config.num_key_value_heads, head_dim, torch.float32,
                               torch.device("cpu"))
    return cache


# -- findings (fail on the code reviewed) -----------------------------------------------------

def test_finding_a_key_fn_that_ignores_constants_replays_another_caches_graph(
        sim, device_counter):
    """README: ``key_fn``/``CachePolicy.key`` may "ignore an argument or merge signatures";
    _cache.py: "Tensor layouts, global state and the argument structure are always part of
    the key, whatever the policy says: a graph must never read memory of another layout".
    A ``mark_static`` tensor's address is in ``sig.tensors`` (always kept), but a recognised
    StaticCache's key (its tensors' addresses) is a Constant that ``policy.key`` may drop.
    Then cache B's call replays the graph captured for cache A (still alive): A is written,
    B is not, and B's logits are A's. On a GPU the graph writes A's memory, freed if A's
    tensors were replaced (.reorder_cache, .clone): see .device/review17."""
    ref, g, config = _pair(key_fn=lambda sig: None)  # "shapes are all that matter"
    pairs = []
    for k in range(2):  # two live caches (a user serving two sequences), early-initialised
        rc, c = _early(_static(config), config), _early(_static(config), config)
        pairs.append((rc, c))
        _decode(ref, g, rc, c, torch.randint(1, 64, (1, 4)), what=f"cache {k}")
    print(_stats(g))


def test_finding_a_key_fn_that_ignores_constants_with_a_new_static_cache_recurses(
        sim, device_counter):
    """The same key_fn with ``generate(cache_implementation="static")`` (a new, lazily
    initialised cache per call): the second generate's prefill finds the SetUpEntry, sets the
    new cache up (_engine._set_up), then ``_call`` recurses and, the key ignoring the cache,
    finds the same SetUpEntry again; ``SetUp.apply`` on the cache it already set up succeeds
    (early_initialization skips initialised layers; the layout matches), and so on:
    RecursionError out of a call eager would have answered."""
    ref, g, _ = _pair(key_fn=lambda sig: None)
    for n in range(2):
        ids = torch.randint(1, 64, (1, 4))
        want = ref.generate(ids, cache_implementation="static", disable_compile=True, **_GEN)
        try:
            got = g.generate(ids, cache_implementation="static", **_GEN)
        except RecursionError:
            got = None
        if got is None:
            pytest.fail(f"generate {n}: RecursionError in cudagraphify's _call (the "
                        "SetUpEntry matched again after its set-up)")
        assert _same_generate(got, want), n


# -- controls (pass: checked and found correct) --------------------------------------------------

def test_control_cpu_static_cache_without_the_device_counter_runs_eagerly(sim):
    """HF's own StaticLayer on the CPU double: its counter is a host scalar, every call of the
    model runs eagerly (the set-up, then "changes its Python state", then around the demoted
    cache); correct, never one graph of the model, and the cache probed twice, not per step."""
    ref, g, config = _pair()
    rc, c = _static(config), _static(config)
    _decode(ref, g, rc, c, torch.randint(1, 64, (1, 4)), steps=6)
    s = cg.stats(g)
    assert sum(n for r, n in s.eager_calls.items() if "side effect" in r) == 2, _stats(g)
    assert s.replays >= 1, _stats(g)  # a piece around the demoted cache


def test_control_reset_between_generations(sim, device_counter):
    ref, g, config = _pair()
    rc, c = _static(config), _static(config)
    for n, length in enumerate((4, 3, 4, 5)):
        rc.reset()
        c.reset()
        _decode(ref, g, rc, c, torch.randint(1, 64, (1, length)), what=f"generation {n}")
    assert cg.stats(g).replays >= 6, _stats(g)


@pytest.mark.parametrize("keep", [False, True], ids=["dropped", "kept-alive"])
def test_control_a_new_static_cache_per_generation(sim, device_counter, keep):
    """Same max length, another max length, batch 2, back: each cache set up (SetUp) or
    keyed by its own addresses; old caches dropped (their graphs released) or kept alive."""
    ref, g, config = _pair()
    kept = []
    for n, (length, batch) in enumerate([(16, 1), (16, 1), (12, 1), (16, 2)]):
        rc, c = _static(config, length), _static(config, length)
        if keep:
            kept.append((rc, c))
        _decode(ref, g, rc, c, torch.randint(1, 64, (batch, 4)), steps=3, what=f"cache {n}")
    s = cg.stats(g)
    assert s.set_ups >= 1 and s.replays >= 4, _stats(g)


def test_control_early_initialised_and_in_place_edited_and_replaced_tensors(sim,
                                                                             device_counter):
    """A cache early-initialised by the user; its tensors edited in place between steps;
    then replaced (``.clone()``, ``.to(float64).to(float32)``: new memory, same values); and
    ``reorder_cache`` (beam search: ``index_select``, new memory every step)."""
    ref, g, config = _pair()
    rc, c = _early(_static(config), config, 2), _early(_static(config), config, 2)
    _decode(ref, g, rc, c, torch.randint(1, 64, (2, 4)), steps=3, what="early")
    for cc in (rc, c):
        cc.layers[0].keys[:, :, 1] = 0.5
        cc.layers[1].values.mul_(2)
    _decode(ref, g, rc, c, torch.randint(1, 64, (2, 1)), steps=2, what="edited")
    for cc in (rc, c):
        for layer in cc.layers:
            layer.keys = layer.keys.clone()
            layer.values = layer.values.to(torch.float64).to(torch.float32)
    _decode(ref, g, rc, c, torch.randint(1, 64, (2, 1)), steps=2, what="replaced")
    x = torch.randint(1, 64, (2, 1))
    for t in range(3):
        idx = torch.tensor([1, 0]) if t % 2 else torch.tensor([0, 0])
        for cc in (rc, c):
            cc.reorder_cache(idx)
        want = ref(x, past_key_values=rc, use_cache=True).logits
        got = g(x, past_key_values=c, use_cache=True).logits
        _check(got, want, rc, c, f"reorder step {t}")
        x = want[:, -1:].argmax(-1)


def test_control_generate_static_several_prompts_lengths_and_padding(sim, device_counter):
    ref, g, _ = _pair()
    # (generate's static cache is as long as the longest asked for so far: the second call's
    # new cache is keyed as the first one was, and set up before its prefill)
    for n, (batch, length, pad) in enumerate([(1, 4, 0), (1, 4, 0), (1, 6, 0), (2, 5, 2)]):
        ids = torch.randint(1, 64, (batch, length))
        mask = torch.ones_like(ids)
        mask[0, :pad] = 0
        ids[0, :pad] = 0
        want = ref.generate(ids, attention_mask=mask, cache_implementation="static",
                            disable_compile=True, **_GEN)
        got = g.generate(ids, attention_mask=mask, cache_implementation="static", **_GEN)
        assert _same_generate(got, want), (n, _stats(g))
    assert cg.stats(g).set_ups >= 1 and cg.stats(g).replays >= 6, _stats(g)


def test_control_generate_with_a_kept_cache_reset_and_beam_search(sim, device_counter):
    ref, g, config = _pair()
    rc, c = _static(config, 24), _static(config, 24)
    for length in (4, 4):
        rc.reset()
        c.reset()
        ids = torch.randint(1, 64, (1, length))
        want = ref.generate(ids, past_key_values=rc, disable_compile=True, **_GEN)
        got = g.generate(ids, past_key_values=c, **_GEN)
        assert _same_generate(got, want) and _same_cache(rc, c), length
    ids = torch.randint(1, 64, (1, 4))
    want = ref.generate(ids, num_beams=2, num_return_sequences=2,
                        cache_implementation="static", disable_compile=True, **_GEN)
    got = g.generate(ids, num_beams=2, num_return_sequences=2, cache_implementation="static",
                     **_GEN)
    assert _same_generate(got, want)


def test_control_static_and_dynamic_caches_on_one_model_and_crop(sim, device_counter):
    ref, g, config = _pair()
    for n, kind in enumerate("sds"):
        make = (lambda: _static(config)) if kind == "s" else (lambda: DynamicCache(config=config))
        rc, c = make(), make()
        _decode(ref, g, rc, c, torch.randint(1, 64, (1, 4)), what=f"{kind}{n}")
        if kind == "d":  # crop, then continue on the cropped DynamicCache
            rc.crop(-2)
            c.crop(-2)
            _decode(ref, g, rc, c, torch.randint(1, 64, (1, 2)), steps=2, what=f"crop{n}")
    assert cg.stats(g).replays >= 2, _stats(g)


def test_control_one_cache_two_models_and_positional_calls(sim, device_counter):
    ref1, g1, config = _pair()
    torch.manual_seed(1)
    ref2 = transformers.LlamaForCausalLM(config).eval()
    g2 = cg.graphify(copy.deepcopy(ref2))
    rc, c = _static(config), _static(config)
    x = torch.randint(1, 64, (1, 4))
    for t in range(4):
        for ref, g in ((ref1, g1), (ref2, g2)):
            want = ref(x, past_key_values=rc, use_cache=True).logits
            got = g(x, past_key_values=c, use_cache=True).logits
            _check(got, want, rc, c, f"step {t}")
        x = want[:, -1:].argmax(-1)
    rc.reset()
    c.reset()
    _decode(ref1, g1, rc, c, torch.randint(1, 64, (1, 4)), positional=True, what="positional")
    _decode(ref1, g1, rc, c, torch.randint(1, 64, (1, 1)), steps=2, what="keyword again")
    assert cg.stats(g1).replays >= 2 and cg.stats(g2).replays >= 2


def test_control_hybrid_sliding_window_static_cache_runs_eagerly(sim, device_counter):
    """Qwen2 with a sliding layer: StaticSlidingWindowLayer bumps a Python int every update
    (a side effect): every call of the model eager, correct; each cache probed twice, then
    demoted (an opaque object: the pieces around it graphed, no probe per step)."""
    ref, config = _llama(transformers.Qwen2Config, vocab_size=64, hidden_size=32,
                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, use_sliding_window=True, sliding_window=4,
                         max_window_layers=1, pad_token_id=0)
    g = cg.graphify(copy.deepcopy(ref))
    for n in range(2):
        rc, c = _static(config, 12), _static(config, 12)
        _decode(ref, g, rc, c, torch.randint(1, 64, (1, 3)), steps=6, what=f"sliding {n}")
    s = cg.stats(g)
    assert sum(n for r, n in s.eager_calls.items() if "side effect" in r) == 4, _stats(g)
    assert s.replays >= 10, _stats(g)  # the pieces around the caches
