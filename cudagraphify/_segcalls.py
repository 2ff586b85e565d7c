"""Segments (see :mod:`._segrun`): what the record keeps of each top-level torch call of a
forward (the structure of its arguments with their plain values, where each tensor comes from,
the global state it ran under) and the check of a member call compiled from it
(:class:`_Matcher`), with the segments they form."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch

from ._guards import FlagsGuard
from ._probe import own_file

VARYING = "its arguments change between calls"
_META = frozenset("Tensor." + n for n in (
    "shape", "size", "dim", "ndim", "dtype", "device", "numel", "__len__", "is_contiguous",
    "stride", "storage_offset", "is_cuda", "requires_grad", "layout", "is_floating_point",
    "is_complex", "element_size", "nelement", "ndimension", "is_leaf", "grad_fn", "is_sparse",
    "is_quantized", "is_meta", "is_cpu", "is_nested", "get_device", "__hash__"))
_CONSTS = (int, bool, str, type(None), torch.dtype, torch.device, torch.memory_format,
           torch.layout, type(Ellipsis))
_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter
_strided = torch.strided
_grad_enabled = torch.is_grad_enabled
_inference = torch.is_inference_mode_enabled
_use_count = torch._C._storage_Use_Count
_MethodWrapper = type(torch.Tensor.shape.__get__)  # a property read: a new object each time
_MISSING = object()
_getframe = sys._getframe
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
P, S, X = 0, 1, 2  # a tensor argument's source: a member's output, a static, a copy


class _Opaque(Exception):
    """An argument that is neither a tensor nor a plain value: the call is a boundary."""


def _flat(v: Any, leaves: list) -> Any:
    """``v``'s structure with its plain values (floats by their bits); its tensors in ``leaves``."""
    t = type(v)
    if t is _Tensor or t is _Parameter:
        leaves.append(v)
        return 0
    if t is tuple or t is list or t is torch.Size:
        return (t, tuple([_flat(x, leaves) for x in v]))
    if t is float:
        return (float, v.hex())
    if t is slice:
        return (slice, _flat(v.start, leaves), _flat(v.stop, leaves), _flat(v.step, leaves))
    if t in _CONSTS:
        return (t, v)
    raise _Opaque(t.__name__)


def _build(s: Any, it) -> Any:
    if s == 0 and type(s) is int:
        return next(it)
    t = s[0]
    if t is float:
        return float.fromhex(s[1])
    if t is slice:
        return slice(_build(s[1], it), _build(s[2], it), _build(s[3], it))
    if t is tuple or t is list or t is torch.Size:
        return t([_build(x, it) for x in s[1]])
    return s[1]


def _structure(args: tuple, kwargs: dict, leaves: list) -> tuple:
    return (_flat(args, leaves), tuple((k, _flat(v, leaves)) for k, v in kwargs.items()))


def _call_args(struct: tuple, leaves: list) -> tuple[tuple, dict]:
    it = iter(leaves)
    args = _build(struct[0], it)
    return args, {k: _build(s, it) for k, s in struct[1]}


def _meta(t: torch.Tensor) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.device)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


class _State:
    """The global state a segment's calls ran under: :class:`~._guards.FlagsGuard`'s flags
    (grad mode, autocast, default dtype, TF32, the backend flags), inference mode, and the
    autocast settings entered again for its capture. A forward may change them between two
    calls (``with torch.autocast(...)``, ``torch.inference_mode(False)``) without a call the
    mode sees: each member is matched only under the state it was recorded under."""

    __slots__ = ("flags", "check", "epoch", "inference", "autocast", "cache")

    def __init__(self, device: torch.device):
        self.flags = FlagsGuard()
        self.check = self.flags.global_state.check  # (bound once: the replay calls it per member)
        self.epoch = self.flags.epoch
        self.inference = _inference()
        self.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                         for d in dict.fromkeys((device.type, "cpu"))]
        self.cache = torch.is_autocast_cache_enabled()

    def same(self) -> bool:
        """Whether the calling thread's state is this one."""
        return self.check() and _inference() is self.inference and self.same_flags()

    def same_flags(self) -> bool:
        now = self.flags.flags_since(self.epoch)
        if now is None:
            return False
        self.epoch = now
        return True

    def entered(self) -> contextlib.ExitStack:
        """This state's inference mode and autocast entered (for the capture; what else
        differs is found by :meth:`same`)."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.inference_mode(self.inference))
        stack.enter_context(torch.no_grad())
        for device_type, enabled, dtype in self.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled,
                                               cache_enabled=self.cache))
        return stack


_own_codes: dict[Any, bool] = {}  # code object -> whether it is cudagraphify's own


def _own_code(code) -> bool:
    """Whether ``code`` is cudagraphify's own (remembered per code object)."""
    own = _own_codes[code] = own_file(code.co_filename)
    return own


def _own_frame() -> bool:
    code = _getframe(2).f_code
    own = _own_codes.get(code)
    return _own_code(code) if own is None else own


class _Matcher:
    """Writes the check of one member call as a Python function (compiled once, after the
    capture): the recorded structure of its arguments and where each tensor comes from become
    straight-line code, so a replayed call pays no walk over the structure.

    The function takes ``(args, kwargs, handed)`` and returns the ``(static buffer, tensor)``
    pairs to copy in, or None when anything differs: the number of arguments, a keyword's
    name, a value's type or value (a float by its bits), a tensor's type, the identity of an
    earlier member's output (this run's), a static's identity or address and layout, a copied
    tensor's layout, a copied tensor on the graphs' own memory (``pool``: an output of this
    run's, perhaps of a segment not replayed yet, where the record copied another tensor)."""

    def __init__(self, call: "_Call | _Member", i: int, seg: "_Segment", pool: set[int],
                 bufs: dict[int, list] | None = None):
        self.pool = pool
        self.lines: list[str] = []
        self.env: dict[str, Any] = {"_Tensor": _Tensor, "_Parameter": _Parameter}
        self.copies: list[str] = []
        self.call, self.i, self.seg = call, i, seg
        # (a module member's: per copied argument, the buffers of the calls that read it,
        # loaded from it; such an argument is a plain tensor without attributes, as recorded:
        # the module's Python, which is not run, might ask)
        self.bufs = bufs
        self.k = 0  # the next tensor leaf

    def const(self, value: Any) -> str:
        name = f"c{len(self.env)}"
        self.env[name] = value
        return name

    def fail_if(self, cond: str, depth: int = 1) -> None:
        self.lines.append("    " * depth + f"if {cond}: return None")

    def value(self, expr: str, s: Any) -> None:
        """Checks that ``expr`` has the recorded structure ``s`` (see :func:`_flat`)."""
        if s == 0 and type(s) is int:
            self.tensor(expr)
            return
        t = s[0]
        if t is tuple or t is list or t is torch.Size:
            self.fail_if(f"type({expr}) is not {self.const(t)} or len({expr}) != {len(s[1])}")
            for j, child in enumerate(s[1]):
                self.value(f"{expr}[{j}]", child)
        elif t is float:
            v = float.fromhex(s[1])
            if v != 0.0 and v == v:  # (equal floats other than zeros and NaNs: equal bits)
                self.fail_if(f"type({expr}) is not float or {expr} != {self.const(v)}")
            else:
                self.fail_if(f"type({expr}) is not float or {expr}.hex() != {s[1]!r}")
        elif t is slice:
            self.fail_if(f"type({expr}) is not slice")
            for part, child in zip(("start", "stop", "step"), s[1:]):
                self.value(f"{expr}.{part}", child)
        elif s[1] is None or s[1] is Ellipsis:
            self.fail_if(f"{expr} is not {self.const(s[1])}")
        else:  # (types first: a tensor compared with == is not a bool)
            self.fail_if(f"type({expr}) is not {self.const(t)} or {expr} != {self.const(s[1])}")

    def tensor(self, expr: str) -> None:
        k, ref = self.k, self.call.refs[self.k]
        self.k += 1
        x = f"x{k}"
        self.lines.append(f"    {x} = {expr}")
        if self.bufs is not None and ref[0] != X:
            # (a module member's: no attributes set on it since, the module might ask)
            self.fail_if(f"{x}.__dict__")
        if ref[0] == P:
            self.lines.append(f"    h = handed.get({ref[1]})")
            self.fail_if(f"h is None or h[{ref[2]}] is not {x}")
            return
        meta = self.const(ref[3] if ref[0] == S else ref[1])
        layout = f"({x}.shape, {x}.stride(), {x}.dtype, {x}.device) != {meta}"
        plain = f"(type({x}) is not _Tensor and type({x}) is not _Parameter)"
        if ref[0] == S:
            # (another object on the static's memory: read in place only as a plain view of it,
            # not a conj or neg one, whose values differ)
            self.fail_if(f"{x} is not {self.const(ref[1])} and ({plain} or {x}.data_ptr() != "
                         f"{ref[2]} or {layout} or {x}.is_conj() or {x}.is_neg())")
        else:
            if self.bufs is None:
                self.fail_if(f"{plain} or {layout}")
                self.copies.append(f"({self.const(self.seg.bufs[self.i, k])}, {x})")
            else:
                self.fail_if(f"type({x}) is not _Tensor or {x}.__dict__ or {layout}")
                self.copies.extend(f"({self.const(buf)}, {x})" for buf in self.bufs[k])
            if self.bufs is None or self.bufs[k]:  # (an argument no call reads: no copy)
                self.fail_if(f"{x}.untyped_storage().data_ptr() in {self.const(self.pool)}")

    def build(self):
        args, kwargs = self.call.struct
        self.fail_if(f"len(args) != {len(args[1])} or len(kwargs) != {len(kwargs)}")
        for j, child in enumerate(args[1]):
            self.value(f"args[{j}]", child)
        for key, child in kwargs:
            self.lines.append(f"    k = kwargs.get({key!r}, {self.const(_MISSING)})")
            self.value("k", child)
        self.lines.append(f"    return ({', '.join(self.copies)}{',' if self.copies else ''})")
        source = "def match(args, kwargs, handed):\n" + "\n".join(self.lines) + "\n"
        exec(compile(source, f"<segment call {self.i}: {self.call.name}>", "exec"), self.env)
        return self.env["match"]


class _Call:
    """One recorded top-level call."""

    __slots__ = ("func", "name", "struct", "refs", "seg", "out_struct", "eager_out", "match",
                 "single", "segment", "outs", "state", "views", "same", "metas", "alone", "flat")

    def __init__(self, func, name: str):
        self.func, self.name = func, name
        self.struct = None
        # per tensor leaf: (P, call, k) | (S, tensor, ptr, meta) | (X, meta[, recorded value])
        self.refs: list = []
        self.seg: int | None = None  # its segment's index (None: a boundary)
        self.out_struct = None
        self.eager_out: list[torch.Tensor] = []  # record: copies of its outputs (verification)
        # replay (a member of a graphed segment): its check (see _Matcher), its segment, the
        # segment's static outputs of this call, and whether it returns one tensor
        self.match = None
        self.segment: _Segment | None = None
        self.outs: list[torch.Tensor] = []
        self.single = False
        # (a tuple or list of its output tensors and nothing else, ``split``'s: that type, built
        # from them without a walk over the structure; None otherwise)
        self.flat: type | None = None
        self.state: _State | None = None  # the global state it ran under (a member)
        self.views: frozenset[int] = frozenset()  # tensor arguments whose memory it returns
        self.same: tuple[tuple[int, int], ...] = ()  # (output, argument): returned as is
        self.metas: tuple = ()  # record: its tensor arguments' layouts
        self.alone: str | None = None  # why this member runs eagerly, in a segment of its own


class _Segment:
    __slots__ = ("calls", "first", "last", "launch", "graph", "bufs", "outs", "refused", "state")

    def __init__(self, first: int, state: _State):
        self.state = state  # its members' (see _State)
        self.calls: list[int] = []
        self.first = first
        self.last = first
        # its last call that copies an input in (its first where none does), and after every
        # wait the record saw between its calls (SegmentPlan._launch): a replay launches there,
        # and the GPU runs the segment while the forward's Python meets the calls after it
        # (they read only the graph's outputs and statics, and write nothing in place)
        self.launch = first
        self.graph = None
        self.bufs: dict[tuple[int, int], torch.Tensor] = {}  # (call, leaf) -> static buffer
        self.outs: dict[int, list[torch.Tensor]] = {}  # call -> its static outputs
        self.refused: str | None = None


class _Frame:
    """The record of one call of a graphed module (a piece) met inside the forward: the calls
    its forward made (``start`` to ``end - 1``), its arguments' structure, which of those calls
    read each tensor argument, and which calls' outputs it returned. Where all of its calls are
    members of one graphed segment, it becomes a :class:`_Member`."""

    __slots__ = ("module", "start", "end", "struct", "leaves", "ids", "metas", "reads",
                 "out_struct", "out_refs", "why")

    def __init__(self, module, start: int, struct: tuple, leaves: list):
        self.module, self.start, self.end = module, start, start
        self.struct = struct
        self.leaves = leaves  # (while it runs: the ids below stay its arguments')
        self.ids = {id(leaf): a for a, leaf in enumerate(leaves)}
        self.metas = [_meta(leaf) for leaf in leaves]
        self.reads: list[tuple[int, int, int]] = []  # (call, leaf, argument)
        self.out_struct = None
        self.out_refs: list[tuple[int, int]] = []  # per output tensor: (call, k)
        # why it cannot be answered whole (None: it may be)
        self.why: str | None = "the same tensor passed twice" \
            if len(self.ids) != len(leaves) else "an argument carries attributes" \
            if any(leaf.__dict__ for leaf in leaves) else None


class _Member:
    """A module call answered whole: its arguments checked (a compiled :class:`_Matcher` over
    its structure, as a call's), its copied arguments loaded into the buffers of the calls
    that read them, and its outputs the segment's static outputs of the calls that made them;
    its forward's Python does not run (as a piece's replay: what it reads of modules is the
    plan's entry's guard, the global state its segment's)."""

    __slots__ = ("module", "start", "end", "segment", "name", "struct", "refs", "match",
                 "out_struct", "out_refs", "hand", "lone")

    def __init__(self, frame: _Frame, segment: "_Segment", refs: list):
        self.module, self.start, self.end = frame.module, frame.start, frame.end
        self.segment = segment
        self.name = type(frame.module).__name__
        self.struct, self.refs = frame.struct, refs
        self.out_struct, self.out_refs = frame.out_struct, frame.out_refs
        self.hand = sorted({j for j, _ in frame.out_refs})
        self.match = None
        # (the call whose one output it returns, alone: the common case, handed without a
        # walk over the structure; None otherwise)
        self.lone: int | None = None
