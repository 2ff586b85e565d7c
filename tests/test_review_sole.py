"""Review of the sole-holder rule of ``cudagraphify/_outobjects.py`` (f7978a1, 8e9bf51):
``see_through`` sees a returned ``DynamicCache`` through only where nothing but the output's
containers hold it (``_others(x, holders) == _ALONE``), once, and ``_describe`` only where each
layer is held by the ``layers`` list alone.

``test_finding*`` were strict xfails on the code reviewed (8e9bf51): findings 1-5 are fixed
(the layers list's own holders counted, children taken with no closure, the output itself a
cache, a dict's keys and a ModelOutput's non-field attributes not counted, and such an
attribute refusing the output plan); finding 6 stays (a documented limitation).
``test_control_*`` are scenarios checked and found correct; ``test_note_*`` record what was
seen outside the function reviewed. Every output is compared with an eager twin
(``copy.deepcopy`` before graphify), bitwise, and the counters say which path ran.

CPU, simulated backend (fixture ``sim``), ``torch.cuda.is_current_stream_capturing``
answering as the double captures (as tests/test_returned_cache.py does).
(The reviewer also ran a plain-Python copy of the counting under Python 3.11, 3.12 and 3.13:
the same calibration and answers on all three; that copy is not kept, the library changed.)"""

from __future__ import annotations

import copy
import itertools
import warnings
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402

import cudagraphify as cg  # noqa: E402
from cudagraphify import _outobjects  # noqa: E402


@pytest.fixture(autouse=True)
def _captured_path(sim, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: sim.capturing)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        yield


_REFUSED = "returns an object of type DynamicCache"


def _counts(g):
    s = cg.stats(g)
    return s.captures, s.replays, dict(s.eager_calls)


def _graphed(g, calls=3) -> bool:
    """One graph, replayed on every later call, no eager call."""
    return _counts(g) == (1, calls - 1, {})


def _refused(g) -> bool:
    """Every call of the module itself ran eagerly because of the returned cache (its
    submodules may be graphed as pieces since e3c376d: the module's own counters)."""
    from cudagraphify.api import _state_of
    s = _state_of(g)
    return s.replays == 0 and bool(s.eager_calls) and all(_REFUSED in r for r in s.eager_calls)


def _same_cache(a, b) -> bool:
    return (type(a) is type(b) and len(a.layers) == len(b.layers) and all(
        type(x) is type(y) and vars(x).keys() == vars(y).keys()
        and torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
        for x, y in zip(a.layers, b.layers)))


def _step(n=1):
    torch.manual_seed(100 + n)
    k = torch.randn(1, 1, n, 4)
    return k, k + 1


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


def _qwen2():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1,
                                   vocab_size=64, max_position_embeddings=64)
    return transformers.Qwen2ForCausalLM(cfg).eval()


_G: dict = {}
_WEAK = weakref.WeakValueDictionary()


class _Makes(torch.nn.Module):
    """Makes a DynamicCache in forward and returns it, in the shape ``how`` names."""

    def __init__(self, how: str):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.how = how

    def forward(self, x):
        c = DynamicCache()
        k = self.lin(x)[None, None]
        c.update(k, k * 2, 0)
        how = self.how
        if how == "shared_list":  # two caches, one layers list
            c2 = DynamicCache()
            c2.layers = c.layers
            return k.sum(), c, c2
        if how == "shared_layer":  # two caches, one layer object in two lists
            c2 = DynamicCache()
            c2.layers = [c.layers[0]]
            return k.sum(), c, c2
        if how == "global_list":
            _G["layers"] = c.layers
        if how == "global_cache":
            _G["cache"] = c
        if how == "module_list":
            self.last = c.layers
        if how == "weak":
            _WEAK["cache"] = c
        if how == "input_keys":
            c.layers[0].keys = x
        if how == "layers_in_output":
            return k.sum(), c, c.layers
        if how == "dict_in_output":
            return k.sum(), c, c.__dict__
        if how == "as_dict_key":
            return {"cache": c, c: k.sum()}
        if how == "cache_first":
            return c, k.sum()
        if how == "dict_cache_first":
            return {"cache": c, "logits": k.sum()}
        if how == "alone":
            return c
        if how == "output_extra_cache":
            out = CausalLMOutputWithPast(logits=k.sum(), past_key_values=c)
            out.cache = c  # (an attribute, not a field: no item of the ModelOutput)
            return out
        if how == "output_extra_tensor":
            out = CausalLMOutputWithPast(logits=k.sum(), past_key_values=c)
            out.extra = k
            return out
        return k.sum(), c


def _run(how, calls=3):
    ref = _Makes(how)
    g = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    pairs = []
    for _ in range(calls):
        got = g(x)
        seen = dict(_G), _WEAK.get("cache")  # (what the graphed call left there)
        want = ref(x)
        pairs.append((got, want, seen))
    return g, x, pairs


# -- finding 1: a layers list shared by two returned caches comes back as two lists ----------

def test_finding1_layers_list_shared_by_two_returned_caches():
    g, _, pairs = _run("shared_list")
    got, want, _ = pairs[-1]
    assert torch.equal(got[0], want[0])
    assert _same_cache(got[1], want[1]) and _same_cache(got[2], want[2])
    assert want[1].layers is want[2].layers
    k, v = _step()
    got[1].update(k, v, 0)
    want[1].update(k, v, 0)
    assert want[2].get_seq_length() == 4  # (eager: one list, one layer: the other cache grew)
    assert got[2].get_seq_length() == want[2].get_seq_length()  # replay: 3
    assert _refused(g) or got[1].layers is got[2].layers


# -- finding 2: the layers list kept elsewhere (a global) is a new list on replay -----------

def test_finding2_layers_list_kept_in_a_global():
    g, _, pairs = _run("global_list")
    got, want, (seen, _) = pairs[-1]
    assert torch.equal(got[0], want[0]) and _same_cache(got[1], want[1])
    assert _G["layers"] is want[1].layers  # eager: the global is the returned cache's list
    assert _refused(g) or seen["layers"] is got[1].layers  # replay: the capture's list


# -- finding 3: a cache that comes first in the output is refused (order, gc) ------------------

@pytest.mark.parametrize("how", ["cache_first", "dict_cache_first"])
def test_finding3_cache_first_in_the_output_runs_eagerly(how):
    g, _, pairs = _run(how)
    for got, want, _ in pairs:
        if how == "cache_first":
            assert _same_cache(got[0], want[0]) and torch.equal(got[1], want[1])
        else:
            assert _same_cache(got["cache"], want["cache"])
            assert torch.equal(got["logits"], want["logits"])
    assert not _refused(g)
    assert _graphed(g), _counts(g)


class _Wrap(torch.nn.Module):
    def __init__(self, m, how):
        super().__init__()
        self.m = m
        self.how = how

    def forward(self, ids):
        if self.how == "pkv_alone":
            return self.m(ids).past_key_values
        if self.how == "cache_first":
            logits, cache = self.m(ids, return_dict=False)
            return cache, logits
        if self.how == "dict_cache_first":
            out = self.m(ids)
            return {"cache": out.past_key_values, "logits": out.logits}
        if self.how == "dict_logits_first":
            out = self.m(ids)
            return {"logits": out.logits, "cache": out.past_key_values}
        if self.how == "return_dict_false":
            return self.m(ids, return_dict=False)
        return self.m(ids)


def _hf(make, how, calls=3):
    ref = _Wrap(make(), how)
    g = cg.graphify(copy.deepcopy(ref))
    ids = torch.randint(0, 64, (1, 6))
    return g, [(g(ids), ref(ids)) for _ in range(calls)]


def _cache_and_logits(out):
    if isinstance(out, DynamicCache):
        return out, None
    if isinstance(out, dict) and "cache" in out:
        return out["cache"], out["logits"]
    if isinstance(out, tuple):
        return (out[0], out[1]) if isinstance(out[0], DynamicCache) else (out[1], out[0])
    return out.past_key_values, out.logits


@pytest.mark.parametrize("how", ["cache_first", "dict_cache_first"])
def test_finding3_hf_wrapper_cache_before_logits_runs_eagerly(how):
    g, pairs = _hf(_llama, how)
    for got, want in pairs:
        gc_, gl = _cache_and_logits(got)
        wc, wl = _cache_and_logits(want)
        assert _same_cache(gc_, wc) and torch.equal(gl, wl)
    assert _graphed(g), _counts(g)


# -- finding 4: a cache returned alone is refused (see_through's own ``out``) ---------------

@pytest.mark.parametrize("which", ["module", "hf_wrapper"])
def test_finding4_cache_returned_alone_runs_eagerly(which):
    if which == "module":
        g, _, pairs = _run("alone")
        pairs = [(got, want) for got, want, _ in pairs]
    else:
        g, pairs = _hf(_llama, "pkv_alone")
    for got, want in pairs:
        assert _same_cache(got, want)
    assert _graphed(g), _counts(g)


# -- finding 5: an attribute of a ModelOutput (not a field) is lost on replay ----------------

def test_finding5_model_output_attribute_holding_the_cache():
    g, _, pairs = _run("output_extra_cache")
    got, want, _ = pairs[-1]
    assert torch.equal(got.logits, want.logits)
    assert _same_cache(got.past_key_values, want.past_key_values)
    assert want.cache is want.past_key_values
    assert getattr(got, "cache", None) is got.past_key_values  # replay: no attribute


def test_finding5_model_output_attribute_holding_a_tensor():
    g, _, pairs = _run("output_extra_tensor")
    got, want, _ = pairs[-1]
    assert torch.equal(got.logits, want.logits)
    assert torch.equal(getattr(got, "extra", torch.empty(0)), want.extra)
    # (fixed: _replay._attributes_kept refuses such an output: the call runs eagerly)
    assert any("carrying the attribute 'extra'" in r for r in cg.stats(g).eager_calls)


# -- finding 6: a weak registry of the cache (documented class of side effect) --------------

@pytest.mark.xfail(strict=True, reason="finding 6 (documented side-effect class): a weak "
                   "reference is no count: a cache the forward also put in a "
                   "WeakValueDictionary is seen through; the registry never holds the replay's")
def test_finding6_cache_in_a_weak_registry():
    g, _, pairs = _run("weak")
    got, want, (_, weak_seen) = pairs[-1]
    assert _same_cache(got[1], want[1])
    assert _WEAK.get("cache") is want[1]  # eager: the registry names the returned cache
    assert _refused(g) or weak_seen is got[1]


# -- controls ---------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [_llama, _gpt2, _qwen2], ids=["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("how", ["plain", "return_dict_false", "dict_logits_first"])
def test_control_hf_paths_are_one_graph(make, how):
    g, pairs = _hf(make, how, calls=4)
    caches = []
    for got, want in pairs:
        gc_, gl = _cache_and_logits(got)
        wc, wl = _cache_and_logits(want)
        assert torch.equal(gl, wl) and _same_cache(gc_, wc)
        assert type(gc_) is DynamicCache
        caches.append(gc_)
    assert _graphed(g, 4), _counts(g)
    assert len({id(c) for c in caches}) == 4  # (a new object every replay)
    assert len({id(c.layers) for c in caches}) == 4


def test_control_one_layer_in_two_returned_caches_runs_eagerly():
    g, _, pairs = _run("shared_layer")
    got, want, _ = pairs[-1]
    assert _refused(g)
    assert got[1].layers[0] is got[2].layers[0] and want[1].layers[0] is want[2].layers[0]
    assert _same_cache(got[1], want[1]) and _same_cache(got[2], want[2])


@pytest.mark.parametrize("how", ["layers_in_output", "dict_in_output", "as_dict_key",
                                 "global_cache"])
def test_control_cache_reached_otherwise_runs_eagerly(how):
    g, _, pairs = _run(how)
    assert _refused(g), _counts(g)
    got, want, _ = pairs[-1]
    if how == "layers_in_output":
        assert got[2] is got[1].layers and want[2] is want[1].layers
    elif how == "dict_in_output":
        assert got[2] is got[1].__dict__
    elif how == "as_dict_key":
        key = next(k for k in got if not isinstance(k, str))
        assert key is got["cache"]
    else:
        assert _G["cache"] is want[1]


def test_control_layers_list_kept_on_the_module_is_not_one_graph():
    """(the guard sees the attribute set on every call: not the sole-holder rule)"""
    ref = _Makes("module_list")
    g = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    for _ in range(3):
        got, want = g(x), ref(x)
        assert torch.equal(got[0], want[0]) and _same_cache(got[1], want[1])
        assert g.last is got[1].layers  # (the forward's own Python ran)
    from cudagraphify.api import _state_of
    assert _state_of(g).replays == 0  # (the module itself runs eagerly every call)


def test_control_cache_keys_that_are_the_argument():
    g, x, pairs = _run("input_keys")
    assert _graphed(g), _counts(g)
    for got, want, _ in pairs:
        assert got[1].layers[0].keys is x and want[1].layers[0].keys is x
        assert _same_cache(got[1], want[1])


def test_control_cache_second_in_the_output_is_one_graph():
    g, _, pairs = _run("plain")
    assert _graphed(g), _counts(g)
    for got, want, _ in pairs:
        assert torch.equal(got[0], want[0]) and _same_cache(got[1], want[1])


@pytest.mark.parametrize("pattern", ["TF", "FT", "TTF", "TFT", "FTT", "TTTF"])
def test_control_runs_that_decide_differently(pattern, monkeypatch):
    """Finding 3 makes the decision depend on when gc runs: the runs of one first call may
    decide differently. Each mix gives eager's result (eagerly or from a graph)."""
    real = _outobjects.see_through
    seq = itertools.chain(pattern, itertools.repeat(pattern[-1]))
    monkeypatch.setattr(_outobjects, "see_through",
                        lambda out: real(out) if next(seq) == "T" else out)
    g, _, pairs = _run("plain")
    for got, want, _ in pairs:
        assert type(got[1]) is DynamicCache
        assert torch.equal(got[0], want[0]) and _same_cache(got[1], want[1])
    assert _graphed(g) or _refused(g), _counts(g)


def test_control_calibration_matches_both_call_shapes():
    """_ALONE is what see_through's loop and _describe's loop count for a sole object here."""
    c = DynamicCache()
    k = torch.randn(1, 1, 2, 4)
    c.update(k, k, 0)
    out = (k.sum(), c)
    del c
    node = _outobjects.see_through(out)[1]
    assert type(node) is _outobjects.SeenThrough
    assert _outobjects._ALONE == 3


# -- notes: HF paths that do not reach _outobjects (refused before, elsewhere) ---------------

def test_note_output_hidden_states_is_pieces_for_a_hook_not_the_cache():
    ref = _llama()
    g = cg.graphify(copy.deepcopy(ref))
    ids = torch.randint(0, 64, (1, 6))
    for _ in range(3):
        got, want = g(ids, output_hidden_states=True), ref(ids, output_hidden_states=True)
        assert torch.equal(got.logits, want.logits)
        assert _same_cache(got.past_key_values, want.past_key_values)
        assert all(torch.equal(a, b) for a, b in zip(got.hidden_states, want.hidden_states))
    s = cg.stats(g)
    assert s.eager_calls and not any(_REFUSED in r for r in s.eager_calls)
    assert any("PYTHON_HOOK" in r for r in s.eager_calls)
