"""Segments: inside a forward that makes calls the policy refuses, graph each run of safe calls.

A callable whose signature runs eagerly because of refused calls (``.item()``, a sync, a
CPU copy) still makes most of its torch calls between those. With segments on
(:data:`ENABLED`), such a signature's forward runs under a ``TorchFunctionMode``:

- **record** (its first call): every top-level torch call runs eagerly and is recorded: the
  function, the structure of its arguments with their non-tensor values, and where each tensor
  argument comes from (an earlier recorded call's output; a parameter or buffer, read in place;
  anything else, copied). A call is a *member* when the policy allows it, it writes nothing in
  place (by its name, ``out=``, or its arguments' values before and after it: BatchNorm in
  training writes its running statistics without saying so), its arguments are plain values
  and strided tensors on the device and its outputs are such tensors; every other call is a
  *boundary* and runs eagerly. Members between two boundaries form a segment; a segment also
  ends where the global state changes (grad mode, autocast, inference mode, default dtype, the
  backend flags: a forward may set them between two calls, seen by no mode; see
  :class:`_State`). Metadata reads (``x.shape``, ``x.size()``) run as they are, unrecorded.
- **capture**: each segment's recorded calls are run again inside one capture (one pool for
  the plan), under the segment's inference mode and autocast (a segment whose other state
  differs from the call's runs eagerly), then the graph is replayed once on the recorded
  inputs and every output compared bitwise with what the eager calls gave. A segment whose
  graph differs (random ops, work the mode does not see that changed a member's output) or
  fails to capture runs eagerly, and so does one that would return a view of a tensor copied
  in from calls that run eagerly (eager's view is one of that tensor).
- **replay**: the forward's Python runs; a member call whose function, argument structure,
  values and tensor sources match the record, made under its segment's global state, is not
  run: its copied inputs are copied into the graph's buffers and it returns aliases of the
  graph's outputs (an argument it returned as is at record, as is). The graph replays when
  its segment ends (its last member, or any other call). A call that does not match replays
  the pending segment (its graph writes only memory of its own, so values already handed out
  come out right) and runs, with the rest of the forward, eagerly. Outputs on the graph's
  memory are copied before the forward returns them (a tensor returned twice, once; views of
  one another stay views of one copy).

Only inference calls outside any region use segments; the plan is dropped when the global flags
or the parameters' addresses change (:class:`~._guards.FlagsGuard`, the statics' check).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from . import _guards
from ._capture import drain
from ._guards import FlagsGuard
from ._nested import Nested
from ._opinfo import infos, info_of, written_by
from ._policy import default_policy
from ._probe import _HERE, _OWN_MODELS, _user_frame
from ._copies import copies_of, copy_of
from . import _trial
from ._trial import MARGIN, Trial

__all__ = ["ENABLED", "SegmentPlan", "Segments"]

ENABLED = False  # experimental: off until it has been measured on a GPU (see issue 16)
MIN_CALLS = 2  # a segment with fewer members runs eagerly (a replay would not pay)
VARYING = "its arguments change between calls"
MAX_VOID = 16  # timings of the forward without segments voided before one is kept anyway
PAID = 8  # matched calls after which a plan gives its signature its budget of records back
MAX_PLANS = 4  # plans recorded in a row, none of them PAID, before it stays eager

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


_RANGE = "cudagraphify.segment_call"  # the profiler range around each recorded call
_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
             "cudaLaunchCooperativeKernel", "cudaMemcpyAsync", "cudaMemsetAsync",
             "cuMemcpyAsync", "cuMemsetD8Async", "cuMemsetD32Async", "cudaGraphLaunch",
             "cuGraphLaunch")


def _profiler():
    """A CPU+CUDA profiler for the record, or None where it cannot run (another one is on)."""
    try:
        from torch.autograd.profiler import _is_profiler_enabled
        if _is_profiler_enabled:
            return None
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        return torch.profiler.profile(activities=acts)
    except Exception:  # noqa: BLE001 - no profiler: no segments
        return None


def direct_launch(events) -> str | None:
    """Why segments cannot be trusted, from a profile of the record: a kernel launch, copy or
    memset outside every recorded call (a C++ extension or Triton kernel called directly: a
    replay would not see that it reads or writes a segment's memory). None where there is none.
    ``events``: the profile's events (name, ``cpu_parent``)."""
    for evt in events:
        name = evt.name
        if name not in _LAUNCHES and not name.startswith(("cudaLaunch", "cuLaunch")):
            continue
        parent = evt.cpu_parent
        while parent is not None and parent.name != _RANGE:
            parent = parent.cpu_parent
        if parent is None:
            return (f"{name} ran outside every torch call the mode sees (a C++ or Triton "
                    "kernel called directly): a graphed segment would not see its work")
    return None


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
    caller = code.co_filename
    own = _own_codes[code] = caller.startswith(_HERE) and caller != _OWN_MODELS
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
    tensor's layout."""

    def __init__(self, call: "_Call", i: int, seg: "_Segment"):
        self.lines: list[str] = []
        self.env: dict[str, Any] = {"_Tensor": _Tensor, "_Parameter": _Parameter}
        self.copies: list[str] = []
        self.call, self.i, self.seg = call, i, seg
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
        if ref[0] == P:
            self.lines.append(f"    h = handed.get({ref[1]})")
            self.fail_if(f"h is None or h[{ref[2]}] is not {x}")
            return
        meta = self.const(ref[3] if ref[0] == S else ref[1])
        layout = f"({x}.shape, {x}.stride(), {x}.dtype, {x}.device) != {meta}"
        plain = f"(type({x}) is not _Tensor and type({x}) is not _Parameter)"
        if ref[0] == S:
            self.fail_if(f"{x} is not {self.const(ref[1])} and ({plain} or {x}.data_ptr() != "
                         f"{ref[2]} or {layout})")
        else:
            self.fail_if(f"{plain} or {layout}")
            self.copies.append(f"({self.const(self.seg.bufs[self.i, k])}, {x})")

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
                 "single", "segment", "outs", "state", "views", "same", "metas", "alone")

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
        self.state: _State | None = None  # the global state it ran under (a member)
        self.views: frozenset[int] = frozenset()  # tensor arguments whose memory it returns
        self.same: tuple[tuple[int, int], ...] = ()  # (output, argument): returned as is
        self.metas: tuple = ()  # record: its tensor arguments' layouts
        self.alone: str | None = None  # why this member runs eagerly, in a segment of its own


class _Segment:
    __slots__ = ("calls", "first", "last", "graph", "bufs", "outs", "refused", "state")

    def __init__(self, first: int, state: _State):
        self.state = state  # its members' (see _State)
        self.calls: list[int] = []
        self.first = first
        self.last = first
        self.graph = None
        self.bufs: dict[tuple[int, int], torch.Tensor] = {}  # (call, leaf) -> static buffer
        self.outs: dict[int, list[torch.Tensor]] = {}  # call -> its static outputs
        self.refused: str | None = None


class _Recorder(TorchFunctionMode):
    def __init__(self, plan: "SegmentPlan"):
        super().__init__()
        self.plan = plan
        self.made: dict[int, tuple[int, int, torch.Tensor]] = {}  # id(tensor) -> (call, k, it)
        self.made_ptrs: set[int] = set()  # the storages of the members' outputs
        self.frozen: set[tuple[int, int]] = set()  # lean outputs copied once read (see _sources)
        self.state: _State | None = None  # the last member's

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _own_frame():
            return func(*args, **kwargs)
        info = infos.get(id(func))
        if info is None or info[0] is not func:
            info = info_of(func)
        if info[1] in _META:
            return func(*args, **kwargs)
        plan = self.plan
        if plan.profiling:
            with torch.profiler.record_function(_RANGE):
                return self._record(func, info, args, kwargs)
        return self._record(func, info, args, kwargs)

    def _record(self, func, info, args: tuple, kwargs: dict) -> Any:
        plan = self.plan
        call = _Call(func, info[1])
        plan.calls.append(call)
        site = _user_frame()
        plan.sites.append(f"{site[0]}:{site[1]}" if site else "?")
        why = plan.refusal(func, info, args, kwargs)
        leaves: list = []
        if why is None:
            try:
                call.struct = _structure(args, kwargs, leaves)
            except _Opaque as e:
                why = f"an argument of type {e}"
        held = len(plan.copied_held)
        if why is None:
            why = self._sources(call, leaves)
        lean = False
        if why is None:
            call.metas = tuple(_meta(leaf) for leaf in leaves)
            # a dry record, or a call whose arguments differ from the earlier record's (it
            # will run alone, eagerly: a KV cache's cat): no copies of what it reads or makes
            lean = plan.dry or plan.varies(len(plan.calls) - 1, call)
            if lean:  # (never copied into a graph: its inputs' addresses are not kept)
                kept = {st.data_ptr() for st in plan.copied_held[:held]}
                plan.copied_ptrs -= {st.data_ptr() for st in plan.copied_held[held:]} - kept
                del plan.copied_held[held:]
                if not plan.dry:
                    call.alone = VARYING  # (so: never in a graph, whatever the comparison)
        before: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if why is None:
            state = self.state
            if state is None or not state.same():
                state = self.state = _State(plan.device)
            call.state = state
            # what its arguments held: a call may write one without saying so (BatchNorm in
            # training writes its running statistics; an embedding with max_norm, its weight)
            for leaf in leaves if not lean else ():
                before[id(leaf)] = (leaf, leaf.clone())
        out = func(*args, **kwargs)
        if why is None:
            outs: list = []
            try:
                call.out_struct = _flat(out, outs)
            except _Opaque as e:
                why = f"returns a {e}"
            if why is None and (not outs or any(t.device != plan.device for t in outs)):
                why = "returns no tensor on the device"
            if why is None and any(t.layout is not _strided for t in outs):
                why = "returns a tensor that is not strided (sparse)"
            if why is None and any(
                    t.untyped_storage().data_ptr() in plan.copied_ptrs for t in outs):
                why = "returns a view of memory it reads (copied into a graph)"
            if why is None and (_grad_enabled() or any(t.requires_grad for t in outs)):
                why = "records autograd history"
            if why is None and not all(_bitwise_equal(t, was) for t, was in before.values()):
                why = "writes a tensor argument in place (its name does not say so)"
            if why is None:
                # (a lean call's outputs as they are: a graphed call that reads one is verified
                # against them, and its segment refused if they changed since)
                call.eager_out = [] if plan.dry else list(outs) if lean else \
                    [t.clone() for t in outs]
                # (a lean call runs alone: its copied inputs are never loaded into a graph)
                call.refs = [ref if ref[0] != X else (X, ref[1]) if lean else
                             (X, ref[1], before[id(leaf)][1])
                             for leaf, ref in zip(leaves, call.refs)]
                ptrs = {t.untyped_storage().data_ptr() for t in outs} - {0}
                call.views = frozenset(k for k, leaf in enumerate(leaves)
                                       if leaf.untyped_storage().data_ptr() in ptrs)
                at = {id(leaf): j for j, leaf in reversed(list(enumerate(leaves)))}
                call.same = tuple((k, at[id(t)]) for k, t in enumerate(outs) if id(t) in at)
                for k, t in enumerate(outs):
                    old = self.made.get(id(t))
                    if old is None or old[2] is not t:  # (x.float() of a float x is x itself)
                        self.made[id(t)] = (len(plan.calls) - 1, k, t)
                    self.made_ptrs.add(t.untyped_storage().data_ptr())
                call.seg = 0  # a member (segments are numbered in plan.segment())
                if not lean:  # (a member may be graphed: what it read of a lean call, copied)
                    self._freeze(call)
        if why is not None:
            call.refs = []
            plan.boundaries[len(plan.calls) - 1] = why
        return out

    def _freeze(self, call: _Call) -> None:
        """A lean call's outputs are kept as they are (no copy); where a call that may be
        graphed reads one, copy it now: its value as read here is what a graph reading it is
        loaded with and verified against (a later in-place write would refuse the segment)."""
        calls = self.plan.calls
        for ref in call.refs:
            if ref[0] == P and calls[ref[1]].alone is not None \
                    and (ref[1], ref[2]) not in self.frozen:
                out = calls[ref[1]].eager_out
                out[ref[2]] = out[ref[2]].clone()
                self.frozen.add((ref[1], ref[2]))

    def _sources(self, call: _Call, leaves: list) -> str | None:
        plan, made = self.plan, self.made
        for leaf in leaves:
            if leaf.device != plan.device:
                return "a tensor argument on another device"
            if leaf.layout is not _strided:
                return "a tensor argument that is not strided (sparse)"
            hit = made.get(id(leaf))
            if hit is not None and hit[2] is leaf:
                call.refs.append((P, hit[0], hit[1]))
                continue
            ptr = leaf.untyped_storage().data_ptr()
            if ptr in plan.static_ptrs:
                call.refs.append((S, leaf, leaf.data_ptr(), _meta(leaf)))
            elif ptr in self.made_ptrs:
                # on a member's output memory, made where the mode does not look (DLPack,
                # nn.Parameter(h)): on replay it would be read before the graph wrote it
                return "a tensor argument that aliases an earlier call's output unseen"
            else:
                call.refs.append((X, _meta(leaf)))
                plan.copied_ptrs.add(ptr)
                # (held while the record runs: its address is not given to a new tensor,
                # which would then look like a view of it)
                plan.copied_held.append(leaf.untyped_storage())
        return None


class _Run:
    """One replayed call of the forward: where it is in the plan, what it handed out."""

    __slots__ = ("plan", "cursor", "pending", "handed", "diverged", "stream", "token", "side")

    def __init__(self, plan: "SegmentPlan"):
        self.plan = plan
        self.cursor = 0
        self.pending: _Segment | None = None
        self.handed: dict[int, list[torch.Tensor]] = {}
        self.diverged = False
        # (CUDA) the stream the call started on: members are met on it (their inputs are
        # copied on it) and every segment replays on it
        self.stream = torch.cuda.current_stream(plan.device) if plan.cuda else None
        self.token = self.stream.cuda_stream if plan.cuda else None
        if plan.cuda:
            # the graphs' memory was last used by a call on another stream, or read there by
            # eager calls of the last call (their results may still be in use): wait for them
            for token in {plan.last, *plan.side} - {None, self.token}:
                plan.backend.order_after(plan.device, token)
            plan.side = set()
        self.side: set[int] = plan.side  # streams other than the call's that eager calls used

    def note(self) -> None:
        """(CUDA) An eager call: remember its stream when it is not the call's."""
        if self.token is not None:
            token = _raw_stream(self.plan.index)
            if token != self.token:
                self.side.add(token)

    def start(self, seg: _Segment) -> None:
        self.flush()
        self.pending = seg

    def flush(self) -> None:
        seg = self.pending
        if seg is not None:
            self.pending = None
            plan = self.plan
            if plan.cuda and _raw_stream(plan.index) != self.token:
                # the forward switched streams with the segment pending: it replays on the
                # call's stream, and the stream now current waits for it
                with torch.cuda.stream(self.stream):
                    seg.graph.replay()
                torch.cuda.current_stream(plan.device).wait_stream(self.stream)
            else:
                seg.graph.replay()
            plan.replays += 1
            plan.last = self.token

    def diverge(self, func, args, kwargs) -> Any:
        self.flush()
        self.note()
        self.diverged = True
        self.plan.divergences += 1
        return func(*args, **kwargs)


class _Replayer(TorchFunctionMode):
    def __init__(self, run: _Run):
        super().__init__()
        self.run = run

    def __torch_function__(self, func, types, args=(), kwargs=None):
        run = self.run
        if kwargs is None:
            kwargs = {}
        if run.diverged:
            run.note()
            return func(*args, **kwargs)
        code = _getframe(1).f_code
        own = _own_codes.get(code)
        if own is None:
            own = _own_code(code)
        if own:  # (cudagraphify's own calls: not recorded, they see real values)
            run.flush()
            return func(*args, **kwargs)
        plan = run.plan
        i = run.cursor
        calls = plan.calls
        call = calls[i] if i < len(calls) else None
        if call is None or call.func is not func:
            info = infos.get(id(func))
            if info is None or info[0] is not func:
                info = info_of(func)
            if info[1] in _META:
                return func(*args, **kwargs)
            if call is None or type(func) is not _MethodWrapper or call.name != info[1]:
                return run.diverge(func, args, kwargs)
        seg = call.segment
        if seg is None:  # a boundary, or a member of a segment that runs eagerly
            run.flush()
            run.note()
            run.cursor = i + 1
            return func(*args, **kwargs)
        handed = run.handed
        try:
            copies = call.match(args, kwargs, handed)
        except RuntimeError:  # (a layout read that a tensor refuses: sparse strides)
            copies = None
        if copies is None:
            return run.diverge(func, args, kwargs)
        # grad mode, autocast, inference mode, the flags: as recorded (the forward may set them
        # between two calls, seen by no mode)
        state = seg.state
        if not state.check() or _inference() is not state.inference or \
                (_guards.flags_epoch != state.epoch and not state.same_flags()) or \
                (run.token is not None and _raw_stream(plan.index) != run.token):
            return run.diverge(func, args, kwargs)  # (a member met on a side stream, too)
        if run.pending is not seg:
            if i != seg.first:  # (a segment is entered at its first call only)
                return run.diverge(func, args, kwargs)
            run.start(seg)
        try:
            for buf, leaf in copies:
                buf.copy_(leaf)
        except RuntimeError:  # (a sparse tensor where a dense one was recorded)
            return run.diverge(func, args, kwargs)
        run.cursor = i + 1
        if call.same:  # (x.float() of a float x is x itself)
            leaves: list = []
            _structure(args, kwargs, leaves)
            outs = [t.data for t in call.outs]
            for k, j in call.same:
                outs[k] = leaves[j]
            handed[i] = outs
            out = outs[0] if call.single else _build(call.out_struct, iter(outs))
        elif call.single:
            out = call.outs[0].data  # (an alias of its own: see ``held``)
            handed[i] = (out,)
        else:
            outs = handed[i] = [t.data for t in call.outs]
            out = _build(call.out_struct, iter(outs))
        if i == seg.last:
            run.flush()
        return out


class SegmentPlan:
    """The record, segments and graphs of one signature's forward (see the module docs)."""

    def __init__(self, state, backend, device: torch.device):
        self.state = state
        self.backend = backend
        self.device = device
        self.calls: list[_Call] = []
        self.boundaries: dict[int, str] = {}  # call index -> why it runs eagerly
        self.sites: list[str] = []  # per call: the user's file:line
        self.timing: tuple[float, float] | None = None  # the trial's (segments, without) s
        self.segments: list[_Segment] = []
        self.policy = state.options.op_policy or default_policy
        self.static_ptrs = state.statics.storage_ptrs()
        self.copied_ptrs: set[int] = set()
        self.copied_held: list = []  # (the record's copied inputs' storages, see _sources)
        self.dry = False  # only recorded, to compare a later record with
        self.earlier: SegmentPlan | None = None  # the record this one is compared with
        self.pool_ptrs: set[int] = set()
        self.flags: FlagsGuard | None = None
        self.pool = None
        self.replays = 0
        self.divergences = 0
        self.misses = 0  # calls in a row that diverged
        self.matched = 0  # calls that matched the record throughout
        self.ready = False
        self.profiling = False  # the record runs under the profiler (CUDA)
        self.cuda = device.type == "cuda"
        self.index = (device.index if device.index is not None else torch.cuda.current_device()) \
            if self.cuda else None
        self.token: int | None = None  # (CUDA) the stream the record's call ran on
        self.last: int | None = None  # (CUDA) the stream that replayed the graphs last
        self.side: set[int] = set()  # (CUDA) other streams the last call's eager calls used
        # (storage, use count with only the plan's own references) of the graphs' memory
        self._baselines: list[tuple[Any, int]] = []
        self.unseen: str | None = None  # why no segment can be graphed: work the mode misses
        self.seen_unseen = False  # the profiler found that work (a later record would too)
        # the first calls after the record alternate between the segments and the forward run
        # as it would without them, timed (see _trial); segments that do not pay are given
        # back: the forward runs without them from then on, for this signature
        self.trial: Trial | None = None
        self.given_back: str | None = None
        self.voided = 0  # timings of the forward without segments voided (see timed)

    # -- record and capture -------------------------------------------------------------------

    def no_segments(self, why: str, seen: bool) -> None:
        """A plan with no segment, every call run eagerly (``why``; ``seen``: the profiler found
        work the mode does not see, which a later record would find again): nothing of its
        record is kept (the calls' output clones and copied inputs, their storages)."""
        self.unseen, self.seen_unseen = why, seen
        self.ready = True
        self.earlier = None
        self.calls, self.sites, self.boundaries = [], [], {}
        self.copied_held, self.copied_ptrs = [], set()

    def refusal(self, func, info, args: tuple, kwargs: dict) -> str | None:
        """Why a call cannot be a member, or None."""
        if self.token is not None and _raw_stream(self.index) != self.token:
            self.side.add(_raw_stream(self.index))  # (the next call waits for it)
            return "runs on another stream than the forward's call"
        policy = self.policy
        if not policy.untagged_call(func, kwargs):
            tags = policy.tags(func, args, kwargs, accel=self.state.accel)
            if not policy.can_graph(func, tags):
                return f"refused by the policy ({', '.join(sorted(tags)) or 'no tag'})"
        if (info[2] or kwargs) and any(isinstance(t, torch.Tensor) or isinstance(t, (list, tuple))
                                       for t in written_by(func, args, kwargs)):
            return "writes a tensor in place"
        return None

    def record(self, fn, args: tuple, kwargs: dict, earlier: "SegmentPlan | None" = None,
               dry: bool = False) -> Any:
        """The first call: run eagerly, record, then capture and verify each segment (the
        calls whose arguments differ from ``earlier``'s record run eagerly). ``dry``: only
        record (for a later record to compare with)."""
        if self.cuda:
            self.token = _raw_stream(self.index)
        self.dry, self.earlier = dry, earlier
        # (a dry record graphs nothing: the profiler, slow to run, is for the record that does)
        prof = _profiler() if self.device.type == "cuda" and not dry else None
        if prof is not None:
            self.profiling = True
            try:
                with prof, Nested(), _Recorder(self):
                    out = fn(*args, **kwargs)
            finally:
                self.profiling = False
            why = direct_launch(prof.events())
            if why is not None:
                self.no_segments(why, seen=True)
                return out
        elif self.device.type == "cuda" and not dry:
            with Nested():
                out = fn(*args, **kwargs)
            self.no_segments("the profiler could not be started (it finds kernels the mode "
                             "does not see)", seen=False)
            return out
        else:
            with Nested(), _Recorder(self):
                out = fn(*args, **kwargs)
        if dry:  # (what the comparison reads, and nothing that holds memory)
            self.copied_held = []
            for call in self.calls:
                call.eager_out = []
                call.refs = [ref if ref[0] == P else (ref[0],) for ref in call.refs]
            return out
        self.copied_held = []
        if earlier is not None:
            self.vary_from(earlier)
            self.earlier = None
        self._views_alone()
        self._capture()
        self.last = self.token  # (the verifying replays ran on the call's stream)
        for i, call in enumerate(self.calls):  # (the record's copies are not needed any more)
            call.eager_out = []
            call.refs = [ref[:2] if ref[0] == X else ref for ref in call.refs]
            seg = self.segments[call.seg] if call.seg is not None else None
            if seg is not None and seg.refused is None:
                call.segment, call.outs = seg, seg.outs[i]
                call.match = _Matcher(call, i, seg).build()
                call.single = call.out_struct == 0 and type(call.out_struct) is int
        self._baselines = self._use_counts()
        self.ready = True
        clock = getattr(self.backend, "clock", None)
        if clock is not None and any(seg.graph is not None for seg in self.segments):
            self.trial = Trial(clock(self.device))
        return out

    def timed(self, fn, args: tuple, kwargs: dict, without) -> Any:
        """A call while the trial runs: the segments' replay or ``without`` (the forward as it
        runs without segments), timed, in turn; once both are timed enough, the verdict."""
        trial = self.trial
        plain = trial.eager_next()
        before = _trial.activity[0]
        out = trial.timed(lambda: without(fn, args, kwargs) if plain
                          else self.replay(fn, args, kwargs), plain)
        if plain and _trial.activity[0] != before + 1 and self.voided < MAX_VOID:
            # pieces captured or timed themselves in that run (their first calls): not the
            # forward's cost without segments; timed again
            trial.eager.pop()
            self.voided += 1
        if trial.done:
            self.trial = None
            graph, eager = min(trial.graph), min(trial.eager)
            self.timing = (graph, eager)
            if eager * MARGIN < graph:
                self.given_back = (f"segments given back: they cost more than the forward "
                                   f"without them ({graph * 1e6:.0f} vs {eager * 1e6:.0f} µs a "
                                   "call, timed on its first calls)")
                self.release()
        return out

    def _segment(self) -> None:
        seg = None
        for i, call in enumerate(self.calls):
            if call.seg is None:
                seg = None
                continue
            if seg is None or call.state is not seg.state or call.alone or \
                    self.calls[seg.last].alone:  # (a flag changed; a call that runs alone)
                seg = _Segment(i, call.state)
                self.segments.append(seg)
            seg.calls.append(i)
            seg.last = i
            call.seg = len(self.segments) - 1
        for seg in self.segments:
            if self.calls[seg.first].alone:
                seg.refused = self.calls[seg.first].alone
            elif len(seg.calls) < MIN_CALLS:
                seg.refused = f"fewer than {MIN_CALLS} calls"

    def _views_alone(self) -> None:
        """Segment again until no member of a graphed segment returns a view of a tensor from
        calls that run eagerly (it would hand out a view of the graph's copy; eager's is one of
        the source): such a member runs alone, eagerly."""
        while True:
            self.segments = []
            self._segment()
            calls, segments = self.calls, self.segments
            moved = False
            for seg in segments:
                if seg.refused is not None:
                    continue
                for i in seg.calls:
                    call = calls[i]
                    if any(ref[0] == P and calls[ref[1]].seg is not None and
                           segments[calls[ref[1]].seg].refused is not None and k in call.views
                           for k, ref in enumerate(call.refs)):
                        call.alone = f"{call.name} returns a view of a tensor from calls " \
                            "that run eagerly"
                        moved = True
            if not moved:
                return

    def varies(self, i: int, call: "_Call") -> bool:
        """While recording against an earlier record: whether call ``i`` reads tensors of
        other layouts than the earlier record's call ``i`` of the same function."""
        earlier = self.earlier
        if earlier is None or i >= len(earlier.calls):
            return False
        then = earlier.calls[i]
        return then.seg is not None and (then.func is call.func or then.name == call.name) \
            and then.metas != call.metas

    def vary_from(self, earlier: "SegmentPlan") -> None:
        """Mark the calls whose arguments differ from ``earlier``'s record of the same forward
        (a KV cache that grows every step: its ``cat`` and the attention over it): they run
        eagerly, in segments of their own, and the runs of calls between them are graphed.
        Nothing is marked where the two records made different calls."""
        calls, then = self.calls, earlier.calls
        if len(calls) != len(then) or any(
                a.func is not b.func and a.name != b.name for a, b in zip(calls, then)):
            return
        for a, b in zip(calls, then):
            if a.seg is not None and b.seg is not None and (
                    a.struct != b.struct or a.metas != b.metas or
                    [r if r[0] == P else r[0] for r in a.refs] !=
                    [r if r[0] == P else r[0] for r in b.refs]):
                a.alone = VARYING

    def _capture(self) -> None:
        backend = self.backend
        self.flags = FlagsGuard()
        self.pool = backend.new_pool(self.device)
        for s, seg in enumerate(self.segments):
            if seg.refused is not None:
                continue
            # sources in a segment that runs eagerly are copied in; a member that returns a
            # view of one would hand out a view of the copy (eager's is one of the source)
            for i in seg.calls:
                call = self.calls[i]
                for k, ref in enumerate(call.refs):
                    if ref[0] == P and ref[1] not in seg.calls and \
                            self.segments[self.calls[ref[1]].seg].refused is not None:
                        if k in call.views:
                            seg.refused = (f"{call.name} returns a view of a tensor from calls "
                                           "that run eagerly")
                        value = self.calls[ref[1]].eager_out[ref[2]]
                        call.refs[k] = (X, _meta(value), value)
            if seg.refused is not None:
                continue
            try:
                self._capture_one(seg)
            except Exception as e:  # noqa: BLE001 - a segment that cannot be graphed runs eagerly
                seg.refused = f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                seg.graph = None
                continue
            for t in [*(t for i in seg.calls for t in seg.outs[i]), *seg.bufs.values()]:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.static_ptrs:  # (a member may return a view of a parameter)
                    self.pool_ptrs.add(ptr)

    def _inputs(self, seg: _Segment) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(static buffer, recorded value) of each copied input of ``seg``."""
        pairs = []
        for i in seg.calls:
            for k, ref in enumerate(self.calls[i].refs):
                if ref[0] == X:
                    shape, stride, dtype, device = ref[1]
                    buf = seg.bufs[i, k] = torch.empty_strided(shape, stride, dtype=dtype,
                                                               device=device)
                    pairs.append((buf, ref[2]))
        return pairs

    def _capture_one(self, seg: _Segment) -> None:
        calls = self.calls
        inputs: list[tuple[torch.Tensor, torch.Tensor]] = []

        def load():
            for buf, value in inputs:
                buf.copy_(value)

        def run():
            outs: dict[int, list[torch.Tensor]] = {}
            for i in seg.calls:
                call = calls[i]
                leaves = []
                for k, ref in enumerate(call.refs):
                    if ref[0] == P:
                        src = outs.get(ref[1])
                        leaves.append(src[ref[2]] if src is not None
                                      else self.segments[calls[ref[1]].seg].outs[ref[1]][ref[2]])
                    elif ref[0] == S:
                        leaves.append(ref[1])
                    else:
                        leaves.append(seg.bufs[i, k])
                a, kw = _call_args(call.struct, leaves)
                flat: list = []
                _flat(call.func(*a, **kw), flat)
                outs[i] = flat
            return outs

        # under the state its calls ran under (the buffers too: a segment inside
        # inference_mode(False) must not make inference tensors)
        with seg.state.entered():
            if not seg.state.same():
                raise RuntimeError("its calls ran under global flags set inside the forward "
                                   "that cannot be set again for the capture")
            inputs = self._inputs(seg)
            load()
            self.backend.warmup(run, self.device)
            load()
            graph, outs = self.backend.capture(run, self.device, self.pool)
            seg.graph, seg.outs = graph, outs
            load()
            graph.replay()
            for i in seg.calls:
                for k, (got, want) in enumerate(zip(outs[i], calls[i].eager_out)):
                    if not _bitwise_equal(got, want):
                        graph.release()
                        seg.graph, seg.outs = None, {}
                        raise RuntimeError(f"the graph's output {k} of {calls[i].name} differs "
                                           "from the eager call's (a random op, or work the "
                                           "mode does not see)")

    # -- replay ---------------------------------------------------------------------------------

    def _use_counts(self) -> list[tuple[Any, int]]:
        storages = {}
        for seg in self.segments:
            for t in [*(t for outs in seg.outs.values() for t in outs), *seg.bufs.values()]:
                st = t.untyped_storage()
                if st.data_ptr() in self.pool_ptrs:
                    storages[st.data_ptr()] = st
        return [(st, _use_count(st._cdata), st.data_ptr(), st.nbytes())
                for st in storages.values()]

    def held(self) -> bool:
        """Whether a tensor on the graphs' memory outlived the call that handed it out (the
        forward kept it, or returned it inside an object the output copy does not look into):
        a replay would overwrite it."""
        for st, n, ptr, nbytes in self._baselines:  # (resized or freed: the graph's is gone)
            if _use_count(st._cdata) != n or st.data_ptr() != ptr or st.nbytes() != nbytes:
                return True
        return False

    def valid(self) -> bool:
        return self.flags is not None and self.flags.check() and self.state.statics.same() \
            and not self.held()

    def replay(self, fn, args: tuple, kwargs: dict) -> Any:
        if not self.segments:
            return fn(*args, **kwargs)
        run = _Run(self)
        replays = self.replays
        with Nested(), _Replayer(run):
            out = fn(*args, **kwargs)
            run.flush()
        if not run.diverged and run.cursor != len(self.calls):
            run.diverged = True  # (fewer calls than recorded)
            self.divergences += 1
        self.misses = self.misses + 1 if run.diverged else 0
        self.matched += not run.diverged and self.replays > replays  # (it replayed a graph)
        return self.owned(out)

    def owned(self, out: Any) -> Any:
        """``out`` with tensors on the graphs' memory replaced by copies."""
        ptrs = self.pool_ptrs
        if not ptrs:
            return out
        if type(out) is _Tensor:
            try:
                ptr = out.untyped_storage().data_ptr()
            except NotImplementedError:  # (a sparse tensor: no member returns one)
                return out
            if ptr not in ptrs:
                return out
            return copy_of(out, ptr)
        leaves: list = []
        try:
            s = _flat(out, leaves)
        except _Opaque:
            leaves, spec = pytree.tree_flatten(out)
            return pytree.tree_unflatten(copies_of(leaves, ptrs), spec)
        return _build(s, iter(copies_of(leaves, ptrs)))

    def release(self) -> None:
        if self.cuda:  # (a replay queued on a stream may still use the memory let go here)
            for token in {self.last, *self.side} - {None}:
                drain(self.device, token)
        for seg in self.segments:
            if seg.graph is not None:
                seg.graph.release()
                seg.graph = None
            seg.outs, seg.bufs = {}, {}
        for call in self.calls:  # (the member checks hold the static buffers too)
            call.outs, call.match, call.segment = [], None, None
        self.pool = None
        self._baselines = []
        self.ready = False

    def describe(self) -> list[str]:
        """One line per segment and boundary, for ``explain``."""
        lines = [f"no segments: {self.unseen}"] if self.unseen else []
        if self.given_back:
            lines.append(self.given_back)
        elif self.timing is not None:
            lines.append(f"timed on its first calls: {self.timing[0] * 1e6:.0f} µs a call with "
                         f"segments, {self.timing[1] * 1e6:.0f} µs without: kept")
        for s, seg in enumerate(self.segments):
            names = [self.calls[i].name for i in seg.calls]
            what = f"refused: {seg.refused}" if seg.refused else "graphed"
            lines.append(f"segment {s}: calls {seg.first}-{seg.last} ({len(names)}: "
                         f"{names[0]} at {self.sites[seg.first]} .. {names[-1]} at "
                         f"{self.sites[seg.last]}) {what}")
        for i, why in sorted(self.boundaries.items()):
            lines.append(f"call {i} {self.calls[i].name} at {self.sites[i]}: eager ({why})")
        return lines


class _OpaqueCalls:
    """The key of the segments of a callable's calls with an opaque argument."""

    __slots__ = ()


class Segments:
    """A callable's segment plans: one per signature entry that runs eagerly for refused calls
    (a :class:`~._piecewise.PiecewiseEntry`), at most :data:`MAX_PLANS` recorded for each."""

    def __init__(self, state):
        self.state = state
        self._plans: dict[int, list] = {}  # id(entry) -> [entry, plan or None, plans recorded]
        # what the calls with an argument no signature holds (an HF DynamicCache) are kept
        # under, in place of an entry
        self.opaque = _OpaqueCalls()

    def call(self, entry, backend, fn, args: tuple, kwargs: dict, without) -> Any:
        """``fn(*args, **kwargs)`` with its segments graphed (recorded on a first call);
        ``without(fn, args, kwargs)`` runs it as it would run without segments (their plan
        given back, or timed against)."""
        item = self._plans.get(id(entry))
        if item is None or item[0] is not entry:
            self._prune()
            # [entry, plan, plans recorded, compare two records next, the first of the two];
            # calls with an argument no signature holds (a growing KV cache) compare from their
            # first record on: a first full record would copy the whole cache, several times
            item = self._plans[id(entry)] = [entry, None, 0, entry is self.opaque, None]
        state = self.state
        with state.lock:  # (another thread's call holds graph memory until it returns)
            plan = item[1]
            if plan is not None and (plan.given_back is not None or plan.seen_unseen):
                # (work the mode does not see is in the forward's code: every record would
                # find it again, under the profiler; a profiler that could not be started,
                # the user's own running, is tried again on the next calls)
                return without(fn, args, kwargs)
            if plan is not None and (not plan.valid() or plan.misses >= 3):
                # flags or parameters changed, or its calls went another way: record again,
                # the second time comparing two records (calls that vary run eagerly)
                item[3] = item[3] or plan.misses >= 3
                if plan.matched >= PAID:  # (it served: the next plans get a budget anew)
                    item[2] = 0
                plan.release()
                plan = item[1] = None
            if plan is None:
                if item[2] >= MAX_PLANS:
                    return without(fn, args, kwargs)
                compare = item[3]
                if compare and item[4] is None:  # a first record, to compare the next with
                    dry = SegmentPlan(state, backend, state._device)
                    out = dry.record(fn, args, kwargs, dry=True)
                    item[4] = dry
                    return out
                item[2] += 1
                earlier, item[4] = item[4], None
                plan = item[1] = SegmentPlan(state, backend, state._device)
                try:
                    return plan.record(fn, args, kwargs, earlier=earlier)
                except BaseException:
                    plan.release()
                    item[1] = None
                    raise
            if plan.trial is not None:
                return plan.timed(fn, args, kwargs, without)
            return plan.replay(fn, args, kwargs)

    def _prune(self) -> None:
        """Release the plans of entries no longer in the callable's cache (a new decision
        replaced them: its module state changed)."""
        live = {id(e) for _, e in self.state.cache.items(self.state)} | {id(self.opaque)}
        for key in [k for k in self._plans if k not in live]:
            plan = self._plans.pop(key)[1]
            if plan is not None:
                plan.release()

    def plans(self) -> list["SegmentPlan"]:
        return [item[1] for item in self._plans.values() if item[1] is not None]

    def counts(self) -> tuple[int, int]:
        """(segments graphed, segment replays) over the current plans."""
        plans = self.plans()
        return (sum(1 for p in plans for s in p.segments if s.graph is not None),
                sum(p.replays for p in plans))

    def release(self) -> None:
        for plan in self.plans():
            plan.release()
        self._plans.clear()
