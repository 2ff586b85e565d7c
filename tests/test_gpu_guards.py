"""GPU tests of issue 15's scenarios: every change a stale graph would miss gives eager's result.

Each test builds a module (or function) on CUDA, graphifies it, and compares **every** output of
several calls with fresh inputs against an eager reference (a ``copy.deepcopy`` taken before
``graphify``, or the plain function), bitwise: ``torch.equal`` plus equal dtype, device and shape.
Inputs the forward writes are compared after each call too. Before a change, the test asserts
that the graph path was taken (``cg.stats(m).replays`` grew); the change is applied to the
reference and to the graphified copy alike, the test checks that it really changes eager's output
(so a stale replay cannot pass unseen: a failure there is a fault of the test, and says so), and
then calls at least twice more. "Pass" means: the graphified callable gave eager's result (or
raised eager's error) on every call; whether it got there by a new capture, by running eagerly
or by a guard is not asserted. Only the public API is used (here and in
tests/guard_scenarios.py, the modules and comparison helpers shared with the CPU version
tests/test_guards.py), so this file runs against the library before and after the fix of
issue 15 alike. Gradients (scenario 9) are compared with a tight tolerance (as the training
suite does); forward outputs bitwise.

Scenarios (issue 15, items 1-11):

1. Module state that is not a tensor, changed after capture: a float, an int and a bool
   attribute; PEFT ``disable_adapter()`` on a real LoRA model (alternating on/off calls);
   ``LayerNorm.eps``; a dict, list, dataclass and SimpleNamespace changed in place; a tuple and an
   enum replaced; a CPU 0-dim tensor attribute changed with ``fill_`` (read implicitly as a
   kernel scalar, and through ``.item()``).
2. Global state: ``allow_tf32`` / ``set_float32_matmul_precision("high")`` (fp32 Linear);
   cuDNN ``allow_tf32`` / ``enabled`` (changes the result) and ``benchmark`` / ``deterministic``
   (must merely match eager) on a conv net; ``torch.use_deterministic_algorithms(True)`` with
   ``histc`` on CUDA (eager raises; so must the graphified call); the SDPA backend through
   ``sdpa_kernel(MATH)``; the default dtype (a forward makes a tensor without a dtype); the
   current device (skipped with fewer than 2 GPUs). Each change is entered, called under, and left.
3. A forward hook / forward pre-hook that changes the output, added on a submodule after
   capture, then removed.
4. ``graphify(fn)`` where ``fn`` calls a module: ``model.train()`` (BatchNorm: batch statistics,
   running statistics updated; buffers compared too), ``load_state_dict(..., assign=True)``,
   ``.to(torch.float64)`` and ``.double()`` (``fn`` casts its input to the weight's dtype, so
   the argument signature does not change).
5. Tensors that are no argument, parameter or buffer, replaced after capture (a plain tensor
   attribute, a module-level global, a closure variable); the freed memory is then filled with
   NaN. Each test is self-contained: today this can be an illegal memory access, which ruins the
   CUDA context of the process, so run them one per process to see each outcome.
6. Same storage, new shape / stride / offset of a buffer or a plain tensor attribute:
   ``self.w = self.w[:4]``, ``w.resize_(4)``, ``w.set_(storage, 0, (4,), (2,))``,
   ``w.set_(storage, 4, (4,))``.
7. Writes the version counter does not see: an input written through ``.data`` in forward, and
   by an opaque custom op that declares no mutation (the caller must see the write, as eagerly);
   a buffer passed as an argument and written by forward (through the module or through the
   argument: the copy-back must not undo it, nor the output read a stale copy); a parameter
   written through ``.data`` with ``num_warmup_iters=2`` (written once per call, as eagerly).
8. Aliasing: an empty output next to an empty input (all have pointer 0) must not come back as
   the input; ``copy_outputs=False`` with the output fed back as the (mutated) input; a
   submodule called twice in one forward of a root that goes piecewise under
   ``copy_outputs=False`` (the first result must survive the second call); in a
   ``graph_region``, a module attribute or a global returned as an output and then passed to
   another graphed callable must never be overwritten by that callable's later copy-in.
9. Training: a parameter changed in place between forward and backward raises a RuntimeError
   about an in-place modification, as eager does (eager checked first); an adopted ``.grad`` read
   by a ``register_post_accumulate_grad_hook`` on another (busy) stream, with ``record_stream``
   as eager code must use, is not overwritten by the next step's replay.
10. Streams: a replay queued on a busy side stream while the caller ``ungraphify``s, leaves the
    ``graph_region``, or invalidates the graph (a replaced parameter, then an eager call) and
    reuses the freed memory on its own stream: the queued call's output must be eager's.
11. ``share_graph``: per-layer scales 1, 1, 0.5, 1 hidden from the structural check (in a dict,
    or named in ``ignore_attrs``); per-layer clamp thresholds 100, 100, 0.5, 100 that the first
    inputs do not reach; a bf16 per-layer scale 1 + 2**-7 that ``assert_close`` tolerates. Every
    layer's output is compared bitwise.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudagraphify as cg
from guard_scenarios import (
    _Alias, _use_b, _CHANGES, _RESHAPES, _Accumulates, _Affine, _AttrTable, _BNNet, _BumpsBias, _ClampLayer,
    _DoublesInput, _EmptyOut, _MakesTensor, _ReadsW, _ReturnsTable, _ScaledLayer, _Temperature,
    _TwiceThenSync, _TwoLinear, _WritesInput, _around, _before_after, _both, _calls, _clone,
    _closure_module, _default_dtype, _differs, _layer_by_layer, _layer_replays, _new_weights,
    _replays, _same, _scribble, on_device,
)

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("quiet_gpu")]

DEV = "cuda"
_pair, _randn = on_device(DEV)
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)
_INPLACE = r"(?i)in-?place|in place"  # eager: "modified by an inplace operation"


# -- calls under changed global state --------------------------------------------------------------

def _under(ref, g, make_args, ctx, *, must_differ: bool = True, n: int = 3) -> None:
    """Calls, then calls inside ``ctx()`` (global state changed), then calls after it."""
    probe = make_args()
    with torch.no_grad():
        _calls(ref, g, make_args, 1, "first call")
        r = _replays(g)
        _calls(ref, g, make_args, n, "before the change")
        assert _replays(g) > r, f"no replay before the change: {cg.stats(g)}"
        before = ref(*_clone(probe))
        with ctx():
            after = ref(*_clone(probe))
            if must_differ:
                assert _differs(before, after), \
                    "test design: the change does not alter eager's output"
            _calls(ref, g, make_args, n, "inside the change")
        _calls(ref, g, make_args, n, "after leaving the change")


# -- 1. module state that is not a tensor ------------------------------------------------------

@pytest.mark.parametrize("kind", list(_CHANGES))
def test_1_non_tensor_attribute_changed_after_capture(kind):
    torch.manual_seed(0)
    ref, g = _pair(_Affine(kind, dim=32))
    with torch.no_grad():
        _before_after(ref, g, _randn(8, 32), _both(_CHANGES[kind], ref, g))


def test_1_submodule_put_behind_another_name_after_capture():
    torch.manual_seed(0)
    ref, g = _pair(_Alias(32))
    with torch.no_grad():
        _before_after(ref, g, _randn(8, 32), _both(_use_b, ref, g))


class _Doubler(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim))

    def apply_to(self, x):
        return x * self.w


class _Tripler(_Doubler):
    def apply_to(self, x):
        return x * self.w * 3


class _ByMethod(nn.Module):
    """Calls a method of a submodule kept in a ModuleList (never ``__call__``)."""

    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.items = nn.ModuleList([_Doubler(dim)])

    def forward(self, x):
        return self.items[0].apply_to(self.lin(x))


def test_1_class_of_a_submodule_whose_method_runs_swapped_after_capture():
    torch.manual_seed(0)
    ref, g = _pair(_ByMethod(32))

    def swap(m):
        m.items[0].__class__ = _Tripler
    with torch.no_grad():
        _before_after(ref, g, _randn(8, 32), _both(swap, ref, g))


def test_1_lazy_module_first_call_then_graphed():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.LazyLinear(32), nn.ReLU()).to(DEV)
    g = cg.graphify(ref)  # (its own first forward initializes it; graphed from the next)
    with torch.no_grad():
        for i in range(4):
            x = _randn(8, 16)()[0]
            _same(g(x), torch.relu(x @ ref[0].weight.T + ref[0].bias), f"call {i}")
    assert cg.stats(g).replays >= 2, cg.stats(g)


def test_1_layernorm_eps_changed_after_capture():
    torch.manual_seed(0)
    ref, g = _pair(nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32)))

    def change(m):
        m[1].eps = 10.0

    with torch.no_grad():
        _before_after(ref, g, _randn(8, 32), _both(change, ref, g))


@pytest.mark.parametrize("how", ["implicit", "item"])
def test_1_cpu_scalar_tensor_attribute_filled_after_capture(how):
    torch.manual_seed(0)
    ref, g = _pair(_Temperature(how, dim=32))
    assert g.temp.device.type == "cpu"
    with torch.no_grad():
        _before_after(ref, g, _randn(8, 32), _both(lambda m: m.temp.fill_(4.0), ref, g))


def test_1_peft_disable_adapter_for_a_reference_pass():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=4, target_modules=["fc1", "fc2"], init_lora_weights=False)
    model = peft.get_peft_model(_TwoLinear(dim=32), cfg).to(DEV).eval()
    ref = copy.deepcopy(model)
    g = cg.graphify(model)
    x0 = torch.randn(8, 32, device=DEV)
    with torch.no_grad():
        on = ref(x0)
        with ref.disable_adapter():
            off = ref(x0)
        assert _differs(on, off), "test design: the adapter does not change the output"
        _calls(ref, g, _randn(8, 32), 3, "adapter on")
        assert _replays(g) > 0, cg.stats(g)
        for i in range(3):  # the usual pattern: a reference pass without the adapter per step
            _calls(ref, g, _randn(8, 32), 1, f"step {i}, adapter on")
            with ref.disable_adapter(), g.disable_adapter():
                _calls(ref, g, _randn(8, 32), 2, f"step {i}, adapter disabled")
        _calls(ref, g, _randn(8, 32), 2, "adapter on again")


# -- 2. global state that changes what kernels compute ---------------------------------------

@contextlib.contextmanager
def _set(obj, name: str, value):
    """``obj.name = value`` for the duration (a global flag such as cuDNN's)."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def _matmul_precision(p: str):
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(p)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


@pytest.mark.parametrize("how", ["allow_tf32", "set_float32_matmul_precision"])
def test_2_tf32_matmul_switched_on_after_capture(how):
    assert not torch.backends.cuda.matmul.allow_tf32  # the default: full fp32 matmuls
    torch.manual_seed(0)
    ref, g = _pair(nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512)))
    ctx = ((lambda: _set(torch.backends.cuda.matmul, "allow_tf32", True)) if how == "allow_tf32"
           else (lambda: _matmul_precision("high")))
    _under(ref, g, _randn(64, 512), ctx)


class _ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(16, 32, 3, padding=1)
        self.c2 = nn.Conv2d(32, 8, 3, padding=1)

    def forward(self, x):
        return self.c2(torch.relu(self.c1(x)))


@pytest.mark.parametrize("flag,value,must_differ", [
    # cuDNN convolutions use TF32 by default, but on the H200 (torch 2.11) turning it off left
    # this convolution's output as it was: it must match eager's
    ("allow_tf32", False, False),
    ("enabled", False, True),  # native convolution instead of cuDNN
    ("benchmark", True, False),  # another algorithm may be picked: must match eager's
    ("deterministic", True, False),
])
def test_2_cudnn_flag_changed_after_capture(flag, value, must_differ):
    torch.manual_seed(0)
    ref, g = _pair(_ConvNet())
    _under(ref, g, _randn(8, 16, 32, 32), lambda: _set(torch.backends.cudnn, flag, value),
           must_differ=must_differ)


class _Histogram(nn.Module):
    """histc on CUDA has no deterministic implementation (atomics): under
    ``use_deterministic_algorithms(True)`` eager raises. No matmul here: cuBLAS raises too under
    that mode unless CUBLAS_WORKSPACE_CONFIG is set, with another message."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(32))

    def forward(self, x):
        y = torch.tanh(x * self.w) * 3
        return y, torch.histc(y, bins=16, min=-4.0, max=4.0)


@contextlib.contextmanager
def _deterministic():
    old = torch.are_deterministic_algorithms_enabled()
    old_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old, warn_only=old_warn)


def test_2_deterministic_algorithms_switched_on_after_capture_raises_as_eager():
    torch.manual_seed(0)
    ref, g = _pair(_Histogram())
    make = _randn(64, 32)
    with torch.no_grad():
        _calls(ref, g, make, 1, "first call")
        r = _replays(g)
        _calls(ref, g, make, 3, "before the change")
        assert _replays(g) > r, cg.stats(g)
        with _deterministic():
            x = make()[0]
            with pytest.raises(RuntimeError, match="does not have a deterministic implementation"):
                ref(x)
            for _ in range(2):
                with pytest.raises(RuntimeError,
                                   match="does not have a deterministic implementation"):
                    g(x)
        _calls(ref, g, make, 2, "after leaving the change")


class _Attention(nn.Module):
    def __init__(self, dim=128, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_2_sdpa_backend_changed_after_capture():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    ref, g = _pair(_Attention().to(torch.bfloat16))
    _under(ref, g, _randn(2, 128, 128, dtype=torch.bfloat16),
           lambda: sdpa_kernel([SDPBackend.MATH]))


def test_2_default_dtype_changed_after_capture():
    torch.manual_seed(0)
    ref, g = _pair(_MakesTensor(dim=32))
    _under(ref, g, _randn(8, 32), lambda: _default_dtype(torch.float64))


class _OnCurrentDevice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        return self.lin(x), torch.ones(4, device="cuda") * 3  # "cuda": the current device


def test_2_current_device_changed_after_capture():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    torch.manual_seed(0)
    ref, g = _pair(_OnCurrentDevice())
    _under(ref, g, _randn(8, 32), lambda: torch.cuda.device(1))


# -- 3. hooks added or removed after capture ------------------------------------------------

@pytest.mark.parametrize("kind", ["forward_hook", "forward_pre_hook"])
def test_3_hook_on_a_submodule_added_then_removed_after_capture(kind):
    torch.manual_seed(0)
    ref, g = _pair(_TwoLinear(dim=32))
    handles = []

    def add(m):
        if kind == "forward_hook":
            handles.append(m.fc1.register_forward_hook(lambda mod, args, out: out * 2))
        else:
            handles.append(m.fc2.register_forward_pre_hook(lambda mod, args: (-args[0],)))

    make = _randn(8, 32)
    with torch.no_grad():
        _before_after(ref, g, make, _both(add, ref, g))
        for h in handles:
            h.remove()
        _calls(ref, g, make, 3, "after removing the hook")


# -- 4. graphify(fn) where fn calls a module -------------------------------------------------

def _fn_pair():
    """A model, its reference copy, and step functions calling each (one graphified).

    ``step`` casts its input to the model's dtype, so ``.double()`` does not change the
    argument signature: only the module the function calls changed."""
    torch.manual_seed(0)
    model = _BNNet(dim=32).to(DEV).eval()
    ref = copy.deepcopy(model)

    def step(x):
        return model(x.to(model.lin1.weight.dtype))

    def ref_step(x):
        return ref(x.to(ref.lin1.weight.dtype))

    return model, ref, cg.graphify(step), ref_step


@pytest.mark.parametrize("change", ["train", "load_state_dict_assign", "to_float64", "double"])
def test_4_graphified_function_sees_changes_of_the_module_it_calls(change):
    model, ref, step, ref_step = _fn_pair()
    do = {
        "train": lambda: (ref.train(), model.train()),
        "load_state_dict_assign": lambda: _new_weights(ref, model),
        "to_float64": lambda: (ref.to(torch.float64), model.to(torch.float64)),
        "double": lambda: (ref.double(), model.double()),
    }[change]

    def buffers_equal():
        _same(dict(model.named_buffers()), dict(ref.named_buffers()), "buffers")

    def probe(x):  # on a copy: a call in training mode updates the running statistics
        m = copy.deepcopy(ref)
        return m(x.to(m.lin1.weight.dtype))

    with torch.no_grad():
        _before_after(ref_step, step, _randn(16, 32), do, check=buffers_equal, probe_ref=probe)


# -- 5. tensors that are no argument, parameter or buffer -------------------------------------

def test_5_plain_tensor_attribute_replaced_after_capture():
    torch.manual_seed(0)
    ref, g = _pair(_around(_AttrTable(dim=64, device=DEV), dim=64))
    held = []

    def change():
        new = torch.randn(64, device=DEV)
        ref[1].table = new.clone()
        g[1].table = new  # the old table's memory is freed here...
        held.extend(_scribble(new))  # ...and taken by NaNs

    with torch.no_grad():
        _before_after(ref, g, _randn(8, 64), change)


_GLOBAL_TABLE: torch.Tensor | None = None


class _ReadsGlobal(nn.Module):
    def forward(self, x):
        return x + _GLOBAL_TABLE


def test_5_module_level_global_tensor_replaced_after_capture():
    global _GLOBAL_TABLE
    torch.manual_seed(0)
    _GLOBAL_TABLE = torch.randn(64, device=DEV)
    ref, g = _pair(_around(_ReadsGlobal(), dim=64))
    held = []

    def change():
        global _GLOBAL_TABLE
        _GLOBAL_TABLE = torch.randn(64, device=DEV)
        held.extend(_scribble(_GLOBAL_TABLE))

    try:
        with torch.no_grad():
            _before_after(ref, g, _randn(8, 64), change)
    finally:
        _GLOBAL_TABLE = None


def test_5_closure_tensor_replaced_after_capture():
    torch.manual_seed(0)
    inner, replace = _closure_module(dim=64, device=DEV)
    ref, g = _pair(_around(inner, dim=64))  # both read the same closure cell
    held = []

    def change():
        new = torch.randn(64, device=DEV)
        replace(new)
        held.extend(_scribble(new))

    with torch.no_grad():
        _before_after(ref, g, _randn(8, 64), change)


# -- 6. same storage, new shape / stride / offset --------------------------------------------

@pytest.mark.parametrize("as_buffer", [True, False], ids=["buffer", "attribute"])
@pytest.mark.parametrize("how", list(_RESHAPES))
def test_6_same_storage_new_shape_stride_or_offset(how, as_buffer):
    torch.manual_seed(0)
    ref, g = _pair(_ReadsW(as_buffer, dim=16, device=DEV))
    with torch.no_grad():
        _before_after(ref, g, _randn(4, 16), _both(_RESHAPES[how], ref, g))


# -- 7. writes the version counter does not see ----------------------------------------------

@pytest.mark.parametrize("how", ["data", "custom_op"])
def test_7_input_written_without_a_version_bump_is_seen_by_the_caller(how):
    torch.manual_seed(0)
    ref, g = _pair(_WritesInput(how, dim=32))
    with torch.no_grad():
        _calls(ref, g, _randn(8, 32), 5, "calls")  # compares the inputs after each call too
    assert _replays(g) > 0, cg.stats(g)


@pytest.mark.parametrize("how", ["write_self_read_arg", "write_arg_read_self"])
def test_7_buffer_passed_as_argument_and_written_by_forward(how):
    torch.manual_seed(0)
    ref, g = _pair(_Accumulates(how, dim=16))
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(8, 16, device=DEV)
            want = ref(x.clone(), ref.total)
            got = g(x, g.total)
            _same(got, want, f"call {i}")
            _same(g.total, ref.total, f"call {i}: the buffer after the call")
    assert _replays(g) > 0, cg.stats(g)


def test_7_parameter_written_through_data_is_written_once_per_call_with_extra_warmups():
    torch.manual_seed(0)
    ref = _BumpsBias(dim=16).to(DEV).eval()
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=2)

    def bias_equal():
        _same(g.lin.bias, ref.lin.bias, "the bias after the call")

    with torch.no_grad():
        _calls(ref, g, _randn(4, 16), 5, "calls", check=bias_equal)
    assert _replays(g) > 0, cg.stats(g)


# -- 8. aliasing ----------------------------------------------------------------------------

@pytest.mark.parametrize("like_input", [False, True], ids=["other_shape", "like_input"])
def test_8_empty_output_is_not_the_empty_input(like_input):
    torch.manual_seed(0)
    ref, g = _pair(_EmptyOut(like_input))
    with torch.no_grad():
        for i in range(4):
            x, e = torch.randn(4, 8, device=DEV), torch.empty(0, device=DEV)
            want = ref(x.clone(), e.clone())
            got = g(x, e)
            _same(got, want, f"call {i}")
            assert got[1] is not e, f"call {i}: the empty output came back as the empty input"
    assert _replays(g) > 0, cg.stats(g)


def test_8_zero_copy_output_fed_back_as_the_mutated_input():
    torch.manual_seed(0)
    ref = _DoublesInput(dim=16).to(DEV).eval()
    g = cg.graphify(copy.deepcopy(ref), copy_outputs=False)
    with torch.no_grad():
        x = torch.randn(4, 16, device=DEV)
        xr = x.clone()
        for i in range(5):  # y = f(y): the previous output (a static one, zero copy) goes back in
            want = ref(xr)
            got = g(x)
            _same(got, want, f"call {i}")
            x, xr = got, want
    assert _replays(g) > 0, cg.stats(g)


def test_8_piecewise_pieces_do_not_inherit_zero_copy_outputs():
    torch.manual_seed(0)
    ref = _TwiceThenSync(dim=32).to(DEV).eval()
    g = cg.graphify(copy.deepcopy(ref), copy_outputs=False)
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(8, 32, device=DEV)
            got = g(x)
            _same(got, ref(x), f"call {i}")  # compared before the next call, as the README says
    assert _replays(g) > 0, cg.stats(g)


_REGION_GLOBAL: torch.Tensor | None = None


def _returns_global(x):
    return x * 2, _REGION_GLOBAL


@pytest.mark.parametrize("owner", ["attribute", "global"])
def test_8_region_never_copies_into_a_tensor_the_caller_owns(owner):
    global _REGION_GLOBAL
    torch.manual_seed(0)
    _REGION_GLOBAL = torch.randn(4, 8, device=DEV)
    if owner == "attribute":
        ref_a = _ReturnsTable(device=DEV).to(DEV).eval()
        a = cg.graphify(copy.deepcopy(ref_a))
        owned = lambda: (a.table, ref_a.table)  # noqa: E731
    else:
        ref_a, a = _returns_global, cg.graphify(_returns_global)
        owned = lambda: (_REGION_GLOBAL, _REGION_GLOBAL)  # noqa: E731
    ref_b = nn.Linear(8, 8).to(DEV).eval()
    b = cg.graphify(copy.deepcopy(ref_b))
    original = owned()[0].clone()
    try:
        with torch.no_grad(), cg.graph_region():
            for i in range(4):
                x = torch.randn(4, 8, device=DEV)
                y, t = a(x)
                _same((y, t), ref_a(x), f"call {i} of a")
                _same(b(t), ref_b(owned()[1]), f"call {i} of b on the owned tensor")
                other = torch.randn(4, 8, device=DEV)
                _same(b(other), ref_b(other), f"call {i} of b on another input")
                mine, theirs = owned()
                _same(mine, original, f"call {i}: the caller's tensor")
                _same(theirs, original, f"call {i}: the reference's tensor")
            assert _replays(a) + _replays(b) > 0, (cg.stats(a), cg.stats(b))
    finally:
        _REGION_GLOBAL = None


# -- 9. training ----------------------------------------------------------------------------

def _mlp(dim: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim))


def _grads_close(g, ref, what: str) -> None:
    for (name, p), q in zip(ref.named_parameters(), g.parameters()):
        assert (q.grad is None) == (p.grad is None), f"{what}: {name}.grad"
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, **GRAD_TOL, msg=f"{what}: {name}.grad")


def test_9_parameter_changed_in_place_between_forward_and_backward_raises_as_eager():
    torch.manual_seed(0)
    model = _mlp(32).to(DEV)
    probe, ref = copy.deepcopy(model), copy.deepcopy(model)
    g = cg.graphify(model)
    y = probe(torch.randn(8, 32, device=DEV))
    with torch.no_grad():
        probe[2].weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()  # eager's error, checked first

    for step in range(4):
        x = torch.randn(8, 32, device=DEV)
        for m in (ref, g):
            m.zero_grad(set_to_none=True)
        want, got = ref(x), g(x)
        _same(got.detach(), want.detach(), f"step {step}")
        want.square().mean().backward()
        got.square().mean().backward()
        _grads_close(g, ref, f"step {step}")
    assert _replays(g) > 0, cg.stats(g)

    y = g(torch.randn(8, 32, device=DEV))
    with torch.no_grad():
        g[2].weight.add_(1.0)
    with pytest.raises(RuntimeError, match=_INPLACE):
        y.sum().backward()


def test_9_adopted_grad_read_on_another_stream_is_not_overwritten_by_the_next_replay():
    torch.manual_seed(0)
    ref = _mlp(256).to(DEV)
    g = cg.graphify(copy.deepcopy(ref))
    side = torch.cuda.Stream()

    def attach(m):
        seen = []

        def hook(p):  # reads .grad late, on a busy stream, protected as eager code must be
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(40_000_000)  # ~20 ms
                seen.append(p.grad * 1)
            p.grad.record_stream(side)

        m[2].weight.register_post_accumulate_grad_hook(hook)
        return seen

    seen_ref, seen_g = attach(ref), attach(g)
    xs = [torch.randn(32, 256, device=DEV) for _ in range(5)]
    outs = {}
    for m in (ref, g):  # each model's steps back to back: the hook's reads stay queued
        for step, x in enumerate(xs):
            m.zero_grad(set_to_none=True)  # .grad None: autograd adopts the gradient
            y = m(x)
            outs.setdefault(id(m), []).append(y.detach().clone())
            y.square().mean().backward()
    torch.cuda.synchronize()
    assert _replays(g) > 0, cg.stats(g)
    _same(outs[id(g)], outs[id(ref)], "forward outputs")
    assert len(seen_g) == len(seen_ref) == len(xs)
    for step, (a, b) in enumerate(zip(seen_g, seen_ref)):
        torch.testing.assert_close(a, b, **GRAD_TOL,
                                   msg=f"step {step}: the hook read another step's gradient")


# -- 10. streams ----------------------------------------------------------------------------

class _Chain(nn.Module):
    """A few ms of matmuls that read the weight throughout and the input again at the end."""

    def __init__(self, dim=2048, depth=24):
        super().__init__()
        self.depth = depth
        self.w = nn.Parameter(torch.randn(dim, dim) / dim ** 0.5)

    def forward(self, x, note=None):
        y = x
        for _ in range(self.depth):
            y = torch.tanh(y @ self.w)
        return y + x


def _clobber(shapes, ticks: int = 60) -> list[torch.Tensor]:
    """On the current stream: take freed memory of these shapes and fill it with NaN, again and
    again for ~30 ms (so some fill lands while a queued replay on another stream reads it)."""
    junk = [torch.empty(s, device=DEV) for s in shapes for _ in range(4)]
    for _ in range(ticks):
        torch.cuda._sleep(1_000_000)  # ~0.5 ms
        for t in junk:
            t.fill_(float("nan"))
    return junk


@pytest.mark.parametrize("release", ["ungraphify", "region_exit", "invalidation"])
def test_10_memory_released_while_another_streams_replay_is_queued(release):
    torch.manual_seed(0)
    ref = _Chain().to(DEV).eval()
    g = cg.graphify(copy.deepcopy(ref))
    side = torch.cuda.Stream()
    make = _randn(1024, 2048)
    region = cg.graph_region() if release == "region_exit" else contextlib.nullcontext()
    with torch.no_grad():
        with region:
            _calls(ref, g, make, 1, "first call")
            r = _replays(g)
            _calls(ref, g, make, 2, "before")
            assert _replays(g) > r, cg.stats(g)
            x = make()[0]
            want = ref(x)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(20_000_000)  # ~10 ms: the replay below stays queued
                got = g(x)
            if release == "ungraphify":
                cg.ungraphify(g)
        if release == "invalidation":
            new = torch.randn_like(ref.w) / 2048 ** 0.5
            ref.w = nn.Parameter(new.clone())
            g.w = nn.Parameter(new)
            small = torch.randn(1024, 2048, device=DEV)
            _same(g(small, note=[0]), ref(small, note=[0]), "the call that invalidates")
        junk = _clobber([x.shape, ref.w.shape])
        torch.cuda.synchronize()
        del junk
        _same(got, want, "the call queued on the side stream")
        if release != "ungraphify":
            _calls(ref, g, make, 2, "after")


# -- 11. share_graph per-layer values --------------------------------------------------------

@pytest.mark.parametrize("hidden", ["dict", "ignore_attrs"])
def test_11_share_graph_per_layer_scale_where_template_and_partner_agree(hidden):
    torch.manual_seed(0)
    layers = nn.ModuleList(_ScaledLayer(s, hidden, dim=64) for s in (1.0, 1.0, 0.5, 1.0))
    layers = layers.to(DEV).eval()
    ref = copy.deepcopy(layers)
    opts = {"ignore_attrs": ("scale",)} if hidden == "ignore_attrs" else {}
    cg.share_graph(layers, **opts)
    with torch.no_grad():
        for i in range(4):
            _layer_by_layer(layers, ref, torch.randn(8, 64, device=DEV), f"call {i}")
    assert _layer_replays(layers) > 0, [cg.stats(m) for m in layers]


def test_11_share_graph_per_layer_clamp_the_first_inputs_do_not_reach():
    torch.manual_seed(0)
    layers = nn.ModuleList(_ClampLayer(v, dim=64) for v in (100.0, 100.0, 0.5, 100.0))
    layers = layers.to(DEV).eval()
    ref = copy.deepcopy(layers)
    cg.share_graph(layers, ignore_attrs=("limit",))
    small = lambda: torch.randn(8, 64, device=DEV) * 0.01  # noqa: E731
    large = lambda: torch.randn(8, 64, device=DEV) * 10  # noqa: E731
    with torch.no_grad():
        for i in range(3):
            _layer_by_layer(layers, ref, small(), f"small input {i}")
        assert _layer_replays(layers) > 0, [cg.stats(m) for m in layers]
        y = ref[1](ref[0](large()))
        assert _differs(ref[2](y), ref[2].lin(y)), "test design: the large input is not clamped"
        for i in range(3):
            _layer_by_layer(layers, ref, large(), f"large input {i}")
        _layer_by_layer(layers, ref, small(), "small input again")


def test_11_share_graph_bf16_per_layer_scale_within_assert_close_tolerance():
    torch.manual_seed(0)
    scales = (1.0, 1.0, 1.0 + 2 ** -7, 1.0)
    layers = nn.ModuleList(_ScaledLayer(s, "dict", dim=64) for s in scales)
    layers = layers.to(DEV, torch.bfloat16).eval()
    ref = copy.deepcopy(layers)
    cg.share_graph(layers)
    make = lambda: torch.randn(8, 64, device=DEV, dtype=torch.bfloat16)  # noqa: E731
    with torch.no_grad():
        x = make()
        with_scale, without = ref[2](x), ref[2].lin(x)
        assert not torch.equal(with_scale, without), "test design: the scale changes no bit"
        torch.testing.assert_close(with_scale, without)  # within assert_close's bf16 tolerance
        for i in range(4):
            _layer_by_layer(layers, ref, make(), f"call {i}")
    assert _layer_replays(layers) > 0, [cg.stats(m) for m in layers]


class _CountsHits(nn.Module):
    """Counts its calls in a plain tensor attribute (not a buffer) that its output reads."""

    def __init__(self, dim: int = 64, device=None):
        super().__init__()
        self.lin = nn.Linear(dim, dim, device=device)
        self.hits = torch.zeros(dim, device=device)

    def forward(self, x):
        self.hits.add_(1)
        return self.lin(x) + self.hits


@pytest.mark.parametrize("warmups", [1, 3])
def test_5_plain_tensor_attribute_written_by_forward(warmups):
    """Its writes happen once per call: not again in the extra warm-ups or the capture (a
    CUDA capture runs no kernel, so the tensor is not copied around it)."""
    torch.manual_seed(0)
    ref = _CountsHits(device=DEV)
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(64, device=DEV)
            _same(g(x), ref(x), f"call {i}")
            _same(g.hits, ref.hits, f"hits after call {i}")
    assert cg.stats(g).replays >= 3, cg.stats(g)


def test_5_plain_tensor_attribute_passed_as_the_argument():
    """The forward writes the attribute and reads its argument, which is that attribute: a
    replay would read the argument's copy made before the write (it runs eagerly)."""
    torch.manual_seed(0)
    ref = _CountsHits(device=DEV)
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(64, device=DEV)
            _same(g(x), ref(x), f"call {i}")
        replays = cg.stats(g).replays
        assert replays >= 1, cg.stats(g)
        for i in range(3):
            _same(g(g.hits), ref(ref.hits), f"own attribute, call {i}")
            _same(g.hits, ref.hits, f"hits after call {i}")
        assert cg.stats(g).replays == replays, cg.stats(g)
        x = torch.randn(64, device=DEV)
        _same(g(x), ref(x), "after")
        assert cg.stats(g).replays == replays + 1, cg.stats(g)


class _GrowsLog(nn.Module):
    """Logs a row of each output into a plain tensor attribute grown by ``resize_`` (r63 I)."""

    def __init__(self, dim: int = 64, device=None):
        super().__init__()
        self.lin = nn.Linear(dim, dim, device=device)
        self.log = torch.zeros(0, device=device)

    def forward(self, x):
        h = self.lin(x)
        n = self.log.numel()
        self.log.resize_(n + h.shape[-1])
        self.log[n:].copy_(h[0])
        return h


@pytest.mark.parametrize("warmups", [1, 3])
def test_6_plain_tensor_attribute_grown_by_resize(warmups):
    """A replay resizes nothing, and the capture's run would move the log into the graph's
    pool without the real call's bytes: the root runs eagerly (piecewise)."""
    torch.manual_seed(0)
    ref = _GrowsLog(device=DEV)
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(2, 64, device=DEV)
            _same(g(x), ref(x), f"call {i}")
            _same(g.log, ref.log, f"log after call {i}")
    # (its Linear graphed, or given back by its trial: one kernel; the machine decides)
    s = cg.stats(g)
    assert any("RELAYOUT" in k and "piecewise" in k for k in s.eager_calls), s
