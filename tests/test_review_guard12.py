"""Review of 1fb9232 (guard11's findings fixed: weak proxies held through their target with an
epoch-bumping callback, the tree's classes by identity, enum members with attributes of their
own checked on every call, a method read from a module's class recorded, bucketed's kept
registries, ``tensors_in``'s ``seen``) and 024d847 (a set-up cache allocated in the set-up's
own CUDA memory pool; a pooled cache's graphs kept when it dies).

Findings (strict xfails at review, each failing because of the finding; all fixed since, plain
tests now; controls pass):

- G12-1 (stale, older; not covered by the G11-5 fix): a method read from torch's own files is
  not recorded (``_recording_getattribute`` skips frames in torch/ and cudagraphify/), so a
  helper of a torch module replaced on the instance after capture (``conv._conv_forward = f``,
  which Conv1d.forward reads as ``self._conv_forward``) moves the epoch and finds nothing
  changed: the graph replays the class's helper; eager runs the new one.
- G12-2 (cost, new in 1fb9232): a weak proxy whose target ``_proxy_target`` cannot tell (a
  proxy of a class: ``Cls.__init__`` has no ``__self__``; a proxy of an object whose
  ``__class__`` is a property) is Unguardable: every call runs eagerly, where 4bb8adf
  captured once and replayed.
- G12-3 (dead weight, new in 024d847): ``SetUp.apply`` marks a cache as pooled whenever the
  set-up has a pool, also where ``_allocating`` did not use it (inside a caller's stream
  capture): its graphs are then kept when it dies although its memory went elsewhere.

Not findings (measured on this CPU, 4bb8adf -> 1fb9232/024d847): a tiny HF Llama's dynamic
generate 59.5 -> 59.3 ms (same captures/replays/eager counts), its piecewise decode step 3499 ->
3385 us (noise), a module holding an enum member with an attribute of its own 48.6 -> 49.6 us
per call (the per-call _DictCheck; no enum of torch or transformers has such members).

Graphify runs through the simulated backend (conftest.py).
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _state
from cudagraphify._state import SetUp

from test_review_guard8 import Doubler, Tripler
from test_review_guard11 import SWAPPED, _outputs

pytestmark = pytest.mark.usefixtures("quiet")


# -- G12-1: a torch module's helper method replaced on the instance ------------------------------

class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv1d(1, 1, 1, bias=False)
        nn.init.ones_(self.c.weight)

    def forward(self, x):
        return self.c(x.view(1, 1, -1)).view(-1)


def test_g12_1_a_torch_modules_helper_replaced_on_the_instance_is_seen(sim):
    m = ConvNet()
    g = cg.graphify(m)
    helper = m.c._conv_forward  # (the class's, bound)

    def replace():
        m.c._conv_forward = lambda i, w, b: helper(i, w, b) * 3
    want = [1.0, 1.0, 1.0, 3.0, 3.0]
    ref = ConvNet()
    ref_helper = ref.c._conv_forward
    with torch.no_grad():  # (eager gives 3.0 after the replacement)
        ref.c._conv_forward = lambda i, w, b: ref_helper(i, w, b) * 3
        assert ref(torch.ones(2))[0].item() == 3.0
    assert _outputs(g, replace) == want


class UsesHelper(nn.Module):
    def __init__(self, helper):
        super().__init__()
        self.d = helper

    def forward(self, x):
        return self.d.apply_to(x)


def test_g12_1_control_a_user_method_replaced_on_the_instance_is_seen(sim):
    m = UsesHelper(Doubler())
    assert _outputs(cg.graphify(m), lambda: setattr(m.d, "apply_to", lambda x: x * 3)) \
        == SWAPPED


# -- method reads of modules that die: no stale replay, no recapture --------------------------

def test_control_a_submodule_replaced_by_one_with_its_own_method_is_seen(sim):
    """The method read's module (held weakly) dies: its read is no change, but the tree is."""
    m = UsesHelper(Doubler())

    def replace():
        new = Doubler()
        new.apply_to = lambda h: h * 3
        m.d = new
    assert _outputs(cg.graphify(m), replace) == SWAPPED


def test_control_a_submodule_replaced_by_another_class_is_seen(sim):
    m = UsesHelper(Doubler())
    assert _outputs(cg.graphify(m), lambda: setattr(m, "d", Tripler())) == SWAPPED


class Creates(nn.Module):
    def forward(self, x):
        return Doubler().run(x)  # (a module made and dropped by every call: its method read)


class WithSuper(Doubler):
    def apply_to(self, h):
        return super().apply_to(h) + 1


class UsesSuper(nn.Module):
    def __init__(self):
        super().__init__()
        self.d = WithSuper()

    def forward(self, x):
        return self.d.run(x)


@pytest.mark.parametrize("make", [Creates, UsesSuper], ids=["creates", "super"])
def test_control_method_reads_cause_no_recapture(sim, make):
    g = cg.graphify(make())
    ref = make()
    with torch.no_grad():
        for _ in range(10):
            x = torch.randn(2)
            assert torch.equal(g(x), ref(x))
    s = cg.stats(g)
    assert (s.captures, s.invalidations) == (1, 0) and s.replays >= 7, s


def test_control_hf_generate_has_no_invalidation(sim):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=256,
                                   pad_token_id=0)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    g = cg.graphify(copy.deepcopy(ref))
    gen = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        for _ in range(3):
            ids = torch.randint(1, 64, (1, 4))
            assert torch.equal(g.generate(ids, **gen), ref.generate(ids, **gen))
    s = cg.stats(g)
    assert s.invalidations == 0 and not s.reasons and s.replays > 0, s


# -- G12-2: weak proxies whose target cannot be told ---------------------------------------------

class Scales:
    factor = 2.0


class HoldsClassProxy(nn.Module):
    def __init__(self):
        super().__init__()
        self.kind = weakref.proxy(Scales)  # (a proxy of a class)

    def forward(self, x):
        return x * self.kind.factor


class Masked:
    """An object that reports another class (a lazy or mock-like object)."""

    def __init__(self):
        self.k = 2.0

    @property
    def __class__(self):
        return dict


class HoldsMaskedProxy(nn.Module):
    def __init__(self, obj):
        super().__init__()
        self.obj = weakref.proxy(obj)

    def forward(self, x):
        return x * self.obj.k


@pytest.mark.parametrize("which", ["class", "masked"])
def test_g12_2_a_proxy_of_a_class_or_masked_object_is_graphed(sim, which):
    keep = Masked()
    m = HoldsClassProxy() if which == "class" else HoldsMaskedProxy(keep)
    g = cg.graphify(m)
    assert _outputs(g, n=6) == [2.0] * 6
    s = cg.stats(g)
    assert (s.captures, sum(s.eager_calls.values())) == (1, 0), dict(s.eager_calls)


def test_g12_2_control_a_proxy_of_a_plain_object_is_graphed(sim):
    class Plain:
        def __init__(self):
            self.k = 2.0
    keep = Plain()
    g = cg.graphify(HoldsMaskedProxy(keep))
    assert _outputs(g, n=6) == [2.0] * 6
    s = cg.stats(g)
    assert (s.captures, sum(s.eager_calls.values())) == (1, 0), dict(s.eager_calls)


def test_g12_2_control_a_dead_proxys_graph_raises_as_eager(sim):
    class Plain:
        def __init__(self):
            self.k = 2.0
    holder = [Plain()]
    g = cg.graphify(HoldsMaskedProxy(holder[0]))
    assert _outputs(g, lambda: holder.clear(), n=5) == [2.0] * 3 + ["ReferenceError"] * 2


# -- G12-3: a cache set up during a caller's capture is marked pooled ----------------------------

class _Layer:
    def __init__(self):
        self.keys = None


class _Cache:
    def __init__(self):
        self.layers = [_Layer()]

    def early_initialization(self, **kwargs):
        for layer in self.layers:
            layer.keys = torch.zeros(2)


@pytest.fixture
def capturing(monkeypatch):
    """A CUDA set-up, as seen from inside a caller's stream capture (``_allocating`` then
    allocates in the capture's pool, not the set-up's)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    first = _Cache()
    first.early_initialization()
    set_up = SetUp({"device": "cuda"}, _state.state_layout([first])[0])
    set_up.pool = "the set-up's pool"  # (made by an earlier set-up, outside any capture)
    return set_up


def test_g12_3_a_cache_set_up_outside_the_pool_is_not_pooled(capturing):
    context, in_pool = capturing._allocating()
    assert context.__class__.__name__ == "nullcontext" and not in_pool  # (not the pool)
    cache = _Cache()
    assert capturing.apply(cache)
    assert not _state.pooled(cache)


def test_g12_3_control_a_cpu_set_up_is_not_pooled():
    first = _Cache()
    first.early_initialization()
    set_up = SetUp({"device": "cpu"}, _state.state_layout([first])[0])
    cache = _Cache()
    assert set_up.apply(cache) and set_up.pool is None and not _state.pooled(cache)


# -- pooled caches: controls (emulated pool, tests/test_set_up.py) -------------------------------

from test_set_up import _pair, _recycling, pooled_set_ups  # noqa: E402,F401 (a fixture)
from test_set_up import H, D  # noqa: E402


@torch.no_grad()
def test_control_a_pooled_cache_whose_tensors_are_replaced_replays_its_own(sim,
                                                                           pooled_set_ups):
    """A set-up cache (marked pooled) whose tensors are then replaced outside the pool
    (``layer.keys = keys.clone()``): its calls key on the new addresses; the kept graphs of
    the dead pooled caches before it do not replay for it."""
    ref, g = _pair()
    free_ref, free = [], []
    make_ref, make = _recycling(free_ref), _recycling(free)
    for n in range(4):
        ref_cache, cache = make_ref(), make()
        x, pos = torch.randn(1, 4, H * D), torch.arange(4)
        for t in range(4):
            assert torch.equal(g(x, cache, pos), ref(x, ref_cache, pos)), (n, t)
            if n == 3 and t == 0:  # (set up and prefilled: moved out of the pool)
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
            x, pos = torch.randn(1, 1, H * D), torch.tensor([4 + t])
        del cache, ref_cache
        gc.collect()


@torch.no_grad()
def test_control_two_live_pooled_caches_interleaved(sim, pooled_set_ups):
    """Two caches of one set-up alive at once (a user serving two sequences): the second is
    given other memory, and each call gives eager's result."""
    ref, g = _pair()
    free_ref, free = [], []
    make_ref, make = _recycling(free_ref), _recycling(free)
    for n in range(3):
        pairs = [(make_ref(), make()) for _ in range(2)]
        xs = [(torch.randn(1, 4, H * D), torch.arange(4)) for _ in pairs]
        for t in range(4):
            for k, (rc, c) in enumerate(pairs):
                x, pos = xs[k]
                assert torch.equal(g(x, c, pos), ref(x, rc, pos)), (n, t, k)
                xs[k] = (torch.randn(1, 1, H * D), torch.tensor([4 + t]))
        del pairs
        gc.collect()
