"""Review of b8b877a (the replay fast path ``Fast`` under grad mode for inference graphs): what
the slow path decides for a grad-mode call, against what the fast path replays.

Findings are ``xfail(strict=True)`` tests; every other test is a control that passes. Each
compares with an eager twin bitwise: outputs, ``requires_grad``/``grad_fn``, gradients.

- F1 (b8b877a): a first call inside a ``graph_region`` that runs a module outside the
  callable's tree (a graphed function's modules, a helper held outside the module tree) is
  keyed with the grad pattern of the statics *before* the forward adopted that module; its
  inference graph replays once (a region's first call replays) and ``Fast.make`` then records
  the pattern *after* adoption (with trainable parameters in it). Every later grad-mode call
  replays the inference graph fast: no ``grad_fn``, no gradient. The slow path keys those calls
  with the full pattern and captures a training graph (the control with ``Fast.make`` off).
- Pre-existing (the slow path replays the same; not enabled by b8b877a): that region first call
  itself; forward-mode AD tangents; a plain tensor attribute or closure tensor that starts
  requiring grad; ``enable_grad`` inside forward under a ``no_grad`` caller; ``torch.func.grad``
  over a graphified module called with a plain tensor (raises).
"""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

import cudagraphify as cg
from cudagraphify import _engine
from cudagraphify._fast import Fast

# the frozen pair, its state and its warm-up calls of tests/test_fast_grad.py
from test_fast_grad import _frozen_pair, _state, _warm

pytestmark = pytest.mark.usefixtures("quiet")


def _pair_of(make, frozen: bool = True):
    """``make()`` (seeded with 0; frozen unless ``frozen`` is False) and a graphified copy."""
    torch.manual_seed(0)
    ref = make()
    if frozen:
        ref.requires_grad_(False)
    return ref, cg.graphify(copy.deepcopy(ref))


def _same_autograd(out, want) -> bool:
    return torch.equal(out, want) and out.requires_grad == want.requires_grad and \
        (out.grad_fn is None) == (want.grad_fn is None)


def _backward_both(out, want, note=""):
    """``out`` and eager's ``want`` alike (values, requires_grad, grad_fn), then the backward of
    each one's sum."""
    assert _same_autograd(out, want), note
    out.sum().backward()
    want.sum().backward()


def _same_weight_grad_then_cleared(m, m_ref):
    assert torch.equal(m.weight.grad, m_ref.weight.grad)
    m.zero_grad(set_to_none=True)
    m_ref.zero_grad(set_to_none=True)


# -- F1: a region's first call adopts a module whose parameters require grad ------------------

def _adopting_function():
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)  # trainable, outside any graphified module's tree
    ref_lin = copy.deepcopy(lin)
    f = cg.graphify(lambda x: lin(x))
    return lin, ref_lin, f


def _later_calls_in_region(f, lin, ref_lin, calls: int = 3):
    """Calls 2.. inside a region under grad mode: each output and its weight gradient against
    eager's. Returns the first mismatch, or None."""
    with torch.enable_grad(), cg.graph_region():
        f(torch.randn(2, 8))  # the first call (pre-existing: see the test below)
        lin.zero_grad(set_to_none=True)
        for i in range(calls):
            x = torch.randn(2, 8)
            out, want = f(x), ref_lin(x)
            if not _same_autograd(out, want):
                return f"call {i + 2}: requires_grad {out.requires_grad} vs {want.requires_grad}"
            out.sum().backward()
            want.sum().backward()
            if not torch.equal(lin.weight.grad, ref_lin.weight.grad):
                return f"call {i + 2}: weight.grad differs"
            lin.zero_grad(set_to_none=True)
            ref_lin.zero_grad(set_to_none=True)
    return None


# F1 (b8b877a), fixed: Fast.make recorded the grad pattern after the first call adopted a
# trainable module; later grad-mode calls replayed the inference graph fast, with no grad_fn
def test_f1_region_graphed_function_adopting_a_trainable_module_keeps_autograd(sim):
    lin, ref_lin, f = _adopting_function()
    assert _later_calls_in_region(f, lin, ref_lin) is None


def test_f1_control_the_slow_path_decides_a_training_graph(sim, monkeypatch):
    monkeypatch.setattr(_engine.Fast, "make", staticmethod(lambda *a, **k: None))
    lin, ref_lin, f = _adopting_function()
    assert _later_calls_in_region(f, lin, ref_lin) is None


def test_f1_control_outside_a_region_the_second_call_is_a_training_graph(sim):
    lin, ref_lin, f = _adopting_function()
    with torch.enable_grad():
        for i in range(4):
            x = torch.randn(2, 8)
            out, want = f(x), ref_lin(x)
            _backward_both(out, want, i)
            _same_weight_grad_then_cleared(lin, ref_lin)


class _Outer(nn.Module):
    """A frozen module whose forward runs a trainable helper held outside its tree."""

    def __init__(self, helper: nn.Module):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.lin.requires_grad_(False)
        self.__dict__["helper"] = helper  # (not a submodule)

    def forward(self, x):
        return self.helper(self.lin(x))


# F1's variant (fixed): a helper outside the tree, adopted by the region's first call
def test_f1_region_module_with_a_trainable_helper_outside_its_tree_keeps_autograd(sim):
    torch.manual_seed(0)
    helper = nn.Linear(8, 8)
    ref = _Outer(copy.deepcopy(helper))
    g = cg.graphify(_Outer(helper))
    g.lin.load_state_dict(ref.lin.state_dict())
    with torch.enable_grad(), cg.graph_region():
        g(torch.randn(2, 8))
        for _ in range(3):
            x = torch.randn(2, 8)
            out, want = g(x), ref(x)
            assert type(_state(g)._fast) is not Fast or out.requires_grad
            _backward_both(out, want)
            _same_weight_grad_then_cleared(helper, ref.helper)


# (fixed: the first call runs eagerly, not remembered, once it adopted trainable parameters)
def test_pre_region_first_call_adopting_a_trainable_module_keeps_autograd(sim):
    lin, ref_lin, f = _adopting_function()
    with torch.enable_grad(), cg.graph_region():
        x = torch.randn(2, 8)
        assert _same_autograd(f(x), ref_lin(x))


# -- pre-existing, both paths ------------------------------------------------------------------

# (fixed: calls inside a dual level run eagerly; entering one moves the flags' counter, so the
# fast path made outside misses)
@pytest.mark.parametrize("grad", [True, False])
def test_pre_forward_ad_dual_input_keeps_its_tangent(sim, grad):
    ref, g = _frozen_pair()
    with torch.set_grad_enabled(grad):
        _warm(g, ref)
        with fwAD.dual_level():
            x, t = torch.randn(2, 8), torch.randn(2, 8)
            out = fwAD.unpack_dual(g(fwAD.make_dual(x, t)))
            want = fwAD.unpack_dual(ref(fwAD.make_dual(x, t)))
            assert torch.equal(out.primal, want.primal)
            assert out.tangent is not None and torch.equal(out.tangent, want.tangent)
        assert sum(n for why, n in cg.stats(g).eager_calls.items()
                   if "forward-mode AD" in why) == 1
        replays = cg.stats(g).replays
        _warm(g, ref, 3)  # (out of the level: graphed again)
        assert cg.stats(g).replays == replays + 3


class _Scaled(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = torch.randn(n, 8)  # a plain tensor attribute, not a parameter

    def forward(self, x):
        return self.lin(x) * self.scale[:2]


def _scale_requiring_grad_after_warm_up(ref, g):
    with torch.enable_grad():
        _warm(g, ref)
        ref.scale.requires_grad_(True)
        g.scale.requires_grad_(True)
        x = torch.randn(2, 8)
        assert _same_autograd(g(x), ref(x))


# (fixed: the held-tensor check of one tensor or a CPU scalar compares requires_grad too)
@pytest.mark.parametrize("n", [2, 100])
def test_pre_tensor_attribute_requiring_grad_later_keeps_autograd(sim, n):
    ref, g = _pair_of(lambda: _Scaled(n))
    _scale_requiring_grad_after_warm_up(ref, g)


def test_two_tensor_attributes_requiring_grad_later_run_eagerly(sim):
    # (control of the above: with two such tensors the held-tensor check is TensorGuards,
    # which sees requires_grad: the first call again refuses the read)
    class Two(_Scaled):
        def __init__(self):
            super().__init__(100)
            self.shift = torch.randn(100, 8)

        def forward(self, x):
            return super().forward(x) + self.shift[:2]

    ref, g = _pair_of(Two)
    _scale_requiring_grad_after_warm_up(ref, g)


# (fixed, as above)
def test_pre_closure_tensor_requiring_grad_later_keeps_autograd(sim):
    w = torch.randn(8)
    f = cg.graphify(lambda x: x * w)
    with torch.enable_grad():
        for _ in range(3):
            f(torch.randn(2, 8))
        w.requires_grad_(True)
        x = torch.randn(2, 8)
        assert _same_autograd(f(x), x * w)


class _GradInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        with torch.enable_grad():
            return self.lin(x)


# (fixed: such a first call's outputs carry an autograd graph: the signature runs eagerly)
def test_pre_enable_grad_inside_forward_under_no_grad_keeps_autograd(sim):
    ref, g = _pair_of(_GradInside, frozen=False)
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 8)
            assert _same_autograd(g(x), ref(x)), i


# (fixed: calls inside a torch.func transform run eagerly)
def test_pre_func_grad_over_a_plain_input_call(sim):
    ref, g = _frozen_pair()
    c = torch.randn(2, 8)
    with torch.enable_grad():
        _warm(g, ref)
        got = torch.func.grad(lambda s: (g(c) * s).sum())(torch.tensor(2.0))
    assert torch.equal(got, torch.func.grad(lambda s: (ref(c) * s).sum())(torch.tensor(2.0)))
    assert any("torch.func transform" in why for why in cg.stats(g).eager_calls)


# -- controls: what the fast path checks under grad mode ---------------------------------------

def test_trainable_module_fast_under_no_grad_then_grad_mode_is_a_training_graph(sim):
    ref, g = _pair_of(lambda: nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)),
                      frozen=False)
    with torch.no_grad():
        _warm(g, ref)
        assert type(_state(g)._fast) is Fast
    for _ in range(3):
        x = torch.randn(2, 8)
        out, want = g(x), ref(x)
        _backward_both(out, want)
        for p, q in zip(g.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
        g.zero_grad()
        ref.zero_grad()


def test_buffer_that_now_requires_grad_misses_the_inference_graph(sim):
    class Buf(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.register_buffer("shift", torch.randn(8))

        def forward(self, x):
            return self.lin(x) + self.shift

    ref, g = _pair_of(Buf)
    with torch.enable_grad():
        _warm(g, ref)
        assert type(_state(g)._fast) is Fast
        ref.shift.requires_grad_(True)
        g.shift.requires_grad_(True)
        x = torch.randn(2, 8)
        out, want = g(x), ref(x)
        _backward_both(out, want)
        assert torch.equal(g.shift.grad, ref.shift.grad)


def test_parameter_replaced_by_a_non_leaf_that_requires_grad(sim):
    ref, g = _frozen_pair()
    with torch.enable_grad():
        _warm(g, ref)
        leaves = []
        for m in (g, ref):  # the same memory, shape and stride: a non-leaf view of a leaf
            leaf = m[0].weight.detach().requires_grad_(True)
            leaves.append(leaf)
            m[0]._parameters["weight"] = leaf.view_as(leaf)
        for _ in range(3):
            x = torch.randn(2, 8)
            out, want = g(x), ref(x)
            _backward_both(out, want)
            assert torch.equal(leaves[0].grad, leaves[1].grad)
            leaves[0].grad = leaves[1].grad = None


def test_no_grad_inside_forward_of_a_frozen_module_under_grad_mode(sim):
    class NoGrad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            with torch.no_grad():
                return self.lin(x)

    ref, g = _pair_of(NoGrad, frozen=False)
    with torch.enable_grad():
        for _ in range(4):
            x = torch.randn(2, 8)
            assert _same_autograd(g(x), ref(x))
        ref.requires_grad_(False)
        g.requires_grad_(False)
        _warm(g, ref)
        assert type(_state(g)._fast) is Fast


def test_outputs_returning_an_input_or_a_frozen_parameter_as_they_are(sim):
    class Pass(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.lin.requires_grad_(False)

        def forward(self, x):
            return x, self.lin.weight, self.lin(x), x[1:]

    g = cg.graphify(Pass())
    with torch.enable_grad():
        for _ in range(4):
            x = torch.randn(2, 8)
            a, w, y, v = g(x)
            assert a is x and w is g.lin.weight and not y.requires_grad
            assert torch.equal(v, x[1:]) and v._base is x and v.grad_fn is None
        assert type(_state(g)._fast) is Fast
        x = torch.randn(2, 8, requires_grad=True)
        a, w, y, v = g(x)
        assert a is x and y.requires_grad and v.grad_fn is not None


def test_inference_mode_with_grad_enabled_then_plain_grad_mode(sim):
    ref, g = _frozen_pair()
    with torch.enable_grad():
        _warm(g, ref)
        fast = _state(g)._fast
        with torch.inference_mode(), torch.enable_grad():
            for _ in range(3):
                x = torch.randn(2, 8)
                out = g(x)
                assert torch.equal(out, ref(x)) and out.is_inference()
            assert _state(g)._fast is not fast
        x = torch.randn(2, 8)
        out = g(x)
        assert torch.equal(out, ref(x)) and not out.is_inference()


def test_autocast_on_then_off_under_grad_mode(sim):
    ref, g = _frozen_pair()
    with torch.enable_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for _ in range(4):
                x = torch.randn(2, 8)
                out, want = g(x), ref(x)
                assert out.dtype == want.dtype == torch.bfloat16 and torch.equal(out, want)
            assert type(_state(g)._fast) is Fast
        x = torch.randn(2, 8)
        out = g(x)
        assert out.dtype == torch.float32 and torch.equal(out, ref(x))


def test_anomaly_mode_and_autograd_multithreading_do_not_matter_for_inference(sim):
    ref, g = _frozen_pair()
    with torch.enable_grad():
        _warm(g, ref)
        with torch.autograd.detect_anomaly(check_nan=True):
            _warm(g, ref, 2)
        with torch.autograd.set_multithreading_enabled(False):
            _warm(g, ref, 2)
        assert cg.stats(g).eager == 0


def test_checkpointed_frozen_block_with_a_trainable_head_runs_eagerly_inside(sim):
    from torch.utils.checkpoint import checkpoint

    ref, g = _frozen_pair()
    torch.manual_seed(1)
    head = nn.Linear(8, 8)
    head_ref = copy.deepcopy(head)
    with torch.enable_grad():
        _warm(g, ref)
        for _ in range(3):
            x = torch.randn(2, 8)
            out = checkpoint(lambda t: head(g(t)), x, use_reentrant=False)
            want = checkpoint(lambda t: head_ref(ref(t)), x, use_reentrant=False)
            _backward_both(out, want)
            assert torch.equal(head.weight.grad, head_ref.weight.grad)
        assert any("saved-tensor hooks" in r for r in cg.stats(g).eager_calls)


def test_forward_hook_registered_after_the_fast_path_was_made(sim):
    ref, g = _frozen_pair()
    seen = []
    with torch.enable_grad():
        _warm(g, ref)
        assert type(_state(g)._fast) is Fast
        g.register_forward_hook(lambda m, a, o: seen.append(1))
        g[0].register_forward_hook(lambda m, a, o: seen.append(2))
        _warm(g, ref, 3)
    assert seen.count(1) == 3 and seen.count(2) == 3


def test_vmap_over_a_graphified_frozen_module_under_grad_mode(sim):
    ref, g = _frozen_pair()
    with torch.enable_grad():
        _warm(g, ref)
        xs = torch.randn(5, 2, 8)
        assert torch.equal(torch.func.vmap(g)(xs), torch.func.vmap(ref)(xs))
        c = torch.randn(2, 8)
        ss = torch.randn(5)
        got = torch.func.vmap(lambda s: g(c) * s)(ss)
        assert torch.equal(got, torch.func.vmap(lambda s: ref(c) * s)(ss))
        _warm(g, ref, 2)


def test_fsdp_like_resharding_turned_on_after_the_fast_path_was_made(sim):
    class Group:
        post_forward_mesh_info = None

    group = Group()

    class Sharded(nn.Sequential):
        def _get_fsdp_state(self):
            return type("S", (), {"_fsdp_param_group": group})()

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.GELU())
    ref.requires_grad_(False)
    g = cg.graphify(Sharded(*copy.deepcopy(ref)))
    with torch.enable_grad():
        _warm(g, ref)
        assert type(_state(g)._fast) is Fast
        group.post_forward_mesh_info = object()
        _warm(g, ref, 2)
    assert any("reshard_after_forward" in r for r in cg.stats(g).eager_calls)


def test_piece_of_a_piecewise_plan_frozen_then_unfrozen_under_grad_mode(sim):
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Sequential(nn.Linear(8, 8), nn.GELU())
            self.head = nn.Linear(8, 8)

        def forward(self, x):
            h = self.enc(x)
            if h.sum() > 1e9:  # a host sync: piecewise
                h = h * 0
            return self.head(h)

    torch.manual_seed(0)
    ref = Root()
    ref.enc.requires_grad_(False)
    g = cg.graphify(copy.deepcopy(ref))
    with torch.enable_grad():
        for step in range(8):
            if step == 5:
                for m in (g, ref):
                    m.enc[0].weight.requires_grad_(True)
            x = torch.randn(2, 8)
            out, want = g(x), ref(x)
            _backward_both(out, want)
            for p, q in zip(g.parameters(), ref.parameters()):
                assert (p.grad is None) == (q.grad is None)
                assert p.grad is None or torch.equal(p.grad, q.grad)
            g.zero_grad()
            ref.zero_grad()
            if step == 4:
                assert type(_state(g.enc)._fast) is Fast


def test_region_alias_saved_by_a_trainable_head_survives_the_next_fast_replay(sim):
    ref, g = _frozen_pair()
    torch.manual_seed(1)
    head = nn.Linear(8, 8)
    head_ref = copy.deepcopy(head)
    with torch.enable_grad(), cg.graph_region():
        _warm(g, ref)
        assert type(_state(g)._fast) is Fast
        x1, x2 = torch.randn(2, 8), torch.randn(2, 8)
        loss = head(g(x1) * 1.5).sum()  # the alias dropped; (y * 1.5) saved by the head
        loss2 = (head(g(x1)) * g(x2)).sum()  # an alias saved by the product, then a replay
        want = head_ref(ref(x1) * 1.5).sum()
        want2 = (head_ref(ref(x1)) * ref(x2)).sum()
        assert torch.equal(loss, want) and torch.equal(loss2, want2)
        (loss + loss2).backward()
        (want + want2).backward()
        assert torch.equal(head.weight.grad, head_ref.weight.grad)


def test_region_parameter_unfrozen_between_fast_calls(sim):
    ref, g = _frozen_pair()
    with torch.enable_grad(), cg.graph_region():
        _warm(g, ref)
        assert type(_state(g)._fast) is Fast
        for m in (g, ref):
            m[2].weight.requires_grad_(True)
        x = torch.randn(2, 8)
        out, want = g(x), ref(x)
        _backward_both(out, want)
        assert torch.equal(g[2].weight.grad, ref[2].weight.grad)


def test_grad_mode_in_another_thread_does_not_leak(sim):
    ref, g = _frozen_pair()
    torch.manual_seed(0)
    train = nn.Linear(8, 8)
    tg = cg.graphify(copy.deepcopy(train))
    with torch.enable_grad():
        _warm(g, ref)
    errors = []

    def worker():
        try:
            with torch.no_grad():
                for _ in range(3):
                    x = torch.randn(2, 8)
                    assert torch.equal(tg(x), train(x))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert not errors
    x = torch.randn(2, 8)
    out = tg(x)  # grad mode here: a training call, whatever the thread made fast
    assert out.requires_grad and torch.equal(out, train(x))


def test_saved_tensor_hooks_entered_after_the_fast_path_was_made_run_eagerly(sim):
    ref, g = _frozen_pair()
    with torch.enable_grad():
        _warm(g, ref)
        fast = _state(g)._fast
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autograd.graph.save_on_cpu():
                x = torch.randn(2, 8)
                assert torch.equal(g(x), ref(x))
        assert _state(g)._fast is not fast
        assert any("saved-tensor hooks" in r for r in cg.stats(g).eager_calls)
