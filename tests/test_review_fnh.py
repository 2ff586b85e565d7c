"""Review of 941dac1 (an autograd Function's backward reading a tensor from outside through a
helper it calls: ``_hooks._outside_in`` looks into the functions it loads, two levels down, not
torch's own).

The findings were strict xfails; all are fixed in the commit after (torch-decorated helpers
unwrapped before the torch filter, no getattr on a loaded object, partials, lru_cache wrappers,
callable objects and methods of a global object looked into with ``self.<attr>`` reads, default
arguments screened, four calls deep with one memo per walk, installed libraries' helpers reached
by a global name not looked into), plain tests now; controls are plain tests. CPU, on the simulated backend (``sim``).
"""

from __future__ import annotations

import dis
import functools
import types
import warnings

import pytest
import torch

import cudagraphify as cg
from cudagraphify._hooks import _outside_in, backward_reads

from test_review_fn import _Lin, _run


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


SCALE = torch.ones(())  # the global tensor the helpers read; the tests rebind it


def _rebind():
    global SCALE
    SCALE = torch.full((), 5.0)


@pytest.fixture
def fresh():
    global SCALE
    SCALE = torch.ones(())
    yield


def _fn(backward):
    """An autograd Function (identity forward) whose backward is ``backward(ctx, grad)``."""
    return type("Fn", (torch.autograd.Function,), {
        "__module__": __name__,
        "forward": staticmethod(lambda ctx, x: x * 1), "backward": staticmethod(backward)})


def _model(fn):
    return type("M", (_Lin,), {"fn": fn})


# -- (1) silent stale gradients still missed ---------------------------------------------------

# (a) torch's decorators: the helper's wrapper is torch's code, so the torch filter (applied
# before unwrapping) skips the user's function it wraps.
@torch.no_grad()
def _scale_no_grad(g):
    return g * SCALE


@torch.compiler.disable
def _scale_compiler_disabled(g):
    return g * SCALE


class _NoGradHelper(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return _scale_no_grad(grad)


class _DisabledHelper(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return _scale_compiler_disabled(grad)


@pytest.mark.parametrize("fn", [_NoGradHelper, _DisabledHelper],
                         ids=["torch.no_grad()", "torch.compiler.disable"])
def test_torch_decorated_helper(sim, fresh, fn):
    _run(_model(fn), _rebind)


def _closure_no_grad_fn():
    helper = _scale_no_grad  # (a closure variable: looked into before this commit)

    class _ClosureNoGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, grad):
            return helper(grad)
    return _ClosureNoGrad


def test_closure_torch_decorated_helper_regression(sim, fresh):
    _run(_model(_closure_no_grad_fn()), _rebind)


# (b) callables that are not FunctionType: a partial, an lru_cache wrapper, a callable object
def _scale_pow(g, p=1):
    return g * SCALE ** p


_PARTIAL = functools.partial(_scale_pow, p=1)


@functools.lru_cache(maxsize=4)  # (keyed by the gradient tensor's id: runs on every call)
def _scale_cached(g):
    return g * SCALE


class _Scaler:
    def __init__(self):
        self.s = torch.ones(())

    def __call__(self, g):
        return g * SCALE

    def by_self(self, g):
        return g * self.s


_SCALER = _Scaler()
_BOUND = _SCALER.by_self


_CALLABLES = {
    "functools.partial": (_fn(lambda ctx, g: _PARTIAL(g)), _rebind),
    "functools.lru_cache": (_fn(lambda ctx, g: _scale_cached(g)), _rebind),
    "callable object (__call__)": (_fn(lambda ctx, g: _SCALER(g)), _rebind),
    "method reading self.<tensor>": (_fn(lambda ctx, g: _SCALER.by_self(g)),
                                     lambda: setattr(_SCALER, "s", torch.full((), 5.0))),
    "bound method global reading self.<tensor>": (
        _fn(lambda ctx, g: _BOUND(g)), lambda: setattr(_SCALER, "s", torch.full((), 5.0))),
}


@pytest.mark.parametrize("case", list(_CALLABLES))
def test_helper_not_a_plain_function(sim, fresh, case):
    _SCALER.s = torch.ones(())
    fn, rebind = _CALLABLES[case]
    _run(_model(fn), rebind)


# (c) a default argument holding a mutable container of tensors
_TABLE = {"s": torch.ones(())}


def _scale_default(g, table=_TABLE):
    return g * table["s"]


def test_helper_default_argument_holding_a_tensor(sim):
    _TABLE["s"] = torch.ones(())
    _run(_model(_fn(lambda ctx, g: _scale_default(g))),
         lambda: _TABLE.__setitem__("s", torch.full((), 5.0)))


# (d) a decorator without __wrapped__ costs one of the two levels
def _plain_decorator(f):
    def wrapper(*a):
        return f(*a)
    return wrapper


def _read(g):
    return g * SCALE


@_plain_decorator
def _decorated(g):  # (wrapper -> _decorated -> _read: the read is three levels down)
    return _read(g)


def test_helper_behind_a_plain_decorator(sim, fresh):
    _run(_model(_fn(lambda ctx, g: _decorated(g))), _rebind)


# -- (2) false refusals ------------------------------------------------------------------------

# bitsandbytes' pattern (QLoRA, double quant): ``MatMul4Bit.backward`` calls
# ``F.dequantize_4bit`` (one attribute away), which calls ``dequantize_blockwise`` by its global
# name, which loads the module-level cache ``name2qmap`` (a dict holding the "dynamic" code tensor
# once any quantization filled it) only where no quant_state is passed: never on this path (the
# nested state carries its code). Two levels down, a load in a branch not taken: now refused.
_BNB = types.ModuleType("_review_bnb_functional")
exec(compile("""
import torch
name2qmap = {}

def create_dynamic_map():
    return torch.linspace(-1, 1, 256)

def dequantize_blockwise(A, quant_state=None):
    if quant_state is None:  # (not taken here: the state carries its code)
        if "dynamic" not in name2qmap:
            name2qmap["dynamic"] = create_dynamic_map()
        code = name2qmap["dynamic"]
    else:
        code = quant_state["code"]
    return A * code[255]

def dequantize_4bit(B, state):
    absmax = state["absmax"]
    if state["nested"]:
        absmax = dequantize_blockwise(absmax, state["state2"])
    return B * absmax
""", "/venv/lib/python3/site-packages/_review_bnb/functional.py", "exec"), _BNB.__dict__)
# (compiled as an installed library's file, as bitsandbytes' is: its helpers reached by a
# global name are not looked into)
_BNB.name2qmap["dynamic"] = _BNB.create_dynamic_map()  # (filled when the weights were quantized)
F = _BNB


class _MatMul4Bit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, B):
        ctx.state = {"absmax": torch.full((), 2.0), "nested": True,
                     "state2": {"code": B.new_ones(256)}}
        ctx.save_for_backward(B)
        return x * F.dequantize_4bit(B, ctx.state)

    @staticmethod
    def backward(ctx, grad_output):
        (B,) = ctx.saved_tensors
        return grad_output * F.dequantize_4bit(B, ctx.state), None


class _QLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("B", torch.full((4,), 0.5))

    def forward(self, x):
        return _MatMul4Bit.apply(self.lin(x), self.B)


def test_library_cache_two_levels_down_keeps_the_graph(sim):
    s = _run(_QLinear, lambda: None)
    assert s.replays >= 2 and not s.eager_calls, s.eager_calls


# -- (3) exceptions, side effects, cost of the new recursion -------------------------------------

class _AttrDict(dict):  # (the hand-rolled config class: a missing key raises KeyError)
    __getattr__ = dict.__getitem__


_CFG = _AttrDict(scale=2.0)


class _ReadsConfig(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return grad * _CFG.scale


def test_global_with_a_raising_getattr_does_not_break_the_call(sim):
    s = _run(_model(_ReadsConfig), lambda: None)
    assert s.replays >= 2 and not s.eager_calls, s.eager_calls


def test_attrdict_is_read_without_its_getattr():
    # (the screen ran ``getattr(v, "__func__", v)``, which raised KeyError out of the screen)
    assert _outside_in(_ReadsConfig.backward) is None


class _ReadsOps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return torch.ops.aten.mul(grad, 1)


def test_screen_leaves_torch_ops_alone():
    torch.ops.__dict__.pop("__func__", None)
    _outside_in(_ReadsOps.backward)
    assert "__func__" not in torch.ops.__dict__


def _wide_helpers(n):
    """``backward`` calls n helpers that each call the same n leaves."""
    scope: dict = {}
    src = "".join(f"def leaf{i}(x):\n    return x + {i}\n" for i in range(n))
    call_leaves = " + ".join(f"leaf{i}(x)" for i in range(n))
    src += "".join(f"def mid{j}(x):\n    return {call_leaves}\n" for j in range(n))
    src += "def backward(ctx, x):\n    return " + " + ".join(f"mid{j}(x)" for j in range(n))
    exec(compile(src, "<wide>", "exec"), scope)
    return scope["backward"]


def test_shared_helpers_are_disassembled_once(monkeypatch):
    n = 60
    backward = _wide_helpers(n)
    count = 0
    original = dis.get_instructions

    def counting(*a, **k):
        nonlocal count
        count += 1
        return original(*a, **k)
    monkeypatch.setattr(dis, "get_instructions", counting)
    assert _outside_in(backward) is None
    assert count <= 2 * n + 1, count  # (each function once)


# -- controls ----------------------------------------------------------------------------------

_OTHER = types.ModuleType("_review_fnh_other")  # a helper whose globals are another module's
exec("import torch\nTABLE = torch.ones(())\ndef scale(g):\n    return g * TABLE\n",
     _OTHER.__dict__)


def test_helper_of_another_modules_globals(sim):
    _OTHER.TABLE = torch.ones(())
    _run(_model(_fn(lambda ctx, g: _OTHER.scale(g))),
         lambda: setattr(_OTHER, "TABLE", torch.full((), 5.0)))


def _wraps_decorator(f):
    @functools.wraps(f)
    def wrapper(*a):
        return f(*a)
    return wrapper


@_wraps_decorator
def _wrapped(g):
    return _read(g)


def test_helper_behind_a_wraps_decorator(sim, fresh):
    _run(_model(_fn(lambda ctx, g: _wrapped(g))), _rebind)


def test_bound_method_global_reading_a_global(sim, fresh):
    class _K:
        def scale(self, g):
            return g * SCALE
    bound = _K().scale
    _run(_model(_fn(lambda ctx, g: bound(g))), _rebind)  # (the closure's bound method: __func__)


def _recursive(g, n=3):
    return g if n == 0 else _recursive(g, n - 1)


def _recursive_reading(g, n=3):
    return g * SCALE if n == 0 else _recursive_reading(g, n - 1)


def test_recursive_helpers():
    assert _outside_in(_fn(lambda ctx, g: _recursive(g)).backward) is None
    assert "the global 'SCALE'" in _outside_in(_fn(lambda ctx, g: _recursive_reading(g)).backward)


_NP_LIKE = types.ModuleType("_review_fnh_np")  # a helper that loads a global module only
_NP_LIKE.ones = lambda: 1


def _uses_module(g):
    return g * _NP_LIKE.ones() * torch.pi


def test_helper_loading_a_global_module_keeps_the_graph(sim):
    s = _run(_model(_fn(lambda ctx, g: _uses_module(g))), lambda: None)
    assert s.replays >= 2 and not s.eager_calls, s.eager_calls


class _LazyProxy:  # (attribute access with a side effect: getattr_static must not trigger it)
    touched = 0

    def __getattr__(self, name):
        if name == "__func__":
            raise AttributeError(name)
        type(self).touched += 1
        return 1.0


_LAZY = _LazyProxy()


def test_getattr_static_triggers_no_getattr(sim):
    _LazyProxy.touched = 0
    assert _outside_in(_fn(lambda ctx, g: g * _LAZY.factor).backward) is None
    assert _LazyProxy.touched == 0


def test_plain_global_callable_object_without_tensors_keeps_the_graph(sim):
    class _Pure:
        def __call__(self, g):
            return g * 2
    pure = _Pure()
    s = _run(_model(_fn(lambda ctx, g: pure(g))), lambda: None)
    assert s.replays >= 2 and not s.eager_calls, s.eager_calls


def test_walk_still_finds_a_helper_read_in_a_long_graph(fresh):
    x = torch.randn(2, requires_grad=True)
    y = _fn(lambda ctx, g: _read(g)).apply(x)
    for _ in range(100):
        y = y + 1
    (f,) = backward_reads([y])
    assert "through" in f.where
