"""CPU tests of issue 15's scenarios that need no CUDA, through the simulated capture backend.

They are written for a simulated backend whose "replay" re-executes what was captured (the
recorded aten ops with the tensors and scalars they had at capture: a captured ``x * self.scale``
keeps the captured scale), so that a stale replay gives a stale result on the CPU as it does on
a GPU. With a double that re-runs forward's Python on every replay, many of these pass for the
wrong reason. tests/test_gpu_guards.py holds the GPU versions (and the scenarios that need CUDA:
kernel-selecting global flags, streams, the ``.grad`` hook on another stream).

Each test graphifies a module (or a function) on the CPU and compares **every** output of several
calls with fresh inputs against an eager reference (a ``copy.deepcopy`` taken before
``graphify``, or the plain function), bitwise: ``torch.equal`` plus equal dtype, device and
shape; inputs the forward writes are compared after each call too. Before a change the test
asserts the graph path was taken (``cg.stats(m).replays`` grew); the change is applied to the
reference and to the graphified copy alike, the test checks that it really changes eager's
output (a failure there is a fault of the test, and says so), and calls at least twice more.
"Pass" means every call gave eager's result; whether by a new capture, an eager run or a guard
is not asserted. Only the public API is used. The modules and the comparison helpers are
shared with the GPU file, in tests/guard_scenarios.py (sizes and device are arguments).

Scenarios (issue 15's numbering):

1. Non-tensor module state changed after capture: float, int, bool attributes; a dict, list,
   dataclass and SimpleNamespace changed in place; a tuple and an enum replaced;
   ``LayerNorm.eps``; a 0-dim tensor attribute changed with ``fill_`` (read as an operand, and
   through ``.item()``); PEFT ``disable_adapter()`` (skipped without ``peft``).
2. The default dtype changed after capture (a forward makes a tensor without a dtype).
3. A forward hook / forward pre-hook that changes the output, added on a submodule after
   capture, then removed.
4. ``graphify(fn)`` where ``fn`` calls a module: ``model.train()`` (BatchNorm; buffers compared
   too), ``load_state_dict(..., assign=True)``, ``.to(torch.float64)``, ``.double()``.
5. A plain tensor attribute, a module-level global tensor and a closure tensor replaced after
   capture (the freed memory is then filled with NaN).
6. Same storage, new shape / stride / offset of a buffer or a plain tensor attribute:
   ``self.w = self.w[:4]``, ``resize_``, ``set_`` with another stride, ``set_`` with an offset.
7. Writes the version counter does not see: an input written through ``.data`` and by an
   opaque custom op declaring no mutation (the caller sees the write); a buffer passed as an
   argument and written by forward; a parameter written through ``.data`` with
   ``num_warmup_iters=2`` (written once per call).
8. Aliasing: an empty output next to an empty input; ``copy_outputs=False`` with the output fed
   back as the mutated input; a submodule called twice in a forward that goes piecewise under
   ``copy_outputs=False``; in a ``graph_region``, an attribute or global returned as an output
   and passed on to another graphed callable is never overwritten by its later copy-in.
11. ``share_graph`` per-layer values hidden from the structural check (scales 1, 1, 0.5, 1 in a
    dict or in ``ignore_attrs``; clamp thresholds the first inputs do not reach; a bf16 scale
    within ``assert_close``'s tolerance), with the plain simulated backend (layers then get
    graphs of their own) and, where tests/test_share_engine.py provides it, its graph-reading
    double (sharing proper: template, partner, retargeted copies).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from guard_scenarios import (
    _Alias, _use_b, _CHANGES, _RESHAPES, _Accumulates, _Affine, _AttrTable, _BNNet, _BumpsBias, _ClampLayer,
    _DoublesInput, _EmptyOut, _MakesTensor, _ReadsW, _ReturnsTable, _ScaledLayer, _Temperature,
    _TwiceThenSync, _TwoLinear, _WritesInput, _around, _before_after, _both, _calls, _clone,
    _closure_module, _default_dtype, _differs, _layer_by_layer, _layer_replays, _new_weights,
    _replays, _same, _scribble, on_device,
)

try:  # share_graph's graph-reading double (the fixture and its registry of layer tensors)
    from test_share_engine import _register as _register_for_reading
    from test_share_engine import reading  # noqa: F401 - a fixture
except ImportError:  # pragma: no cover - that module changed
    _register_for_reading = reading = None

DEV = "cpu"
_pair, _randn = on_device(DEV)


@pytest.fixture(autouse=True)
def _simulated(sim):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudagraphifyWarning)
        yield sim


# -- 1. module state that is not a tensor ------------------------------------------------------

@pytest.mark.parametrize("kind", list(_CHANGES))
def test_1_non_tensor_attribute_changed_after_capture(kind):
    torch.manual_seed(0)
    ref, g = _pair(_Affine(kind))
    with torch.no_grad():
        _before_after(ref, g, _randn(4, 8), _both(_CHANGES[kind], ref, g))


def test_1_submodule_put_behind_another_name_after_capture():
    torch.manual_seed(0)
    ref, g = _pair(_Alias(8))
    with torch.no_grad():
        _before_after(ref, g, _randn(4, 8), _both(_use_b, ref, g))


def test_1_lazy_module_first_call_then_graphed():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.LazyLinear(8), nn.ReLU()).to(DEV)
    g = cg.graphify(ref)  # (its own first forward initializes it; graphed from the next)
    with torch.no_grad():
        for i in range(4):
            x = _randn(4, 4)()[0]
            _same(g(x), torch.relu(x @ ref[0].weight.T + ref[0].bias), f"call {i}")
    assert cg.stats(g).replays >= 2, cg.stats(g)


def test_1_layernorm_eps_changed_after_capture():
    torch.manual_seed(0)
    ref, g = _pair(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)))

    def change(m):
        m[1].eps = 10.0

    with torch.no_grad():
        _before_after(ref, g, _randn(4, 8), _both(change, ref, g))


@pytest.mark.parametrize("how", ["operand", "item"])
def test_1_scalar_tensor_attribute_filled_after_capture(how):
    torch.manual_seed(0)
    ref, g = _pair(_Temperature(how))
    with torch.no_grad():
        _before_after(ref, g, _randn(4, 8), _both(lambda m: m.temp.fill_(4.0), ref, g))


def test_1_peft_disable_adapter_for_a_reference_pass():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=4, target_modules=["fc1", "fc2"], init_lora_weights=False)
    model = peft.get_peft_model(_TwoLinear(), cfg).eval()
    ref = copy.deepcopy(model)
    g = cg.graphify(model)
    x0 = torch.randn(4, 8)
    with torch.no_grad():
        on = ref(x0)
        with ref.disable_adapter():
            off = ref(x0)
        assert _differs(on, off), "test design: the adapter does not change the output"
        _calls(ref, g, _randn(4, 8), 3, "adapter on")
        assert _replays(g) > 0, cg.stats(g)
        for i in range(3):
            _calls(ref, g, _randn(4, 8), 1, f"step {i}, adapter on")
            with ref.disable_adapter(), g.disable_adapter():
                _calls(ref, g, _randn(4, 8), 2, f"step {i}, adapter disabled")
        _calls(ref, g, _randn(4, 8), 2, "adapter on again")


# -- 2. the default dtype ------------------------------------------------------------------

def test_2_default_dtype_changed_after_capture():
    torch.manual_seed(0)
    ref, g = _pair(_MakesTensor())
    make = _randn(4, 8)
    probe = make()
    with torch.no_grad():
        _calls(ref, g, make, 1, "first call")
        r = _replays(g)
        _calls(ref, g, make, 3, "before the change")
        assert _replays(g) > r, cg.stats(g)
        before = ref(*_clone(probe))
        with _default_dtype(torch.float64):
            assert _differs(before, ref(*_clone(probe))), "test design"
            _calls(ref, g, make, 3, "under float64")
        _calls(ref, g, make, 3, "back to float32")


# -- 3. hooks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["forward_hook", "forward_pre_hook"])
def test_3_hook_on_a_submodule_added_then_removed_after_capture(kind):
    torch.manual_seed(0)
    ref, g = _pair(_TwoLinear())
    handles = []

    def add(m):
        if kind == "forward_hook":
            handles.append(m.fc1.register_forward_hook(lambda mod, args, out: out * 2))
        else:
            handles.append(m.fc2.register_forward_pre_hook(lambda mod, args: (-args[0],)))

    make = _randn(4, 8)
    with torch.no_grad():
        _before_after(ref, g, make, _both(add, ref, g))
        for h in handles:
            h.remove()
        _calls(ref, g, make, 3, "after removing the hook")


# -- 4. graphify(fn) where fn calls a module -------------------------------------------------

@pytest.mark.parametrize("change", ["train", "load_state_dict_assign", "to_float64", "double"])
def test_4_graphified_function_sees_changes_of_the_module_it_calls(change):
    torch.manual_seed(0)
    model = _BNNet().eval()
    ref = copy.deepcopy(model)

    def step(x):  # casts to the model's dtype: .double() does not change the argument signature
        return model(x.to(model.lin1.weight.dtype))

    def ref_step(x):
        return ref(x.to(ref.lin1.weight.dtype))

    def probe(x):  # on a copy: a call in training mode updates the running statistics
        m = copy.deepcopy(ref)
        return m(x.to(m.lin1.weight.dtype))

    g = cg.graphify(step)
    do = {
        "train": lambda: (ref.train(), model.train()),
        "load_state_dict_assign": lambda: _new_weights(ref, model),
        "to_float64": lambda: (ref.to(torch.float64), model.to(torch.float64)),
        "double": lambda: (ref.double(), model.double()),
    }[change]

    def buffers_equal():
        _same(dict(model.named_buffers()), dict(ref.named_buffers()), "buffers")

    with torch.no_grad():
        _before_after(ref_step, g, _randn(16, 8), do, check=buffers_equal, probe_ref=probe)


# -- 5. tensors that are no argument, parameter or buffer -------------------------------------

def test_5_plain_tensor_attribute_replaced_after_capture():
    torch.manual_seed(0)
    ref, g = _pair(_around(_AttrTable()))
    held = []

    def change():
        new = torch.randn(8)
        ref[1].table = new.clone()
        g[1].table = new
        held.extend(_scribble(new))

    with torch.no_grad():
        _before_after(ref, g, _randn(4, 8), change)


_GLOBAL_TABLE: torch.Tensor | None = None


class _ReadsGlobal(nn.Module):
    def forward(self, x):
        return x + _GLOBAL_TABLE


def test_5_module_level_global_tensor_replaced_after_capture():
    global _GLOBAL_TABLE
    torch.manual_seed(0)
    _GLOBAL_TABLE = torch.randn(8)
    ref, g = _pair(_around(_ReadsGlobal()))
    held = []

    def change():
        global _GLOBAL_TABLE
        _GLOBAL_TABLE = torch.randn(8)
        held.extend(_scribble(_GLOBAL_TABLE))

    try:
        with torch.no_grad():
            _before_after(ref, g, _randn(4, 8), change)
    finally:
        _GLOBAL_TABLE = None


def test_5_closure_tensor_replaced_after_capture():
    torch.manual_seed(0)
    inner, replace = _closure_module()
    ref, g = _pair(_around(inner))
    held = []

    def change():
        new = torch.randn(8)
        replace(new)
        held.extend(_scribble(new))

    with torch.no_grad():
        _before_after(ref, g, _randn(4, 8), change)


# -- 6. same storage, new shape / stride / offset --------------------------------------------

@pytest.mark.parametrize("as_buffer", [True, False], ids=["buffer", "attribute"])
@pytest.mark.parametrize("how", list(_RESHAPES))
def test_6_same_storage_new_shape_stride_or_offset(how, as_buffer):
    torch.manual_seed(0)
    ref, g = _pair(_ReadsW(as_buffer))
    with torch.no_grad():
        _before_after(ref, g, _randn(4, 8), _both(_RESHAPES[how], ref, g))


# -- 7. writes the version counter does not see ----------------------------------------------

@pytest.mark.parametrize("how", ["data", "custom_op"])
def test_7_input_written_without_a_version_bump_is_seen_by_the_caller(how):
    torch.manual_seed(0)
    ref, g = _pair(_WritesInput(how))
    with torch.no_grad():
        _calls(ref, g, _randn(4, 8), 5, "calls")
    assert _replays(g) > 0, cg.stats(g)


@pytest.mark.parametrize("how", ["write_self_read_arg", "write_arg_read_self"])
def test_7_buffer_passed_as_argument_and_written_by_forward(how):
    torch.manual_seed(0)
    ref, g = _pair(_Accumulates(how))
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(4, 8)
            want = ref(x.clone(), ref.total)
            got = g(x, g.total)
            _same(got, want, f"call {i}")
            _same(g.total, ref.total, f"call {i}: the buffer after the call")
    assert _replays(g) > 0, cg.stats(g)


def test_7_parameter_written_through_data_is_written_once_per_call_with_extra_warmups():
    torch.manual_seed(0)
    ref = _BumpsBias().eval()
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=2)

    def bias_equal():
        _same(g.lin.bias, ref.lin.bias, "the bias after the call")

    with torch.no_grad():
        _calls(ref, g, _randn(4, 8), 5, "calls", check=bias_equal)
    assert _replays(g) > 0, cg.stats(g)


# -- 8. aliasing ----------------------------------------------------------------------------

@pytest.mark.parametrize("like_input", [False, True], ids=["other_shape", "like_input"])
def test_8_empty_output_is_not_the_empty_input(like_input):
    torch.manual_seed(0)
    ref, g = _pair(_EmptyOut(like_input))
    with torch.no_grad():
        for i in range(4):
            x, e = torch.randn(4, 8), torch.empty(0)
            want = ref(x.clone(), e.clone())
            got = g(x, e)
            _same(got, want, f"call {i}")
            assert got[1] is not e, f"call {i}: the empty output came back as the empty input"
    assert _replays(g) > 0, cg.stats(g)


def test_8_zero_copy_output_fed_back_as_the_mutated_input():
    torch.manual_seed(0)
    ref = _DoublesInput().eval()
    g = cg.graphify(copy.deepcopy(ref), copy_outputs=False)
    with torch.no_grad():
        x = torch.randn(4, 8)
        xr = x.clone()
        for i in range(5):
            want = ref(xr)
            got = g(x)
            _same(got, want, f"call {i}")
            x, xr = got, want
    assert _replays(g) > 0, cg.stats(g)


def test_8_piecewise_pieces_do_not_inherit_zero_copy_outputs():
    torch.manual_seed(0)
    ref = _TwiceThenSync().eval()
    g = cg.graphify(copy.deepcopy(ref), copy_outputs=False)
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(4, 8)
            _same(g(x), ref(x), f"call {i}")
    assert _replays(g) > 0, cg.stats(g)


_REGION_GLOBAL: torch.Tensor | None = None


def _returns_global(x):
    return x * 2, _REGION_GLOBAL


@pytest.mark.parametrize("owner", ["attribute", "global"])
def test_8_region_never_copies_into_a_tensor_the_caller_owns(owner):
    global _REGION_GLOBAL
    torch.manual_seed(0)
    _REGION_GLOBAL = torch.randn(4, 8)
    if owner == "attribute":
        ref_a = _ReturnsTable().eval()
        a = cg.graphify(copy.deepcopy(ref_a))
        owned = lambda: (a.table, ref_a.table)  # noqa: E731
    else:
        ref_a, a = _returns_global, cg.graphify(_returns_global)
        owned = lambda: (_REGION_GLOBAL, _REGION_GLOBAL)  # noqa: E731
    ref_b = nn.Linear(8, 8).eval()
    b = cg.graphify(copy.deepcopy(ref_b))
    original = owned()[0].clone()
    try:
        with torch.no_grad(), cg.graph_region():
            for i in range(4):
                x = torch.randn(4, 8)
                y, t = a(x)
                _same((y, t), ref_a(x), f"call {i} of a")
                _same(b(t), ref_b(owned()[1]), f"call {i} of b on the owned tensor")
                other = torch.randn(4, 8)
                _same(b(other), ref_b(other), f"call {i} of b on another input")
                mine, theirs = owned()
                _same(mine, original, f"call {i}: the caller's tensor")
                _same(theirs, original, f"call {i}: the reference's tensor")
            assert _replays(a) + _replays(b) > 0, (cg.stats(a), cg.stats(b))
    finally:
        _REGION_GLOBAL = None


# -- 11. share_graph per-layer values --------------------------------------------------------

@pytest.fixture(params=["sim", "reading"])
def share_backend(request):
    """The plain simulated backend (no graph reader: per-layer graphs), or the graph-reading
    double of tests/test_share_engine.py (sharing proper)."""
    if request.param == "sim":
        yield None
        return
    if _register_for_reading is None:
        pytest.skip("tests/test_share_engine.py no longer provides its graph-reading double")
    yield request.getfixturevalue("reading")


def _share(layers, share_backend, **opts):
    if share_backend is not None:
        _register_for_reading(layers)
    return cg.share_graph(layers, **opts)


@pytest.mark.parametrize("hidden", ["dict", "ignore_attrs"])
def test_11_share_graph_per_layer_scale_where_template_and_partner_agree(hidden, share_backend):
    torch.manual_seed(0)
    layers = nn.ModuleList(_ScaledLayer(s, hidden) for s in (1.0, 1.0, 0.5, 1.0)).eval()
    ref = copy.deepcopy(layers)
    opts = {"ignore_attrs": ("scale",)} if hidden == "ignore_attrs" else {}
    _share(layers, share_backend, **opts)
    with torch.no_grad():
        for i in range(4):
            _layer_by_layer(layers, ref, torch.randn(4, 8), f"call {i}")
    assert _layer_replays(layers) > 0, [cg.stats(m) for m in layers]


def test_11_share_graph_per_layer_clamp_the_first_inputs_do_not_reach(share_backend):
    torch.manual_seed(0)
    layers = nn.ModuleList(_ClampLayer(v) for v in (100.0, 100.0, 0.5, 100.0)).eval()
    ref = copy.deepcopy(layers)
    _share(layers, share_backend, ignore_attrs=("limit",))
    small = lambda: torch.randn(4, 8) * 0.01  # noqa: E731
    large = lambda: torch.randn(4, 8) * 10  # noqa: E731
    with torch.no_grad():
        for i in range(3):
            _layer_by_layer(layers, ref, small(), f"small input {i}")
        assert _layer_replays(layers) > 0, [cg.stats(m) for m in layers]
        y = ref[1](ref[0](large()))
        assert _differs(ref[2](y), ref[2].lin(y)), "test design: the large input is not clamped"
        for i in range(3):
            _layer_by_layer(layers, ref, large(), f"large input {i}")
        _layer_by_layer(layers, ref, small(), "small input again")


def test_11_share_graph_bf16_per_layer_scale_within_assert_close_tolerance(share_backend):
    torch.manual_seed(0)
    scales = (1.0, 1.0, 1.0 + 2 ** -7, 1.0)
    layers = nn.ModuleList(_ScaledLayer(s, "dict") for s in scales).to(torch.bfloat16).eval()
    ref = copy.deepcopy(layers)
    _share(layers, share_backend)
    make = lambda: torch.randn(4, 8, dtype=torch.bfloat16)  # noqa: E731
    with torch.no_grad():
        x = make()
        with_scale, without = ref[2](x), ref[2].lin(x)
        assert not torch.equal(with_scale, without), "test design: the scale changes no bit"
        torch.testing.assert_close(with_scale, without)  # within assert_close's bf16 tolerance
        for i in range(4):
            _layer_by_layer(layers, ref, make(), f"call {i}")
    assert _layer_replays(layers) > 0, [cg.stats(m) for m in layers]


def test_a_value_too_deep_to_guard_runs_eagerly_with_the_reason(sim):
    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            nested: dict = {"scale": 2.0}
            for _ in range(6):
                nested = {"next": nested}
            self.cfg = nested

        def forward(self, x):
            return x * 2 if self.cfg else x

    g = cg.graphify(Deep())
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(3)
            torch.testing.assert_close(g(x), x * 2, rtol=0, atol=0)
    s = cg.stats(g)
    assert s.captures == 0 and any("nested more than 4 deep" in r for r in s.eager_calls), s


def test_a_host_scalar_read_by_value_tells_a_negative_zero_apart(sim):
    # (a CPU scalar tensor kept as an attribute, or in static state, is read on the host by
    # value and baked into the kernels a graph launches: ``0.0`` and ``-0.0`` compared equal,
    # so ``fill_(-0.0)`` replayed the +0.0 graph: ``1 / (x * s)`` +inf where eager gives -inf)
    from cudagraphify._guards import _tensor_check
    from cudagraphify._state import host_bits, state_key

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.s = torch.tensor(0.0)

        def forward(self, x):
            return self.lin(x) * self.s

    g = cg.graphify(Scaled())
    x = torch.randn(2, 3)
    with torch.no_grad():
        for _ in range(3):
            g(x)
        g.s.fill_(-0.0)
        g(x)
    assert cg.stats(g).captures == 2
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64):
        t = torch.zeros(2, dtype=dtype)
        check = _tensor_check(t)
        assert check()
        t[1] = -0.0
        assert not check(), dtype
    nan = torch.tensor(float("nan"))
    assert _tensor_check(nan)() and host_bits(torch.tensor(True)) is True

    class Holder:  # (static state: a small host tensor in it is keyed by value)
        def __init__(self):
            self.count = torch.tensor([0.0])

    h = Holder()
    before = state_key(h)
    h.count.fill_(-0.0)
    assert state_key(h) != before
