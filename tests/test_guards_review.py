"""Findings of a review of the guard model (issue 15), each kept as a regression test: the
change that once gave a stale replay, a wrong gradient or a thrashing decision, and what the
library does now (graph and guard, or refuse with the reason; always eager's result). The one
known gap left (a probe-induced path change, pre-existing) stays ``xfail(strict=True)``. CPU
only, through the simulated capture backend of conftest.py (its replay re-runs the captured aten
ops with the captured scalars and memory, so a stale replay gives a stale result here as on a
GPU).

Each stale-replay test compares every output with an eager reference (a deep copy taken before
``graphify``) bitwise, after proving the graph path was taken (``replays`` grew) before the
change; the change is applied to both, and the test checks that it changes eager's output.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import cudagraphify as cg

try:  # share_graph's graph-reading double (sharing proper on a CPU)
    from test_share_engine import _register as _register_for_reading
    from test_share_engine import reading  # noqa: F401 - a fixture
except ImportError:  # pragma: no cover
    _register_for_reading = None


@pytest.fixture(autouse=True)
def _simulated(sim):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudagraphifyWarning)
        yield sim


def _same(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _pair(model: nn.Module):
    ref = model.eval()
    return ref, cg.graphify(copy.deepcopy(ref))


def _before_after(ref, g, make, change, n: int = 3) -> None:
    """Calls (graph path proven), ``change`` on both, calls: every output equals eager's."""
    with torch.no_grad():
        probe = make()
        for i in range(n):
            x = make()
            assert _same(g(*x), ref(*x)), f"call {i} before the change"
        assert cg.stats(g).replays > 0, f"no replay before the change: {cg.stats(g)}"
        old = ref(*probe)
        change(ref)
        change(g)
        assert not _same(ref(*probe), old), "test design: the change does not alter eager"
        for i in range(n):
            x = make()
            assert _same(g(*x), ref(*x)), f"call {i} after the change differs from eager"


def _x():
    return (torch.randn(2, 8),)


# -- 1. the fast path ----------------------------------------------------------------------------

def test_fast_path_replays_aliased_views_of_a_written_input():
    def f(a, b):
        a.add_(1)
        return a + b

    g = cg.graphify(f)
    with torch.no_grad():
        for _ in range(3):
            x, y = torch.randn(4), torch.randn(4)
            x2, y2 = x.clone(), y.clone()
            assert _same(g(x, y), f(x2, y2)) and _same(x, x2)
        assert cg.stats(g).replays > 0
        z = torch.randn(4)
        z2 = z.clone()
        got = g(z, z.view(4))
        want = f(z2, z2.view(4))
    assert _same(got, want) and _same(z, z2)


class _StateBuf(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.ones(4))

    def forward(self, x):
        self.state.mul_(2)
        return x + self.state


def test_argument_aliasing_a_buffer_the_forward_writes():
    ref = _StateBuf()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4)
            assert _same(g(x), ref(x))
        assert cg.stats(g).replays > 0
        a, b = g(g.state), ref(ref.state)
    assert _same(a, b) and _same(g.state, ref.state)


class _MixedDevices(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("junk", torch.zeros(2, device="meta"))  # on another device

    def forward(self, x):
        return self.lin(x)


def test_eager_decision_outlives_the_statics_it_depended_on():
    m = cg.graphify(_MixedDevices())
    x = torch.randn(2, 8)
    with torch.no_grad():
        m(x), m(x)  # eager ("several devices"), remembered by _EagerFast
        m.junk = torch.zeros(2)  # fixed: everything on the CPU now
        for _ in range(5):
            m(x)
    assert cg.stats(m).replays > 0, cg.stats(m).eager_calls


def test_one_aliased_call_keeps_the_signature_eager():
    @cg.graphify
    def f(a, b):
        a.add_(1)
        return a + b

    with torch.no_grad():
        z = torch.randn(4)
        f(z, z.view(4))
        for _ in range(5):
            f(torch.randn(4), torch.randn(4))
    assert cg.stats(f).replays > 0, cg.stats(f).eager_calls


# -- 2. crashes and thrashing --------------------------------------------------------------------

class _Deep(nn.Module):
    def __init__(self, meta):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.meta = meta

    def forward(self, x):
        return self.lin(x) * len(self.meta)


# Found raising Unguardable out of the call at 7cac637; fixed in d54c2f4 (the signature runs
# eagerly with the reason): kept as a regression test.
@pytest.mark.parametrize("meta", [
    {"a": {"b": {"c": {"d": {"e": {"f": 1}}}}}},  # nested more than 4 deep
    {str(i): [i] for i in range(300)},  # more than 256 mutable objects (a vocabulary)
], ids=["deep", "many"])
def test_a_big_container_attribute_does_not_make_the_call_raise(meta):
    ref, g = _pair(_Deep(meta))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 8)
            assert _same(g(x), ref(x))


class _Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1  # a position or step count a forward reads and advances
        return self.b(torch.relu(self.a(x))) * self.calls


def test_a_counter_attribute_runs_as_eagerly(sim):
    ref = _Counter().eval()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(6):
            x = torch.randn(2, 8)
            assert _same(g(x), ref(x)), f"call {i}: counter {g.calls} vs eager {ref.calls}"
    assert g.calls == ref.calls, (g.calls, ref.calls)
    assert sim.captures <= 4 and cg.stats(g).replays > 0, (sim.captures, cg.stats(g))
    assert len(cg.stats(g).eager_calls) <= 1, list(cg.stats(g).eager_calls)


# -- 3. module state the attribute guard does not see --------------------------------------------

class _ClassScale(nn.Module):
    scale = 2.0  # a class attribute: the read is not recorded

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * self.scale


def test_instance_attribute_shadowing_a_class_attribute():
    ref, g = _pair(_ClassScale())
    _before_after(ref, g, _x, lambda m: setattr(m, "scale", 3.0))


class _Optional(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        extra = getattr(self, "extra", None)  # absent at capture
        y = self.lin(x)
        return y if extra is None else y + extra


def test_attribute_absent_at_capture_then_set():
    ref, g = _pair(_Optional())
    _before_after(ref, g, _x, lambda m: setattr(m, "extra", 1.0))


class _Scaler:
    def __init__(self, k):
        self.k = k

    def __call__(self, x):
        return x * self.k


@dataclasses.dataclass(slots=True)
class _SlotsCfg:
    k: float


class _Holder(nn.Module):
    def __init__(self, what: str):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.what = what
        self.scaler = _Scaler(2.0)
        self.cfg = _SlotsCfg(2.0)
        self.table = np.array([2.0])

    def forward(self, x):
        y = self.lin(x)
        if self.what == "callable_object":
            return self.scaler(y)
        if self.what == "slots_dataclass":
            return y * self.cfg.k
        return y * float(self.table[0])


@pytest.mark.parametrize("what,change", [
    ("callable_object", lambda m: setattr(m.scaler, "k", 3.0)),
    ("slots_dataclass", lambda m: setattr(m.cfg, "k", 3.0)),
], ids=["callable_object", "slots_dataclass"])
def test_mutable_objects_without_a_plain_dict_are_guarded(what, change):
    # a callable object's dict is watched; a dataclass with slots, its fields
    ref, g = _pair(_Holder(what))
    _before_after(ref, g, _x, change)


def test_an_object_that_changes_in_place_with_nothing_to_watch_is_refused():
    # a numpy array can change in place with no version to watch: eager, with the reason
    ref, g = _pair(_Holder("numpy_array"))
    with torch.no_grad():
        for i in range(4):
            if i == 2:
                ref.table[0] = g.table[0] = 3.0
            x = torch.randn(2, 8)
            assert _same(g(x), ref(x)), f"call {i}"
    s = cg.stats(g)
    assert s.replays == 0 and any("ndarray" in r for r in s.eager_calls), s


class _WithAct(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.lin(x))


@pytest.mark.parametrize("change", [
    lambda m: setattr(m.act, "forward", lambda x: x * 0.5),
    lambda m: setattr(m.act, "__class__", nn.Tanh),
], ids=["forward_replaced", "class_swapped"])
def test_submodule_forward_or_class_replaced(change):
    ref, g = _pair(_WithAct())
    _before_after(ref, g, _x, change)


class _Plus(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) + 1


def test_global_hook_through_a_name_bound_before_install():
    from torch.nn.modules import module as mm

    # what a module that imported the function before cudagraphify's first call holds
    early = getattr(mm.register_module_forward_hook, "__wrapped__",
                    mm.register_module_forward_hook)
    ref, g = _pair(_Plus())
    handles = []

    def hook(mod, inp, out):
        return out * 2 if isinstance(mod, nn.Linear) else None

    try:
        _before_after(ref, g, _x, lambda m: handles.append(early(hook)) if not handles else None)
    finally:
        for h in handles:
            h.remove()


class _Count(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.step = {"n": 0}

    def forward(self, x):
        self.step["n"] += 1
        return self.lin(x) * self.step["n"]


def test_forward_changing_a_container_it_reads():
    ref = _Count().eval()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        g(torch.randn(2, 8)), ref(torch.randn(2, 8))
        ref.step["n"] = g.step["n"]  # the capture ran forward's Python once more
        for i in range(3):
            x = torch.randn(2, 8)
            assert _same(g(x), ref(x)), f"call {i}"


# -- 4. global flags -----------------------------------------------------------------------------

@pytest.mark.parametrize("flag", [
    "allow_tf32",  # guarded: the control
    "allow_fp16_accumulation",  # in neither GlobalStateGuard nor, once, FlagsGuard
])
def test_a_kernel_changing_global_flag_stops_the_replays(flag):
    g = cg.graphify(nn.Linear(8, 8).eval())
    matmul = torch.backends.cuda.matmul
    old = getattr(matmul, flag)
    with torch.no_grad():
        for _ in range(3):
            g(torch.randn(2, 8))
        r = cg.stats(g).replays
        assert r > 0
        setattr(matmul, flag, not old)
        try:
            g(torch.randn(2, 8))
            replayed = cg.stats(g).replays - r
        finally:
            setattr(matmul, flag, old)
    assert replayed == 0, "replayed a graph captured under the other setting"


class _DirectSDPA(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(16, 16)

    def forward(self, x):
        q = self.q(x).view(4, 1, 2, 8).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q)


class _MHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 2)  # F.multi_head_attention_forward -> SDPA

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


@pytest.mark.parametrize("model", [
    _DirectSDPA,  # the control: SDPA called from the forward, its backends guarded
    # SDPA reached from inside F.multi_head_attention_forward, where no probe sees it: the
    # flags are read whatever the run's ops
    _MHA,
], ids=["direct_sdpa", "multihead_attention"])
def test_sdpa_backend_change_stops_the_replays(model):
    g = cg.graphify(model().eval())
    x = torch.randn(4, 1, 16)
    old = torch.backends.cuda.flash_sdp_enabled()
    with torch.no_grad():
        for _ in range(3):
            g(x)
        r = cg.stats(g).replays
        assert r > 0, cg.stats(g)
        torch.backends.cuda.enable_flash_sdp(not old)
        try:
            g(x)
            replayed = cg.stats(g).replays - r
        finally:
            torch.backends.cuda.enable_flash_sdp(old)
    assert replayed == 0, "replayed a graph captured under other SDPA backends"


# -- 5. threads ----------------------------------------------------------------------------------

class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = 2.0

    def forward(self, x):
        return self.lin(x) * self.scale


def test_epoch_validated_between_another_threads_bump_and_write():
    in_window, go = threading.Event(), threading.Event()

    class SlowFloat(float):
        """A float whose first class lookup (nn.Module.__setattr__'s isinstance checks, after
        the bump and before the write) waits: a thread switch at that point, made certain."""

        armed = True

        @property
        def __class__(self):
            if SlowFloat.armed:
                SlowFloat.armed = False
                in_window.set()
                go.wait(5)
            return float

    torch.manual_seed(0)
    ref, g = _pair(_Scaled())
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(3):
            assert _same(g(x), ref(x))
        assert cg.stats(g).replays > 0
        writer = threading.Thread(target=setattr, args=(g, "scale", SlowFloat(3.0)))
        writer.start()
        assert in_window.wait(5)
        assert _same(g(x), ref(x))  # the write has not happened yet: 2.0 on both
        go.set()
        writer.join()
        ref.scale = 3.0
        for i in range(2):
            assert _same(g(x), ref(x)), f"call {i} after the write"


# -- 6. training ---------------------------------------------------------------------------------

class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mask", torch.full((4,), 2.0))

    def forward(self, x):
        return self.lin(x) * self.mask


def test_buffer_changed_in_place_before_backward_raises_as_eagerly():
    torch.manual_seed(0)
    ref = _Masked()
    g = cg.graphify(copy.deepcopy(ref))
    for _ in range(3):
        g(torch.randn(2, 4)).sum().backward()
    y = ref(torch.randn(2, 4))
    ref.mask.mul_(3)
    with pytest.raises(RuntimeError):  # eager
        y.sum().backward()
    r = cg.stats(g).replays
    y = g(torch.randn(2, 4))
    assert cg.stats(g).replays > r
    g.mask.mul_(3)
    with pytest.raises(RuntimeError):
        y.sum().backward()


class _Alpha(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.alpha = torch.tensor(2.0, requires_grad=True)  # a plain attribute

    def forward(self, x):
        return self.lin(x) * self.alpha


_W = torch.randn(4, 4, requires_grad=True)


def _uses_global(x):
    return x @ _W


@pytest.mark.parametrize("where", ["attribute", "global"])
def test_a_non_parameter_tensor_requiring_grad_is_refused_and_gets_its_gradient(where):
    # a graph cannot give such a tensor its gradient: the call runs eagerly, with the reason
    torch.manual_seed(0)
    if where == "attribute":
        ref = _Alpha()
        g = cg.graphify(copy.deepcopy(ref))
        leaf_ref, leaf_g = ref.alpha, g.alpha
    else:
        ref = _uses_global
        g = cg.graphify(_uses_global)
        leaf_ref = leaf_g = _W
    for i in range(4):
        x = torch.randn(2, 4, requires_grad=True)
        leaf_ref.grad = None
        ref(x).sum().backward()
        want = leaf_ref.grad.clone()
        leaf_g.grad = None
        g(x).sum().backward()
        assert leaf_g.grad is not None and _same(leaf_g.grad, want), f"call {i}: {cg.stats(g)}"
    s = cg.stats(g)
    assert s.replays == 0 and any("requires grad and is no parameter" in r
                                  for r in s.eager_calls), s


# -- 7. share_graph ------------------------------------------------------------------------------

class _Clamp(nn.Module):
    def __init__(self, limit: float):
        super().__init__()
        self.lin = nn.Linear(8, 8, bias=False)
        self.limit = limit

    def forward(self, x):
        return torch.clamp(self.lin(x), max=self.limit)


def test_share_graph_template_layer_attribute_changed(request):
    if _register_for_reading is None:
        pytest.skip("tests/test_share_engine.py no longer provides its graph-reading double")
    request.getfixturevalue("reading")
    torch.manual_seed(0)
    layers = nn.ModuleList(_Clamp(100.0) for _ in range(4)).eval()
    ref = copy.deepcopy(layers)
    _register_for_reading(layers)
    group = cg.share_graph(layers)
    small = lambda: torch.randn(4, 8) * 0.01  # noqa: E731
    large = lambda: torch.randn(4, 8) * 10  # noqa: E731
    with torch.no_grad():
        for _ in range(3):
            x = small()
            for m, r in zip(layers, ref):
                assert _same(m(x), r(x))
        assert cg.stats(layers[0]).replays > 0 and group.stats().retargets > 0, group.stats()
        layers[0].limit = ref[0].limit = 0.5
        x = small()  # rebuilds layer 0's graph: no output reaches 0.5
        assert _same(layers[0](x), ref[0](x))
        for i in range(3):
            x = large()
            assert _same(layers[0](x), ref[0](x)), f"large input {i}"


# -- 8. function transforms ----------------------------------------------------------------------

def _sin2(x):
    return torch.sin(x) * 2 + 1


@pytest.mark.parametrize("transform", ["vmap", "jvp"])
def test_function_transform_over_a_graphed_function(transform):
    g = cg.graphify(_sin2)
    with torch.no_grad():
        for _ in range(3):
            g(torch.randn(4))
    assert cg.stats(g).replays > 0
    if transform == "vmap":
        xs = torch.randn(3, 4)
        with torch.no_grad():
            assert _same(torch.func.vmap(g)(xs), torch.func.vmap(_sin2)(xs))
    else:
        x, t = torch.randn(4), torch.ones(4)
        assert _same(torch.func.jvp(g, (x,), (t,))[1], torch.func.jvp(_sin2, (x,), (t,))[1])


# -- 9. the probe changes the path it captures -------------------------------------------------

@pytest.mark.xfail(strict=True, reason="pre-existing, low: the warm-up and the capture run under "
                   "the probe's TorchFunctionMode, which makes has_torch_function() true, so "
                   "nn.TransformerEncoderLayer skips its fused fast path there and the graph "
                   "replays the unfused path: outputs may differ from eager's by rounding (on "
                   "the CPU double they do; on the H200 one run's outputs were equal); see "
                   "the README's Limitations")
def test_graph_runs_the_path_eager_takes():
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 5, 16)
            assert _same(g(x), ref(x)), f"call {i} (replays {cg.stats(g).replays})"


class _Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.lock = threading.Lock()
        self.sentinel = object()

    def forward(self, x):
        with self.lock:
            return self.lin(x) if self.sentinel is not None else x


def test_objects_with_no_data_of_their_own_are_held_by_identity():
    # a lock or a sentinel read by forward (no dict to watch): the signature is graphed
    torch.manual_seed(0)
    ref = _Gated().eval()
    torch.manual_seed(0)
    g = cg.graphify(_Gated().eval())
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 8)
            assert _same(g(x), ref(x)), f"call {i}"
    assert cg.stats(g).replays == 2, cg.stats(g)


def test_threading_objects_read_by_forward_are_held_by_identity():
    # an Event (a Condition and a deque inside) coordinates threads: no data for a kernel
    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.gate = (threading.Event(), threading.Event())

        def forward(self, x):
            return self.lin(x) if self.gate is not None else x

    torch.manual_seed(0)
    ref = Gate().eval()
    torch.manual_seed(0)
    g = cg.graphify(Gate().eval())
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 8)
            assert _same(g(x), ref(x)), f"call {i}"
    assert cg.stats(g).replays == 2, cg.stats(g)
