"""Review of fix-swap (74edaf2): ``torch.utils.swap_tensors`` in a forward, the runs beyond the
real call noting and undoing their swaps (cudagraphify/_hooks.py) and refusing the graph
(cudagraphify/_first_call.py verify). CPU, on the ``sim`` double of conftest.py.

Findings S1, S2, S2b were strict xfails on the reviewed code; fixed (swaps swapped back before
every put-back, share_graph refused, verify's check for shared graphs too), now plain tests.
Controls are plain tests.
GPU reproductions: .ci/review/swap/run_all.sh."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify._capturing import Capturing

from test_warmups import _twins

_SWAP = torch._C._swap_tensor_impl
_G: dict = {}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture
def swap_flag():
    old = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(old)


class EveryCall(nn.Module):
    """Swaps its global with a tensor made from its output on every call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        _G[id(self)] = torch.zeros(4)

    def target(self) -> torch.Tensor:
        return _G[id(self)]

    def forward(self, x):
        h = self.lin(x)
        torch.utils.swap_tensors(_G[id(self)], (h[0] * 2).detach().clone())
        return h * 3


# -- S1: a share_graph layer's graph skips the swap check -------------------------------------

# (fixed) finding S1 (silent wrong value): verify's swap check is skipped for a graph made from a
# share_graph template (`and not shared`), and the real call's swaps are never noted, so a
# share_graph layer that swaps a tensor on every call is graphed and its replays swap nothing
# (CPU: the template is simulated by patching Capturing._shared; real share_graph:
# .ci/review/swap/a_findings.py)
def test_S1_a_shared_layers_graph_skips_the_swap_check(sim, monkeypatch):
    def template(self, fn, a, kw, inputs):  # (what group.make returns: a capture of the layer)
        raw, out = self.backend.capture(lambda: fn(*a, **kw), self.device)
        return raw, out, inputs
    monkeypatch.setattr(Capturing, "_shared", template)
    ref, g = _twins(EveryCall)
    for i in range(4):
        x = torch.randn(3, 4)
        with torch.no_grad():
            want, got = ref(x), g(x)
        assert torch.equal(got, want), i
        assert torch.equal(g.target(), ref.target()), (i, cg.stats(g))


# -- S2: put-backs act on the Python objects before the swaps are undone ----------------------

class BumpSwapSave(nn.Module):
    """Counts a buffer (or plain tensor attribute) up in place, swaps it for a copy of itself,
    and multiplies by it through ``detach()`` (autograd saves an alias sharing its version
    counter, as a ``.data``/``detach()`` read does)."""

    def __init__(self, buf: bool = True):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        if buf:
            self.register_buffer("count", torch.zeros(4))
        else:
            self.count = torch.zeros(4)

    def forward(self, x):
        h = self.lin(x)
        self.count.add_(1)
        torch.utils.swap_tensors(self.count, self.count.clone())
        return h * self.count.detach()


# (fixed) finding S2 (loud: the user's backward raises where eager's does not): a run beyond the
# real call writes the tensor in place, then swaps it;
# layouts_kept/versions_kept/put_versions_back put the version back on the Python object, which
# then holds the swapped-in contents, and the watch swaps back only afterwards: the real call's
# contents keep the later run's version bump, which the real call's autograd graph checks
@pytest.mark.parametrize("buf,probe", [(True, "auto"), (True, False), (False, False)])
def test_S2_version_of_a_tensor_written_then_swapped_by_a_later_run(sim, buf, probe):
    ref, g = _twins(lambda: BumpSwapSave(buf), probe=probe)
    for i in range(3):
        x = torch.randn(3, 4)
        a = ref(x)
        a.sum().backward()
        b = g(x)
        b.sum().backward()
        assert torch.equal(a, b), i
        assert torch.equal(ref.count, g.count), i


# (fixed) finding S2b (silent: version counter): the same order in inference
# (num_warmup_iters=2), the buffer's version is left moved by the extra warm-up (its values are
# put back by storage)
@pytest.mark.parametrize("probe", ["auto", False])
def test_S2b_version_left_moved_in_inference(sim, probe):
    ref, g = _twins(BumpSwapSave, probe=probe, num_warmup_iters=2)
    x = torch.randn(3, 4)
    with torch.no_grad():
        a, b = ref(x), g(x)
    assert torch.equal(a, b) and torch.equal(ref.count, g.count)
    assert g.count._version == ref.count._version, (g.count._version, ref.count._version)


# -- controls -----------------------------------------------------------------------------------

class ToInForward(nn.Module):
    """``self.to(x.dtype)`` in the forward: with swap_module_params_on_conversion, each call
    swaps every parameter with an alias of itself."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        self.to(x.dtype)
        return self.lin(x) * 2


@pytest.mark.parametrize("probe", ["auto", False])
@pytest.mark.parametrize("mode", ["no_grad", "grad"])
def test_control_apply_with_swap_in_forward(sim, swap_flag, probe, mode):
    ref, g = _twins(ToInForward, probe=probe)
    params = [id(p) for p in g.parameters()]
    for i in range(4):
        x = torch.randn(3, 4)
        with torch.set_grad_enabled(mode == "grad"):
            a, b = ref(x), g(x)
            if mode == "grad":
                a.sum().backward()
                b.sum().backward()  # (the real call's AccumulateGrad nodes are not poisoned)
        assert torch.equal(a, b), i
        assert [id(p) for p in g.parameters()] == params
        for p, q in zip(ref.parameters(), g.parameters()):
            assert torch.equal(p, q) and type(p) is type(q)
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                assert torch.equal(p.grad, q.grad)
    assert torch._C._swap_tensor_impl is _SWAP


class LoadAssign(nn.Module):
    """``load_state_dict(assign=True)`` of a fixed state inside the forward (swaps, with the
    flag, the buffer and parameters with the state's tensors' copies)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self.state = None

    def forward(self, x):
        if self.state is None:
            self.state = {k: v.clone() for k, v in self.state_dict().items()}
        self.load_state_dict({k: v.clone() for k, v in self.state.items()}, assign=True)
        return self.lin(x) * self.scale


@pytest.mark.parametrize("probe", ["auto", False])
def test_control_load_state_dict_assign_with_swap_in_forward(sim, swap_flag, probe):
    ref, g = _twins(LoadAssign, probe=probe)
    for i in range(4):
        x = torch.randn(3, 4)
        with torch.no_grad():
            a, b = ref(x), g(x)
        assert torch.equal(a, b), i
        for (n, p), q in zip(ref.state_dict().items(), g.state_dict().values()):
            assert torch.equal(p, q), (i, n)
    assert torch._C._swap_tensor_impl is _SWAP


class Twice(EveryCall):
    """Swaps its global twice (with two tensors), and with itself."""

    def forward(self, x):
        h = self.lin(x)
        t = _G[id(self)]
        torch.utils.swap_tensors(t, (h[0] * 2).detach().clone())
        torch.utils.swap_tensors(t, t)
        torch.utils.swap_tensors(t, (h[1] * 2).detach().clone())
        t.tag = "swapped"
        return h * 3


@pytest.mark.parametrize("probe", ["auto", False])
@pytest.mark.parametrize("iters", [1, 3])
def test_control_swapped_twice_and_with_itself(sim, probe, iters):
    ref, g = _twins(Twice, probe=probe, num_warmup_iters=iters)
    for i in range(3):
        x = torch.randn(3, 4)
        with torch.no_grad():
            assert torch.equal(g(x), ref(x)), i
        assert torch.equal(g.target(), ref.target()), i
        assert g.target().__dict__ == ref.target().__dict__
    assert torch._C._swap_tensor_impl is _SWAP


class RaiseAfterSwap(EveryCall):
    """Swaps its global, then raises on its run ``at`` (1: the first run beyond the real call)."""

    def __init__(self, exc):
        super().__init__()
        self.exc, self.runs = exc, 0

    def forward(self, x):
        h = self.lin(x)
        torch.utils.swap_tensors(_G[id(self)], (h[0] * 2).detach().clone())
        run, self.runs = self.runs, self.runs + 1
        if run == 1:
            raise self.exc("boom")
        return h * 3


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_control_a_later_run_that_raises_after_a_swap(sim, exc):
    g = cg.graphify(RaiseAfterSwap(exc), num_warmup_iters=2)
    before = g.target()
    x = torch.randn(3, 4)
    with torch.no_grad():
        if exc is KeyboardInterrupt:
            with pytest.raises(KeyboardInterrupt):
                g(x)
        else:
            g(x)  # (the extra warm-up failed: the real call's result stands)
    # what the real call left: its one swap (the later run's is undone)
    want = (g.lin(x)[0] * 2)
    assert g.target() is before
    assert torch.allclose(g.target(), want)
    assert torch._C._swap_tensor_impl is _SWAP


def test_control_a_swap_on_another_thread_during_a_later_run_stays(sim):
    at, go = threading.Event(), threading.Event()

    class Paused(EveryCall):
        def forward(self, x):
            h = self.lin(x)
            torch.utils.swap_tensors(_G[id(self)], (h[0] * 2).detach().clone())
            if getattr(self, "n", 0) == 1:
                at.set()
                assert go.wait(10)
            self.n = getattr(self, "n", 0) + 1
            return h * 3

    g = cg.graphify(Paused())
    err = []

    def call():
        try:
            with torch.no_grad():
                g(torch.randn(3, 4))
        except BaseException as e:  # noqa: BLE001
            err.append(e)

    th = threading.Thread(target=call)
    th.start()
    try:
        assert at.wait(10)
        a, b = torch.zeros(2), torch.ones(2)
        torch.utils.swap_tensors(a, b)  # (the patch is in place: it goes straight through)
    finally:
        go.set()
        th.join(10)
    assert not err, err
    assert torch.equal(a, torch.ones(2)) and torch.equal(b, torch.zeros(2))
    assert torch._C._swap_tensor_impl is _SWAP
