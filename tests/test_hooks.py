"""Tensor hooks a forward registers (cudagraphify/_hooks.py): the signature is refused on its real
call (PYTHON_HOOK, the hook's qualname and file:line), probe or not, before any run beyond it;
those runs register none; hooks registered outside forward keep their graphs; submodules that
register none are graphed. CPU, on the ``sim`` double (see tests/test_review_writes3.py for the
review's findings G1-G7)."""

from __future__ import annotations

import itertools
import threading
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _hooks

from test_warmups import _twins

_REGISTER_HOOK = torch.Tensor.register_hook
_RETAIN_GRAD = torch.Tensor.retain_grad
_MULTI = torch.autograd.graph.register_multi_grad_hook


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _bump(t: torch.Tensor, v) -> None:
    with torch.no_grad():
        t.add_(v)


def _grads_equal(ref, g) -> bool:
    return all((p.grad is None) == (q.grad is None) and (p.grad is None
                                                          or torch.equal(p.grad, q.grad))
               for p, q in zip(ref.parameters(), g.parameters()))


def _reasons(g) -> dict:
    return dict(cg.stats(g).eager_calls)


def _train(ref, g, calls=4, *, region=False):
    """Forward and backward on both twins, compared bitwise (outputs, gradients, buffers and
    their versions)."""
    torch.manual_seed(1)
    for call in range(calls):
        x = torch.randn(3, 4)
        a, b = ref(x), g(x)
        a.sum().backward()
        b.sum().backward()
        assert torch.equal(a, b), call
        assert _grads_equal(ref, g), call
        for (n, r), q in zip(ref.named_buffers(), g.buffers()):
            assert torch.equal(r, q) and r._version == q._version, (call, n, r, q)


class _Net(nn.Module):
    """Registers ``how``'s hook in its forward; ``log`` and ``count`` show what the hook did."""

    def __init__(self, how: str):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)
        self.register_buffer("count", torch.zeros(()))
        self.how = how
        self.log: list = []

    def note(self, g):
        self.log.append(g.detach().clone())
        _bump(self.count, 1)

    def forward(self, x):
        h = self.lin(x)
        if torch.is_grad_enabled():
            how = self.how
            if how == "register_hook":
                h.register_hook(self.note)
            elif how == "post_accumulate":
                self.out.bias.register_post_accumulate_grad_hook(lambda p: _bump(self.count, 1))
            elif how == "multi_grad":
                torch.autograd.graph.register_multi_grad_hook(
                    (h,), lambda grads: _bump(self.count, 1))
            elif how == "retain_grad":
                h.retain_grad()
                self.h = h  # (a module attribute set on every call: refused for it too)
        return self.out(torch.relu(h))


@pytest.mark.parametrize("probe", ["auto", False])
@pytest.mark.parametrize("how,named", [
    ("register_hook", "Tensor.register_hook(_Net.note)"),
    ("post_accumulate", "Tensor.register_post_accumulate_grad_hook(_Net.forward.<locals>."),
    ("multi_grad", "register_multi_grad_hook(_Net.forward.<locals>.<lambda>)"),
])
def test_a_hook_the_forward_registers_refuses_the_graph(sim, how, named, probe):
    ref, g = _twins(lambda: _Net(how), probe=probe)
    _train(ref, g)
    assert len(ref.log) == len(g.log)
    assert all(torch.equal(a, b) for a, b in zip(ref.log, g.log))
    if how == "post_accumulate":  # (registered on every call: as many as eagerly)
        assert len(ref.out.bias._post_accumulate_grad_hooks) == \
            len(g.out.bias._post_accumulate_grad_hooks) == 4
    reasons = _reasons(g)
    assert reasons and all(named in r and "[PYTHON_HOOK]" in r and "test_hooks.py:" in r
                           for r in reasons), reasons
    # (probe on: piecewise, the Linears graphed; off: eager)
    stats = cg.stats(g)
    assert (stats.captures == 2 and stats.replays == 4) if probe else not stats.captures, stats


def test_retain_grad_on_an_intermediate_refuses_the_graph(sim):
    ref, g = _twins(lambda: _Net("retain_grad"))
    torch.manual_seed(1)
    for call in range(3):
        x = torch.randn(3, 4)
        ref(x).sum().backward()
        g(x).sum().backward()
        assert torch.equal(ref.h.grad, g.h.grad), call
    assert any("Tensor.retain_grad" in r for r in _reasons(g)), _reasons(g)


def test_the_real_calls_backward_alone_runs_the_hook(sim):
    # (decided before any extra warm-up or capture: their backwards never run it)
    ref, g = _twins(lambda: _Net("register_hook"), num_warmup_iters=3)
    x = torch.randn(3, 4)
    g(x)
    assert g.log == [] and g.count.item() == 0
    g(x).sum().backward()
    assert len(g.log) == 1 and g.count.item() == 1 and g.count._version == 1


class _LaterPath(nn.Module):
    """Registers hooks on the runs after its first only (the extra warm-ups, the capture): on
    an intermediate and on a parameter."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.runs = itertools.count()
        self.log: list = []

    def forward(self, x):
        h = self.lin(x)
        if h.requires_grad and next(self.runs) > 0:  # (the same ops on every path)
            h.register_hook(lambda g: self.log.append(g.detach().clone()))
            self.lin.weight.register_hook(lambda g: g * 2)
        return h * 2


@pytest.mark.parametrize("probe", ["auto", False])
def test_a_hook_registered_beyond_the_real_call_is_blocked_and_refuses_the_graph(sim, probe):
    ref, g = _twins(_LaterPath, num_warmup_iters=2, probe=probe)
    torch.manual_seed(1)
    for call in range(4):
        x = torch.randn(3, 4)
        ref(x).sum().backward()
        g(x).sum().backward()
        assert len(ref.log) == len(g.log), (call, len(ref.log), len(g.log))
        assert _grads_equal(ref, g), call
        if call == 0:  # (the runs beyond the real call left no hook on the parameter)
            assert not g.lin.weight._backward_hooks, g.lin.weight._backward_hooks
    assert any("PYTHON_HOOK" in r and "_LaterPath.forward.<locals>.<lambda>" in r
               for r in _reasons(g)), _reasons(g)


class _Pair(nn.Module):
    def __init__(self, hooked: bool):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.hooked = hooked
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        h = self.lin(x)
        if self.hooked and h.requires_grad:
            h.register_hook(lambda g: _bump(self.count, g.sum()))
        return torch.relu(h)


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = _Pair(hooked=True)
        self.b = _Pair(hooked=False)

    def forward(self, x):
        return self.b(self.a(x))


def test_only_the_submodule_that_registers_a_hook_runs_eagerly(sim):
    ref, g = _twins(_Two)
    _train(ref, g)
    reasons = _reasons(g)
    assert any("unsafe in a:" in r and "PYTHON_HOOK" in r for r in reasons), reasons
    # b and a's Linear are graphed (a itself runs eagerly, for its hook)
    assert cg.stats(g).captures == 2 and cg.stats(g).replays == 4, cg.stats(g)


def test_inference_keys_are_unaffected(sim):
    ref, g = _twins(lambda: _Net("register_hook"))
    torch.manual_seed(1)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, 4)
            assert torch.equal(ref(x), g(x))
    stats = cg.stats(g)
    assert not stats.eager_calls and stats.captures == 1 and stats.replays == 3, stats


class _NoGradParamHook(nn.Module):
    """Registers a hook on its parameter under no_grad (allowed on a leaf): one more on every
    call, eagerly; a replay would register none."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        self.lin.weight.register_hook(lambda g: g * 2)
        return self.lin(x)


def test_a_hook_registered_in_an_inference_call_refuses_it_too(sim):
    ref, g = _twins(_NoGradParamHook)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 4)
            assert torch.equal(ref(x), g(x))
    assert len(ref.lin.weight._backward_hooks) == len(g.lin.weight._backward_hooks) == 3
    assert any("PYTHON_HOOK" in r for r in _reasons(g)), _reasons(g)


def test_hooks_registered_outside_forward_keep_the_graph(sim):
    torch.manual_seed(0)
    ref = _Pair(hooked=False)
    torch.manual_seed(0)
    g = _Pair(hooked=False)
    for m in (ref, g):
        m.lin.weight.register_hook(lambda grad: grad * 3)
        m.lin.bias.register_post_accumulate_grad_hook(lambda p, m=m: _bump(m.count, 1))
    g = cg.graphify(g)
    _train(ref, g)
    stats = cg.stats(g)
    assert not stats.eager_calls and stats.captures == 1 and stats.replays == 3, stats


def test_the_patches_are_gone_after_a_call_and_other_threads_are_not_watched(sim):
    ref, g = _twins(lambda: _Net("register_hook"))
    g(torch.randn(3, 4)).sum().backward()
    assert torch.Tensor.register_hook is _REGISTER_HOOK
    assert torch.Tensor.retain_grad is _RETAIN_GRAD
    assert torch.autograd.graph.register_multi_grad_hook is _MULTI
    assert "set_" not in vars(torch.Tensor)  # (the probes' patch of it, see _probe)
    # a watch sees its own thread's registrations only (and blocks only those)
    t = torch.ones(2, requires_grad=True) * 2
    with _hooks.HookWatch(block=True) as watch:
        th = threading.Thread(target=lambda: t.register_hook(lambda grad: grad))
        th.start()
        th.join()
    assert not watch.found and len(t._backward_hooks) == 1


class _NodeHook(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.log: list = []

    def forward(self, x):
        h = self.lin(x)
        if h.requires_grad:
            h.grad_fn.register_prehook(lambda go: self.log.append(go[0].detach().clone()))
        return h * 2


def test_a_node_hook_the_forward_registers(sim):
    """A hook on an autograd node (grad_fn.register_hook / register_prehook) is a C type's
    method no patch reaches: the read of ``grad_fn`` that finds the node is noted instead, and
    refuses the signature (its Python runs in the user's backwards only, as eager's)."""
    ref, g = _twins(_NodeHook)
    torch.manual_seed(1)
    for call in range(3):
        x = torch.randn(3, 4)
        ref(x).sum().backward()
        g(x).sum().backward()
        assert len(ref.log) == len(g.log), (call, len(ref.log), len(g.log))
        assert all(torch.equal(a, b) for a, b in zip(ref.log, g.log))
    (why,) = cg.stats(g).eager_calls
    assert "Tensor.grad_fn [PYTHON_HOOK]" in why and "register_prehook" in why
    with torch.no_grad():  # (no node to read: graphed)
        for _ in range(2):
            x = torch.randn(3, 4)
            assert torch.equal(g(x), ref(x))
    assert cg.stats(g).replays >= 2 and len(g.log) == len(ref.log)


def test_torchs_own_reads_of_grad_fn_refuse_nothing(sim):
    """torch's code reads nodes with no hook in mind (non-reentrant checkpointing in torch
    2.11 asks ``input_saver.grad_fn is None``; full backward hooks; Dynamo; DDP;
    ``Tensor.register_hook``): a read the probe sees from a file of torch's package is not
    noted; one from ``Module._call_impl``'s file is (it registers deprecated non-full backward
    hooks on the output's node), and one from the user's."""
    import os

    for filename, noted in ((os.path.join(_hooks._TORCH_DIR, "utils", "checkpoint.py"), False),
                            (os.path.join(_hooks._TORCH_DIR, "utils", "hooks.py"), False),
                            (_hooks._MODULE_PY, True), ("/somewhere/model.py", True)):
        with _hooks.HookWatch() as watch:
            _hooks.node_read(filename)
        assert bool(watch.found) is noted, (filename, watch.found)
        if noted:
            assert watch.found[0].op == "Tensor.grad_fn"
    assert "grad_fn" not in vars(torch.Tensor)  # (no getter of torch's is replaced)
