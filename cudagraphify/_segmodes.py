"""Segments (see :mod:`._segrun`): the two ``TorchFunctionMode`` classes a forward runs under, the
record's (:class:`_Recorder`: every top-level call run eagerly and recorded, as a member or a
boundary) and the replay's (:class:`_Replayer`, with its call's :class:`_Run`: a member call
that matches the record is answered from its segment's graph), and the profiler that finds work
the modes do not see (:func:`direct_launch`) and the waits between calls (:func:`waits`)."""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from . import _guards, _region, _watch
from ._nested import segment_mode
from ._opinfo import info_of, infos
from ._probe import _user_frame
from ._segcalls import (_META, P, S, VARYING, X, _Call, _Frame, _Member, _MethodWrapper,
                        _Opaque, _Segment, _State, _bitwise_equal, _build, _flat, _getframe,
                        _grad_enabled, _inference, _meta, _own_code, _own_codes, _own_frame,
                        _raw_stream, _strided, _structure)

if TYPE_CHECKING:
    from ._segrun import SegmentPlan

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


# a device wait or a host sync: what orders the call's stream after work on another (a
# weight written there, then waited for): made outside every recorded call, it must come
# before the replay of a segment whose calls it separates
# (a query polled until true is a host sync too)
_WAITS = ("cudaStreamWaitEvent", "cuStreamWaitEvent", "cudaStreamSynchronize",
          "cuStreamSynchronize", "cudaEventSynchronize", "cuEventSynchronize",
          "cudaDeviceSynchronize", "cuCtxSynchronize", "cudaEventQuery", "cuEventQuery",
          "cudaStreamQuery", "cuStreamQuery")
_CPU = torch.autograd.DeviceType.CPU


def canary(device: torch.device) -> None:
    """A wait of the call's stream on itself (no effect), made under the record's profiler
    before its first call: :func:`waits` finds it, or the profile shows no waits at all."""
    event = torch.cuda.Event()
    stream = torch.cuda.current_stream(device)
    event.record(stream)
    stream.wait_event(event)


def waits(events) -> set[int] | None:
    """From a profile of the record: the calls that a device wait or host sync made outside
    every recorded call came just before (``j``: between calls ``j - 1`` and ``j``): its end
    (a sync on another thread starts before the calls it orders) against the start of the
    calls' profiler ranges, on the host's timeline (a range's twin on the GPU's is left out);
    None where the profile holds no wait before the first call, not even :func:`canary`'s (a
    profiler that does not report them: every segment then replays at its last call, and no
    module call is answered whole)."""
    starts, found = [], []
    for evt in events:
        if getattr(evt, "device_type", _CPU) != _CPU:  # (a range's twin on the GPU's timeline)
            continue
        name = evt.name
        if name == _RANGE:
            starts.append(evt.time_range.start)
            continue
        if name not in _WAITS:
            continue
        parent = evt.cpu_parent
        while parent is not None and parent.name != _RANGE:
            parent = parent.cpu_parent
        if parent is None:
            found.append(evt.time_range.end)
    starts.sort()
    at = [bisect.bisect_left(starts, t) for t in found]
    if 0 not in at:
        return None
    return {j for j in at if j > 0}


class _Mode(TorchFunctionMode):
    """Either mode: this thread's :data:`~._nested.segment_mode` while it is on (a graphed
    module's ``DirectCall`` hands its calls to :meth:`module`)."""

    def __enter__(self):
        self._outer = segment_mode.mode
        segment_mode.mode = self
        return super().__enter__()

    def __exit__(self, *exc):
        segment_mode.mode = self._outer
        return super().__exit__(*exc)


class _Recorder(_Mode):
    def __init__(self, plan: "SegmentPlan"):
        super().__init__()
        self.plan = plan
        self.made: dict[int, tuple[int, int, torch.Tensor]] = {}  # id(tensor) -> (call, k, it)
        self.made_ptrs: set[int] = set()  # the storages of the members' outputs
        self.frozen: set[tuple[int, int]] = set()  # lean outputs copied once read (see _sources)
        self.state: _State | None = None  # the last member's
        self.frames: list[_Frame] = []  # the module calls running, outermost first
        # the outputs of a finished module call's calls that it did not return: read by a
        # later call, that module is not answered whole (a replay would not hand them out)
        self.inner: dict[int, _Frame] = {}

    def module(self, module, fn, args: tuple, kwargs: dict, whole: bool = True) -> Any:
        """A graphed module's call (a piece): run, and recorded as a :class:`_Frame` (see
        :meth:`SegmentPlan._members`) where it has no hooks."""
        plan = self.plan
        d = module.__dict__
        if any(d.get(name) for name in _watch._HOOK_DICTS):
            return fn(*args, **kwargs)
        leaves: list = []
        try:
            struct = _structure(args, kwargs, leaves)
        except _Opaque:
            return fn(*args, **kwargs)
        with _no_modes():  # (its arguments' layouts: not the forward's calls)
            frame = _Frame(module, len(plan.calls), struct, leaves)
        self.frames.append(frame)
        epoch = _watch.epoch
        try:
            out = fn(*args, **kwargs)
        finally:
            self.frames.pop()
        frame.end = len(plan.calls)
        frame.leaves, frame.ids = [], {}
        if _watch.epoch != epoch:  # (any module attribute set, hook registered: a replay that
            # skips its Python would not set it again, after a user reset it)
            return out
        if frame.why is not None or frame.end == frame.start:
            return out
        outs: list = []
        try:
            frame.out_struct = _flat(out, outs)
        except _Opaque:
            return out
        made = self.made
        for t in outs:
            hit = made.get(id(t))
            if hit is None or hit[2] is not t or not frame.start <= hit[0] < frame.end:
                return out  # (an argument, a parameter, a tensor made unseen: not whole)
            frame.out_refs.append((hit[0], hit[1]))
        returned = set(frame.out_refs)
        for key, hit in made.items():
            if frame.start <= hit[0] < frame.end and (hit[0], hit[1]) not in returned:
                self.inner[key] = frame
        plan.frames.append(frame)
        return out

    def _read(self, args: tuple, kwargs: dict, leaves: list, call: _Call | None) -> None:
        """The running module calls that a call makes, and the finished ones whose
        intermediates it reads. ``call``: a member's, its tensor arguments ``leaves`` with
        their sources; None: a boundary's (its tensors found here, kept only for this)."""
        if call is None:
            leaves = []
            try:
                _structure(args, kwargs, leaves)
            except _Opaque:  # (what it holds is not seen: no module call around or before
                # it is answered whole)
                for frame in [*self.frames, *self.inner.values()]:
                    frame.why = "a call passes an opaque argument"
        j = len(self.plan.calls) - 1
        for k, leaf in enumerate(leaves):
            frame = self.inner.get(id(leaf))
            if frame is not None:
                frame.why = "a later call reads what its calls made, not returned"
            for frame in self.frames:
                a = frame.ids.get(id(leaf))
                if a is not None:
                    frame.reads.append((j, k, a))
                elif call is None or call.refs[k][0] == X or (
                        call.refs[k][0] == P and call.refs[k][1] < frame.start):
                    frame.why = "its calls read a tensor that is not its argument"

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
        if self.frames or self.inner:
            self._read(args, kwargs, leaves, call if why is None else None)
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


_NO = object()  # (a module call not answered whole)
_no_modes = torch._C.DisableTorchFunction


class _Run:
    """One replayed call of the forward: where it is in the plan, what it handed out."""

    __slots__ = ("plan", "cursor", "entered", "pending", "handed", "diverged", "stream", "token",
                 "side")

    def __init__(self, plan: "SegmentPlan"):
        self.plan = plan
        self.cursor = 0
        self.entered: _Segment | None = None  # the segment whose calls are being met
        self.pending: _Segment | None = None  # the same, its graph not yet replayed
        self.handed: dict[int, list[torch.Tensor]] = {}
        self.diverged = False
        # (CUDA) the stream the call started on: members are met on it (their inputs are
        # copied on it) and every segment replays on it
        self.stream = torch.cuda.current_stream(plan.device) if plan.cuda else None
        self.token = self.stream.cuda_stream if plan.cuda else None
        if plan.cuda:
            # the graphs' memory was last used by a call on another stream, or read there by
            # eager calls of the last call (their results may still be in use): wait for them
            waits = {plan.last, *plan.side} - {None, self.token}
            if _region.captured_among(plan.backend, plan.device, waits):
                # (one is under another thread's capture of its own: no wait on it, and no
                # segment replays in this call, as _engine.CAPTURED_ELSEWHERE)
                self.diverged = True
            else:
                for token in waits:
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
        self.entered = self.pending = seg

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

    def whole(self, member: _Member, args: tuple, kwargs: dict) -> Any:
        """A module call answered whole, or :data:`_NO` (nothing done but a pending segment
        replayed: its calls are met one by one then, as any call)."""
        seg = member.segment
        state = seg.state
        plan = self.plan
        # (the global state as the op path checks it: with torch functions on)
        if not state.check() or _inference() is not state.inference or \
                (_guards.flags_epoch != state.epoch and not state.same_flags()) or \
                (self.token is not None and _raw_stream(plan.index) != self.token) or \
                (self.entered is not seg and member.start != seg.first):
            return _NO
        # (no mode sees the guard's and the check's reads, the copies and detaches: they are
        # not the forward's calls, and would replay the segment before its launch)
        with _no_modes():
            if not plan.guard.valid():
                return _NO
            try:
                copies = member.match(args, kwargs, self.handed)
            except RuntimeError:  # (a layout read that a tensor refuses: sparse strides)
                return _NO
            if copies is None:
                return _NO
            if self.entered is not seg:
                self.start(seg)
            elif member.start <= seg.launch and self.pending is None:
                self.pending = seg  # (see __torch_function__)
            if copies:
                try:
                    for buf, leaf in copies:
                        buf.copy_(leaf)
                except RuntimeError:  # (a sparse tensor: its calls copy again, or diverge)
                    return _NO
            if self.pending is not None and member.end > seg.launch:  # (see _Segment.launch)
                self.flush()
            self.cursor = member.end
            plan.whole += 1
            handed, calls = self.handed, plan.calls
            j = member.lone
            if j is not None:
                out = calls[j].outs[0].detach()
                handed[j] = (out,)
                return out
            for j in member.hand:
                handed[j] = [t.detach() for t in calls[j].outs]
            return _build(member.out_struct, iter([handed[j][k] for j, k in member.out_refs]))

    def diverge(self, func, args, kwargs) -> Any:
        self.flush()
        self.note()
        self.diverged = True
        self.plan.divergences += 1
        return func(*args, **kwargs)


class _Replayer(_Mode):
    def __init__(self, run: _Run):
        super().__init__()
        self.run = run

    def module(self, module, fn, args: tuple, kwargs: dict, whole: bool = True) -> Any:
        """A graphed module's call: answered whole where the plan has it as a member at this
        point of the forward and it matches (see :meth:`_Run.whole`), else its forward runs
        and its calls are met one by one (``whole=False``: a call through ``_call_impl``, its
        hooks run: never answered whole)."""
        run = self.run
        if whole and not run.diverged:
            members = run.plan.members.get(run.cursor)
            if members is not None:
                for member in members:
                    if member.module is module:
                        out = run.whole(member, args, kwargs)
                        if out is not _NO:
                            return out
                        break
        return fn(*args, **kwargs)

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
        try:
            call = plan.calls[i]
        except IndexError:  # (more calls than recorded)
            call = None
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
        if run.entered is not seg:
            if i != seg.first:  # (a segment is entered at its first call only)
                return run.diverge(func, args, kwargs)
            run.start(seg)
        elif i <= seg.launch and run.pending is None:
            # (replayed before its launch, by a call of cudagraphify's own that needed real
            # values: its inputs were not all in; it replays again at its launch)
            run.pending = seg
        if copies:
            try:
                for buf, leaf in copies:
                    buf.copy_(leaf)
            except RuntimeError:  # (a sparse tensor where a dense one was recorded)
                return run.diverge(func, args, kwargs)
        if run.pending is not None and i >= seg.launch:  # (its inputs all in: _Segment.launch)
            run.flush()
        run.cursor = i + 1
        if call.same:  # (x.float() of a float x is x itself)
            leaves: list = []
            _structure(args, kwargs, leaves)
            outs = [t.detach() for t in call.outs]
            for k, j in call.same:
                outs[k] = leaves[j]
            handed[i] = outs
            out = outs[0] if call.single else _build(call.out_struct, iter(outs))
        elif call.single:
            # (``detach()``, not ``.data``: an output that views a buffer or another member's
            # output shares its version counter, as eager's does; a new TensorImpl on its
            # storage either way, which ``SegmentPlan.held`` counts)
            out = call.outs[0].detach()
            handed[i] = (out,)
        else:
            outs = handed[i] = [t.detach() for t in call.outs]
            flat = call.flat
            out = flat(outs) if flat is not None else _build(call.out_struct, iter(outs))
        return out
