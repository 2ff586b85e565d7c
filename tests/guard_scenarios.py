"""What tests/test_guards.py (CPU, simulated capture) and tests/test_gpu_guards.py (CUDA) share:
the comparison of a graphified callable with its eager reference, and the modules of issue 15's
scenarios.

The device and the sizes are arguments: ``on_device(dev)`` gives a test file its ``_pair`` and
``_randn``; a module that makes a tensor when it is built takes ``device``; ``dim`` is the width
of a module's layers (the CPU file keeps the default, the GPU file passes the sizes it uses).

Only cudagraphify's public API is used (``cg.graphify``, ``cg.stats``), and none of its
internals are imported: the GPU file also runs against older versions of the library.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import types

import torch
import torch.utils._pytree as pytree
from torch import nn

import cudagraphify as cg


# -- comparing with eager ----------------------------------------------------------------------

def _meta(t: torch.Tensor):
    return (t.dtype, t.device, tuple(t.shape))


def _same(got, want, what: str = "") -> None:
    """Same structure; every tensor leaf with eager's dtype, device, shape and bits."""
    g_leaves, g_spec = pytree.tree_flatten(got)
    w_leaves, w_spec = pytree.tree_flatten(want)
    assert g_spec == w_spec, f"{what}: structure {g_spec} vs eager {w_spec}"
    for k, (a, b) in enumerate(zip(g_leaves, w_leaves)):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"{what}, leaf {k}: {type(a)} vs a tensor"
            assert _meta(a) == _meta(b), f"{what}, leaf {k}: {_meta(a)} vs eager {_meta(b)}"
            if not torch.equal(a, b):
                diff = (a.double() - b.double()).abs().max().item()
                raise AssertionError(f"{what}, leaf {k}: differs from eager (max |diff| {diff})")
        else:
            assert a == b, f"{what}, leaf {k}: {a!r} vs eager {b!r}"


def _differs(a, b) -> bool:
    try:
        _same(a, b)
    except AssertionError:
        return True
    return False


def _clone(args):
    return pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, args)


def _replays(g) -> int:
    return cg.stats(g).replays


def _calls(ref, g, make_args, n: int, what: str, check=None) -> None:
    """``n`` calls with fresh inputs: outputs, and the inputs after the call, equal eager's."""
    for i in range(n):
        args = make_args()
        ref_args = _clone(args)
        want = ref(*ref_args)
        got = g(*args)
        _same(got, want, f"{what}, call {i}")
        _same(args, ref_args, f"{what}, call {i}: the inputs after the call")
        if check is not None:
            check()


def _before_after(ref, g, make_args, change, *, n: int = 3, check=None,
                  must_differ: bool = True, probe_ref=None) -> None:
    """Calls before ``change()`` (graph path proven), ``change()`` (applied to both ``ref`` and
    ``g`` by the caller's function), calls after it; every result equal to eager's.
    ``probe_ref``: what computes eager's output for the design check, where calling ``ref``
    would change its state (a BatchNorm in training mode)."""
    probe = make_args()
    probe_ref = probe_ref or ref
    _calls(ref, g, make_args, 1, "first call", check)
    r = _replays(g)
    _calls(ref, g, make_args, n, "before the change", check)
    assert _replays(g) > r, f"no replay before the change: {cg.stats(g)}"
    before = probe_ref(*_clone(probe))
    change()
    after = probe_ref(*_clone(probe))
    if must_differ:
        assert _differs(before, after), "test design: the change does not alter eager's output"
    _calls(ref, g, make_args, n, "after the change", check)


def _both(f, ref, g):
    return lambda: (f(ref), f(g))


def on_device(dev):
    """``(_pair, _randn)`` for tests on ``dev``."""

    def _pair(model: nn.Module):
        """An eager reference (``model`` on ``dev``) and a graphified deep copy of it."""
        ref = model.to(dev).eval()
        return ref, cg.graphify(copy.deepcopy(ref))

    def _randn(*shape, dtype=torch.float32):
        """A maker of fresh arguments: one random tensor on ``dev``."""
        return lambda: (torch.randn(*shape, device=dev, dtype=dtype),)

    return _pair, _randn


# -- 1. module state that is not a tensor ------------------------------------------------------

@dataclasses.dataclass
class _Cfg:
    scale: float
    shift: float


class _Act(enum.Enum):
    RELU = "relu"
    TANH = "tanh"


class _Affine(nn.Module):
    """``lin(x)`` then a post-op chosen by non-tensor state of many kinds."""

    def __init__(self, kind: str, dim: int = 8):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(dim, dim)
        self.scale = 2.0  # float
        self.shift = 1  # int
        self.use_relu = True  # bool
        self.cfg_dict = {"scale": 2.0, "shift": 0.5}
        self.coef_list = [2.0, 0.5]
        self.coef_tuple = (2.0, 0.5)
        self.cfg_dc = _Cfg(2.0, 0.5)
        self.cfg_ns = types.SimpleNamespace(scale=2.0, shift=0.5)
        self.act = _Act.RELU

    def forward(self, x):
        y = self.lin(x)
        k = self.kind
        if k == "float":
            return y * self.scale
        if k == "int":
            return torch.roll(y, self.shift, dims=-1)
        if k == "bool":
            return torch.relu(y) if self.use_relu else y
        if k == "dict":
            return y * self.cfg_dict["scale"] + self.cfg_dict["shift"]
        if k == "list":
            return y * self.coef_list[0] + self.coef_list[1]
        if k == "tuple":
            return y * self.coef_tuple[0] + self.coef_tuple[1]
        if k == "dataclass":
            return y * self.cfg_dc.scale + self.cfg_dc.shift
        if k == "namespace":
            return y * self.cfg_ns.scale + self.cfg_ns.shift
        if k == "enum":
            return torch.relu(y) if self.act is _Act.RELU else torch.tanh(y)
        raise AssertionError(k)


def _set_list(m):
    m.coef_list[0] = -1.0


_CHANGES = {
    "float": lambda m: setattr(m, "scale", 0.5),
    "int": lambda m: setattr(m, "shift", 3),
    "bool": lambda m: setattr(m, "use_relu", False),
    "dict": lambda m: m.cfg_dict.__setitem__("scale", -1.0),  # in place
    "list": _set_list,  # in place
    "tuple": lambda m: setattr(m, "coef_tuple", (-1.0, 0.5)),  # immutable: replaced
    "dataclass": lambda m: setattr(m.cfg_dc, "scale", -1.0),  # in place
    "namespace": lambda m: setattr(m.cfg_ns, "scale", -1.0),  # in place (an HF-config-like object)
    "enum": lambda m: setattr(m, "act", _Act.TANH),
}


class _Alias(nn.Module):
    """Calls one of two submodules through a name that holds either (``self.use = self.b``
    after capture: the same modules and parameters, another forward)."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.a, self.b = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.use = self.a

    def forward(self, x):
        return self.use(x) + self.b(x)


def _use_b(m: nn.Module) -> None:
    m.use = m.b


class _Temperature(nn.Module):
    """Divides by a CPU 0-dim tensor attribute (a plain attribute: ``.to`` leaves it on the
    CPU): as an operand (on CUDA its value becomes a kernel scalar at capture), or through
    ``.item()`` where ``how`` is ``"item"``."""

    def __init__(self, how: str, dim: int = 8):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(dim, dim)
        self.temp = torch.tensor(2.0)

    def forward(self, x):
        if self.how == "item":
            return self.lin(x) / self.temp.item()
        return self.lin(x) / self.temp


class _TwoLinear(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


# -- 2. the default dtype ------------------------------------------------------------------

class _MakesTensor(nn.Module):
    """Creates a tensor without a dtype: the default dtype decides it (and the result's)."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return self.lin(x) * torch.full((x.shape[-1],), 0.1, device=x.device)


@contextlib.contextmanager
def _default_dtype(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


# -- 4. graphify(fn) where fn calls a module -------------------------------------------------

class _BNNet(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)
        self.lin2 = nn.Linear(dim, dim)

    def forward(self, x):
        return self.lin2(torch.relu(self.bn(self.lin1(x))))


def _new_weights(ref, model):
    sd = {k: (torch.rand_like(v) + 0.5) if v.is_floating_point() else v.clone()
          for k, v in ref.state_dict().items()}
    ref.load_state_dict(sd, assign=True)
    model.load_state_dict({k: v.clone() for k, v in sd.items()}, assign=True)


# -- 5. tensors that are no argument, parameter or buffer -------------------------------------

def _scribble(like: torch.Tensor, n: int = 16) -> list[torch.Tensor]:
    """Tensors of ``like``'s size, filled with NaN: they take memory just freed (held by the
    caller while the calls after a change run)."""
    return [torch.full_like(like, float("nan")) for _ in range(n)]


def _around(inner: nn.Module, dim: int = 8) -> nn.Sequential:
    """``inner`` between two Linears: if cudagraphify refuses ``inner``, its neighbours are still
    graphed, so replays still prove the graph path."""
    return nn.Sequential(nn.Linear(dim, dim), inner, nn.Linear(dim, dim))


class _AttrTable(nn.Module):
    def __init__(self, dim: int = 8, device=None):
        super().__init__()
        self.table = torch.randn(dim, device=device)  # a plain attribute: no buffer

    def forward(self, x):
        return x + self.table


def _closure_module(dim: int = 8, device=None):
    """A module reading a tensor of its closure, and the function that replaces that tensor."""
    table = torch.randn(dim, device=device)

    class ReadsClosure(nn.Module):
        def forward(self, x):
            return x + table

    def replace(new):
        nonlocal table
        table = new

    return ReadsClosure(), replace


# -- 6. same storage, new shape / stride / offset --------------------------------------------

class _ReadsW(nn.Module):
    def __init__(self, as_buffer: bool, dim: int = 8, device=None):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        w = torch.randn(8, device=device)
        if as_buffer:
            self.register_buffer("w", w)
        else:
            self.w = w

    def forward(self, x):
        return self.lin(x) * self.w.sum()


_RESHAPES = {
    "slice": lambda m: setattr(m, "w", m.w[:4]),
    "resize_": lambda m: m.w.resize_(4),
    "set_stride": lambda m: m.w.set_(m.w.untyped_storage(), 0, (4,), (2,)),
    "set_offset": lambda m: m.w.set_(m.w.untyped_storage(), 4, (4,), (1,)),
}


# -- 7. writes the version counter does not see ----------------------------------------------

@torch.library.custom_op("cgguards::double_undeclared", mutates_args=())
def _double_undeclared(x: torch.Tensor) -> torch.Tensor:
    """An opaque kernel (as a Triton or C++ one would) that writes its input without declaring
    it and without bumping its version counter."""
    x.data.mul_(2)
    return x + 1


class _WritesInput(nn.Module):
    def __init__(self, how: str, dim: int = 8):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        y = self.lin(x)
        if self.how == "data":
            x.data.add_(1.0)
            return y
        return y + _double_undeclared(x)


class _Accumulates(nn.Module):
    """Called as ``m(x, m.total)``: a buffer passed as an argument and written by forward."""

    def __init__(self, how: str, dim: int = 8):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(dim, dim)
        self.register_buffer("total", torch.zeros(dim))

    def forward(self, x, total):
        if self.how == "write_self_read_arg":
            self.total.add_(x.sum(0))
            return self.lin(x) + total
        total.add_(x.sum(0))
        return self.lin(x) + self.total


class _BumpsBias(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        self.lin.bias.data.add_(1.0)  # an in-forward update the version counter does not see
        return self.lin(x)


# -- 8. aliasing ----------------------------------------------------------------------------

class _EmptyOut(nn.Module):
    def __init__(self, like_input: bool):
        super().__init__()
        self.like_input = like_input
        self.lin = nn.Linear(8, 8)

    def forward(self, x, e):
        if self.like_input:
            empty = torch.empty_like(e)  # same shape and dtype as the empty input, not it
        else:
            empty = torch.zeros(0, 3, device=x.device, dtype=torch.float64)
        return self.lin(x), empty


class _DoublesInput(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.b = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        x.mul_(2)
        return x + self.b


class _TwiceThenSync(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())

    def forward(self, x):
        a = self.block(x)
        b = self.block(x * 2)  # the same submodule, same signature, a second time
        if b.sum() > 1e30:  # a host sync: the root runs piecewise, self.block is graphed
            b = b * 0
        return a, b


class _ReturnsTable(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.table = torch.randn(4, 8, device=device)  # the caller's tensor: a plain attribute

    def forward(self, x):
        return self.lin(x), self.table


# -- 11. share_graph per-layer values --------------------------------------------------------

class _ScaledLayer(nn.Module):
    def __init__(self, scale: float, hidden: str, dim: int = 8):
        super().__init__()
        self.hidden = hidden
        self.lin = nn.Linear(dim, dim)
        if hidden == "dict":
            self.cfg = {"scale": scale}  # share_graph's structural check does not compare dicts
        else:
            self.scale = scale  # named in ignore_attrs

    def forward(self, x):
        s = self.cfg["scale"] if self.hidden == "dict" else self.scale
        return self.lin(x) * s


class _ClampLayer(nn.Module):
    def __init__(self, limit: float, dim: int = 8):
        super().__init__()
        self.lin = nn.Linear(dim, dim, bias=False)
        self.limit = limit  # named in ignore_attrs

    def forward(self, x):
        return torch.clamp(self.lin(x), max=self.limit)


def _layer_by_layer(layers, ref, x, what: str) -> None:
    """Each layer applied in turn, as a parent's loop does; every layer's output equals eager's."""
    y, want = x, x
    for k, (layer, r) in enumerate(zip(layers, ref)):
        y, want = layer(y), r(want)
        _same(y, want, f"{what}, layer {k}")


def _layer_replays(layers) -> int:
    return sum(_replays(m) for m in layers)
