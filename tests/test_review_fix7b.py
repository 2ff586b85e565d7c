"""Review of 313b2d5..812c03c (fix 7: ``_statics._kept_elsewhere(d, owner)`` with iterations,
generators and their views passing; explain watching before its snapshots; a rebased family
carrying ``grads_read``; under no_grad a static copy of an argument that requires grad requires
grad too). CPU, on the simulated backend (``sim``) or the share/rebase doubles; every scenario
is compared with a plain-PyTorch twin (no cudagraphify) bitwise.

Findings (all fixed since: their tests are plain tests; none was a regression of 812c03c: each fails at 313b2d5 too, and each
is left open beside what it fixed):

- SA silent: the static copy of an argument keeps the argument's ``requires_grad`` now (change
  3), but not the rest of the autograd/dispatch metadata a forward can branch on, and neither
  the key nor the probe looks at it: ``x.is_leaf`` (a non-leaf argument that requires grad,
  ``x = w * 1.0``: its copy is a leaf; under no_grad and under grad mode alike) and
  ``x.is_inference()`` (under ``inference_mode`` a normal argument's copy is an inference
  tensor). The capture takes the copy's branch and every replay returns it.
  ``test_sa_argument_metadata_the_copy_does_not_keep[is_leaf-no_grad|is_leaf-grad|
  is_inference]``. Gap: ``_replay.StaticInputs._build`` (the copy) / ``_probe.GRAD_READS``
  (``Tensor.is_leaf``, ``Tensor.is_inference`` not flagged).
- LA loud: an ``OrderedDict`` registry (a ``ModuleList`` after ``del layers[i]``/``pop()``,
  which 313b2d5 began watching; a model pickled by an older torch) iterated while the first
  call is made: ``for p in model.named_parameters()`` (L1's loop) or ``for layer in
  model.layers`` (a per-layer ablation loop). ``OrderedDict``'s iterator type
  (``odict_iterator``) is not in ``_statics._PASSING`` (dict iterators, frames, generators
  only), so the iteration counts as a holder: "ModuleList._modules is kept elsewhere too",
  every call eager for good. The same loop over a plain-dict model is graphed (controls).
  ``test_la_ordereddict_registry_iterated_at_the_first_call_runs_eagerly_for_good[...]``.
  Gap: ``_statics._PASSING``.
- LB loud: with ``num_warmup_iters > 1`` the extra warm-ups undo change 3:
  ``_warmups._warm_up_again`` sets its copies' ``requires_grad`` to ``first.training and
  ...`` (False under no_grad), so a forward that reads an argument's ``requires_grad`` takes
  the other path there; one that refuses an argument that does not require grad fails the
  extra warm-up and the root runs eagerly (piecewise), where ``num_warmup_iters=1`` graphs it.
  ``test_lb_extra_warmups_run_on_copies_that_do_not_require_grad``.

Also (no finding, measured): ``_kept_elsewhere``'s ``gc.get_referrers`` scans the heap once
per registry whose refcount trips (and once more per view): the first call of a 210-module
model inside ``for p in model.parameters()`` trips 3 registries, about 50 ms each beside a
300,000-object heap (0.15 s once).

Controls (plain tests, each proves a replay equal to eager): change 3 with an argument
written in place, returned and returned as a view, under no_grad / inference_mode / grad mode
in turn on one graphify, through ``capture_sizes``, a ``graph_region`` chain,
``copy_outputs=False``, share_graph (a requires_grad argument; one layer frozen while the
forward reads a weight's ``requires_grad``), a family whose argument's ``requires_grad``
pattern changes between caches and one whose parameter's pattern flips back and forth (still
rebased); change 1 on ``nn.MultiheadAttention``, ``nn.LSTM``, ``nn.Transformer``,
parametrizations, a ``torch.load``-ed model, a ModuleDict iterated in forward, a global
module, an ``OrderedDict`` registry with the first call outside the loop, the plain-dict
model inside both loops; HF GPT-2/Llama/BERT/T5 (where transformers imports) with no
"kept elsewhere" reason.
"""
from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict

import pytest
import torch
from torch import nn

import cudagraphify as cg

from test_rebase import _cache, _generate, _pair, _register as _register_cache, fam  # noqa: F401
from test_review_static_state import Net as CacheNet, _step
from test_share_engine import _distinct, _register, reading  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("quiet")

def _st(g) -> str:
    s = cg.stats(g)
    return f"captures={s.captures} replays={s.replays} eager={dict(s.eager_calls)}"


def _replays(g, at_least=1):
    s = cg.stats(g)
    if s.replays < at_least:
        pytest.fail(f"no replay: {_st(g)}")
    return s


# ============================== SA: argument metadata the copy does not keep =================

class ReadsLeaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        return self.l(x) * (2.0 if x.is_leaf else 3.0)


class ReadsInference(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        return self.l(x) * (2.0 if x.is_inference() else 3.0)


@pytest.mark.parametrize("case", ["is_leaf-no_grad", "is_leaf-grad", "is_inference"])
def test_sa_argument_metadata_the_copy_does_not_keep(sim, case):
    torch.manual_seed(0)
    ref = ReadsInference() if case == "is_inference" else ReadsLeaf()
    g = cg.graphify(copy.deepcopy(ref))
    ctx = {"is_leaf-no_grad": torch.no_grad, "is_leaf-grad": torch.enable_grad,
           "is_inference": torch.inference_mode}[case]
    for i in range(5):
        if case == "is_inference":
            x = torch.randn(4, 8)  # (made outside inference mode: a normal tensor)
        else:
            x = torch.randn(4, 8, requires_grad=True) * 1.0  # (a non-leaf: w * 1.0)
        with ctx():
            got, want = g(x), ref(x)
        assert torch.equal(got, want), f"call {i}: {_st(g)}"
    # (fixed: the read refuses the module that makes it, PYTHON_STATE; its Linear is graphed,
    # under grad mode a training graph whose backward never runs here: it replays less)
    _replays(g, 1)
    assert any("[PYTHON_STATE]" in r for r in cg.stats(g).eager_calls), _st(g)


# ============================== LA: an OrderedDict registry iterated at the first call =======

class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _stack(how: str):
    torch.manual_seed(0)
    ref = Stack()
    if how == "pruned":
        del ref.layers[3]  # (ModuleList.__delitem__ sets an OrderedDict _modules)
    g = copy.deepcopy(ref)
    if how == "old_pickle":  # (a model pickled by torch 1.x: every registry an OrderedDict)
        for m in g.modules():
            for attr in ("_parameters", "_buffers", "_modules"):
                m.__dict__[attr] = OrderedDict(m.__dict__[attr])
    return ref, cg.graphify(g)


def _loop_then_calls(ref, g, loop: str):
    x = torch.randn(4, 8)
    with torch.no_grad():
        if loop == "outside":
            assert torch.equal(g(x), ref(x))
        else:
            items = g.named_parameters() if loop == "named_parameters" else g.layers
            for _ in items:
                assert torch.equal(g(x), ref(x))
        for i in range(4):
            assert torch.equal(g(x), ref(x)), f"call {i}"
    s = cg.stats(g)
    assert s.captures >= 1 and s.replays >= 3 and not s.eager_calls, _st(g)


@pytest.mark.parametrize("how,loop", [("pruned", "named_parameters"), ("pruned", "layers"),
                                      ("old_pickle", "named_parameters"),
                                      ("old_pickle", "layers")])
def test_la_ordereddict_registry_iterated_at_the_first_call_runs_eagerly_for_good(
        sim, how, loop):
    ref, g = _stack(how)
    _loop_then_calls(ref, g, loop)


@pytest.mark.parametrize("how,loop", [("plain", "named_parameters"), ("plain", "layers"),
                                      ("pruned", "outside"), ("old_pickle", "outside")])
def test_control_la_plain_registries_in_the_loop_or_ordereddicts_outside(sim, how, loop):
    ref, g = _stack(how)
    _loop_then_calls(ref, g, loop)


# ============================== LB: extra warm-ups on copies without grad ====================

class NeedsGrad(nn.Module):
    """Refuses an input that does not require grad (an input-gradient model, run under
    no_grad for its values)."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        if not x.requires_grad:
            raise ValueError("x must require grad")
        return self.l(x)


@pytest.mark.parametrize("n", [1, 3])
def test_lb_extra_warmups_run_on_copies_that_do_not_require_grad(sim, n):
    torch.manual_seed(0)
    ref = NeedsGrad()
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=n)
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(4, 8, requires_grad=True)
            assert torch.equal(g(x), ref(x)), f"call {i}"
    s = _replays(g, 3)
    assert not s.eager_calls, _st(g)  # (n=3: "extra warm-up failed: ValueError", piecewise)


# ============================== controls: change 3 ==========================================

class ArgUses(nn.Module):
    def __init__(self, inplace=False):
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.inplace = inplace

    def forward(self, x):
        if self.inplace:
            x.add_(1)
        return self.l(x) * (2.0 if x.requires_grad else 3.0), x[1:], x


@pytest.mark.parametrize("inplace", [False, True])
def test_control_argument_requiring_grad_written_and_returned(sim, inplace):
    torch.manual_seed(0)
    ref = ArgUses(inplace)
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(4, 8, requires_grad=True)
            x2 = x.detach().clone().requires_grad_(True)
            got, want = g(x), ref(x2)
            for a, b in zip(got, want):
                assert torch.equal(a, b), f"call {i}"
                assert a.requires_grad == b.requires_grad
            assert got[2] is x and torch.equal(x, x2)
    _replays(g, 4)


def test_control_argument_requiring_grad_across_grad_modes(sim):
    torch.manual_seed(0)
    ref = Reads()
    g = cg.graphify(copy.deepcopy(ref))
    modes = [torch.no_grad, torch.inference_mode, torch.enable_grad]
    for k in range(9):
        ctx = modes[k % 3]
        x = torch.randn(4, 8, requires_grad=True)
        with ctx():
            got, want = g(x), ref(x)
        assert torch.equal(got, want) and got.requires_grad == want.requires_grad, (k, _st(g))
        if want.requires_grad:
            assert torch.equal(torch.autograd.grad(got.sum(), x)[0],
                               torch.autograd.grad(want.sum(), x)[0])
    _replays(g, 6)


class Reads(nn.Module):
    def __init__(self, n_in=8):
        super().__init__()
        self.l = nn.Linear(n_in, 8)

    def forward(self, x):
        return self.l(x) * (2.0 if x.requires_grad else 3.0)


def test_control_capture_sizes_with_arguments_requiring_grad(sim):
    torch.manual_seed(0)
    ref = Reads()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        cg.capture_sizes(g, lambda n: torch.randn(n, 8, requires_grad=True), [1, 2, 4],
                         progress=False)
        for n in [1, 2, 4, 1, 2, 4]:
            x = torch.randn(n, 8, requires_grad=True)
            assert torch.equal(g(x), ref(x)), n
    s = _replays(g, 6)
    assert s.captures == 3, _st(g)


class Split(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        return self.l(x) * (2.0 if x.requires_grad else 3.0), x[:, :4]


class Join(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 8)

    def forward(self, y, z):
        return self.l(z) * (2.0 if z.requires_grad else 3.0) + y


@pytest.mark.parametrize("mode", ["region", "copy_outputs_false"])
def test_control_chain_with_an_argument_requiring_grad(sim, mode):
    torch.manual_seed(0)
    ra, rb = Split(), Join()
    opts = dict(copy_outputs=False) if mode == "copy_outputs_false" else {}
    ga, gb = cg.graphify(copy.deepcopy(ra), **opts), cg.graphify(copy.deepcopy(rb), **opts)
    region = cg.graph_region() if mode == "region" else contextlib.nullcontext()
    with torch.no_grad(), region:
        for i in range(6):
            x = torch.randn(4, 8, requires_grad=True)
            y, z = ga(x)
            got = gb(y, z).clone()
            want = rb(*ra(x))
            assert torch.equal(got, want), (i, _st(ga), _st(gb))
    _replays(ga, 4)
    _replays(gb, 4)


class Blk(nn.Module):
    def __init__(self, read_weight=False):
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.read_weight = read_weight

    def forward(self, x):
        t = self.l.weight if self.read_weight else x
        return torch.tanh(self.l(x)) * (2.0 if t.requires_grad else 3.0)


class Blocks(nn.Module):
    def __init__(self, read_weight):
        super().__init__()
        self.blocks = nn.ModuleList([Blk(read_weight) for _ in range(4)])

    def forward(self, x):
        return sum(b(x) for b in self.blocks)


@pytest.mark.parametrize("read_weight", [False, True])
def test_control_share_graph_requires_grad(reading, read_weight):  # noqa: F811
    torch.manual_seed(0)
    ref = _distinct(Blocks(read_weight).eval())
    model = copy.deepcopy(ref)
    _register(model)
    group = cg.share_graph(model.blocks)
    with torch.no_grad():
        for i in range(8):
            if i == 4 and read_weight:  # (one layer frozen: its own capture)
                for m in (ref, model):
                    m.blocks[2].requires_grad_(False)
            x = torch.randn(2, 8, requires_grad=not read_weight)
            assert torch.equal(model(x), ref(x)), (i, group.stats())
    assert group.stats().retargets >= 3, group.stats()
    assert all(cg.stats(b).replays >= 6 for b in model.blocks)


class CacheArgGrad(CacheNet):
    def forward(self, x, cache, pos):
        return super().forward(x, cache, pos) * (2.0 if x.requires_grad else 3.0)


class CacheWeightGrad(CacheNet):
    def forward(self, x, cache, pos):
        out = super().forward(x, cache, pos)
        return out * (2.0 if self.projs[0].weight.requires_grad else 3.0)


def test_control_family_argument_requires_grad_pattern_changes(fam):  # noqa: F811
    ref, g = _pair(CacheArgGrad)
    kept = []
    for rg in (True, True, False, False, False, True):
        rc, c = _cache(), _cache()
        for t in range(3):
            _step(ref, g, rc, c, t, torch.randn(1, 1, 16, requires_grad=rg))  # (asserts)
            _register_cache(c)
        kept.append((rc, c))
    s = cg.stats(g)
    assert s.retargets >= 2 and s.replays >= 6, s


def test_control_family_parameter_pattern_flips_back_and_forth(fam):  # noqa: F811
    ref, g = _pair(CacheWeightGrad)
    kept = []
    for k in range(3):
        kept += [_generate(ref, g) for _ in range(3)]  # (asserts each step)
        for m in (ref, g):
            m.projs[0].requires_grad_(k % 2 == 1)
    s = cg.stats(g)
    assert s.retargets >= 4 and s.replays >= 10, s


# ============================== controls: change 1 on common modules =========================

class MHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.m = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.m(x, x, x, need_weights=False)[0]


class LSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.m = nn.LSTM(8, 8, batch_first=True)

    def forward(self, x):
        return self.m(x)[0]


class DenseBlock(nn.ModuleDict):
    def __init__(self):
        super().__init__({f"l{i}": nn.Linear(8, 8) for i in range(3)})

    def forward(self, x):
        for _, layer in self.items():
            x = x + layer(x)
        return x


torch.manual_seed(0)
HELPER = nn.Linear(8, 8)


class UsesGlobal(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return HELPER(self.a(x))


def _parametrized():
    import torch.nn.utils.parametrize as P

    class Sym(nn.Module):
        def forward(self, w):
            return w.triu() + w.triu(1).T

    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    P.register_parametrization(m[0], "weight", Sym())
    nn.utils.parametrizations.weight_norm(m[2])
    return m


class Tr(nn.Module):
    def __init__(self):
        super().__init__()
        self.t = nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, batch_first=True)

    def forward(self, x):
        return self.t(x, x)


@pytest.mark.parametrize("make", [MHA, LSTM, DenseBlock, UsesGlobal, _parametrized, Tr, "load"])
def test_control_common_modules_keep_their_graphs(sim, make, tmp_path):
    torch.manual_seed(0)
    if make == "load":
        ref = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        torch.save(ref, tmp_path / "m.pt")
        m = torch.load(tmp_path / "m.pt", weights_only=False)
    else:
        ref = make().eval()
        m = copy.deepcopy(ref)
    g = cg.graphify(m)
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(2, 3, 8)
            torch.testing.assert_close(g(x), ref(x))  # (MHA's fast path: other kernels)
    s = _replays(g, 3)
    assert not any("kept elsewhere" in r for r in s.eager_calls), _st(g)


def _hf(name):
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                              n_positions=64))
    if name == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=2, hidden_size=32,
                                                intermediate_size=64, num_attention_heads=2,
                                                num_key_value_heads=1, vocab_size=100))
    if name == "bert":
        return T.BertModel(T.BertConfig(num_hidden_layers=2, hidden_size=32,
                                        intermediate_size=64, num_attention_heads=2,
                                        vocab_size=100))
    return T.T5ForConditionalGeneration(T.T5Config(num_layers=2, d_model=32, d_ff=64,
                                                   num_heads=2, d_kv=16, vocab_size=100))


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5"])
def test_control_hf_models_keep_their_graphs(sim, name):
    ref = _hf(name).eval()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for _ in range(4):
            ids = torch.randint(0, 100, (2, 6))
            kw = dict(input_ids=ids)
            if name == "t5":
                kw["decoder_input_ids"] = ids
            if name != "bert":
                kw["use_cache"] = False
            a, b = g(**kw), ref(**kw)
            key = "last_hidden_state" if name == "bert" else "logits"
            torch.testing.assert_close(a[key], b[key])
    s = _replays(g, 2)
    assert not any("kept elsewhere" in r for r in s.eager_calls), _st(g)


# -- registries kept elsewhere are watched in place (their dict versions), not swapped: what a
# wrapper that keeps them sees (thunder's jitted module does) and the module's own attribute
# writes stay in step with eager

class _Holder:
    """Keeps a module's registries, as a jitting wrapper may."""

    def __init__(self, m):
        self.params, self.mods = m._parameters, m._modules


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.scale = 2.0

    def forward(self, x):
        return self.l(x) * self.scale


@pytest.mark.parametrize("change", ["parameter", "attribute", "submodule", "through holder"])
def test_a_registry_a_wrapper_keeps_is_checked_in_place(sim, change):
    torch.manual_seed(0)
    ref = _Scaled()
    g = copy.deepcopy(ref)
    holders = [_Holder(ref.l), _Holder(g.l), _Holder(ref), _Holder(g)]
    g = cg.graphify(g)
    with torch.no_grad():
        for i in range(6):
            if i == 3:
                for m, h in ((ref, holders[0]), (g, holders[1])):
                    torch.manual_seed(1)
                    if change == "parameter":
                        m.l.weight = nn.Parameter(torch.randn(8, 8))
                    elif change == "attribute":
                        m.scale = 3.0
                    elif change == "submodule":
                        m.l = nn.Linear(8, 8)
                    else:
                        h.params["bias"] = nn.Parameter(torch.randn(8))
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x)), f"call {i}"
    if change != "submodule":  # (left in place: the holder's is the module's)
        assert type(g.l._parameters) is dict and holders[1].params is g.l._parameters
    s = cg.stats(g)
    assert s.captures == 2 and s.replays >= 4 and not s.eager_calls, s
