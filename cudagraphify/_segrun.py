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
  graph's outputs (an argument it returned as is at record, as is). The graph replays as soon
  as its inputs are all copied in (at its last member that copies one, its first where none
  does) and after every device wait or host sync the record's profile showed between its
  calls: the GPU runs it while the forward's Python meets the members after that point, which
  read only the graph's outputs and statics. A call that does not match replays the pending
  segment and runs, with the rest of the forward, eagerly: values already handed out come out
  right (the graph writes only memory of its own, and every input it read was in), and what it
  computed for the calls not met is never handed out. Outputs on the graph's
  memory are copied before the forward returns them (a tensor returned twice, once; views of
  one another stay views of one copy).

Only inference calls outside any region use segments; the plan is dropped when the global flags
or the parameters' addresses change (:class:`~._guards.FlagsGuard`, the statics' check).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree

from ._capture import drain
from ._guards import FlagsGuard, StateGuard
from ._nested import Nested
from ._opinfo import written_by
from ._policy import default_policy
from ._copies import copies_of, copy_of
from . import _trial, _watch, _writes
from ._trial import MARGIN, Trial
from ._segcalls import (P, S, VARYING, X, _Call, _Matcher, _Member, _Opaque, _Segment,
                        _Tensor, _bitwise_equal, _build, _call_args, _flat, _meta, _raw_stream,
                        _use_count)
from ._segmodes import _Recorder, _Replayer, _Run, _profiler, canary, direct_launch, waits

__all__ = ["ENABLED", "SegmentPlan", "Segments", "VARYING", "direct_launch"]

_storage_ptr = torch.UntypedStorage.data_ptr
_refcount = sys.getrefcount

ENABLED = False  # experimental: off until it has been measured on a GPU (see issue 16)
MIN_CALLS = 2  # a segment with fewer members runs eagerly (a replay would not pay)
MAX_VOID = 16  # timings of the forward without segments voided before one is kept anyway
PAID = 8  # matched calls after which a plan gives its signature its budget of records back
MAX_PLANS = 4  # plans recorded in a row, none of them PAID, before it stays eager


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
        # module calls (pieces) met in the record, and those answered whole (see _members):
        # first call -> the members starting there (outermost first)
        self.frames: list = []
        self.members: dict[int, list[_Member]] = {}
        self.whole = 0  # module calls answered whole
        self.guard: StateGuard | None = None  # what the record read of modules
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
        # the calls that a wait outside every call came just before, in the record (see
        # _segmodes.waits; None: the profile shows none, not even the canary's). On the CPU
        # (no streams) none
        self.waits: set[int] | None = set()
        self.cuda = device.type == "cuda"
        self.index = (device.index if device.index is not None else torch.cuda.current_device()) \
            if self.cuda else None
        self.token: int | None = None  # (CUDA) the stream the record's call ran on
        self.last: int | None = None  # (CUDA) the stream that replayed the graphs last
        self.side: set[int] = set()  # (CUDA) other streams the last call's eager calls used
        # the storages of the graphs' memory as the plan alone holds them (see _use_counts)
        self._baselines: tuple[list, list[int], list, list[int], list[int]] = \
            ([], [], [], [], [])
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
        self.frames, self.members = [], {}

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
        rec = _watch.Recorder()  # (what it reads of modules: see _members)
        if prof is not None:
            self.profiling = True
            try:
                with prof:
                    canary(self.device)
                    with Nested(), _watch.recording(rec, ran=False), _Recorder(self):
                        out = fn(*args, **kwargs)
            finally:
                self.profiling = False
            events = prof.events()
            why = direct_launch(events)
            if why is not None:
                self.no_segments(why, seen=True)
                return out
            self.waits = waits(events)
        elif self.device.type == "cuda" and not dry:
            with Nested():
                out = fn(*args, **kwargs)
            self.no_segments("the profiler could not be started (it finds kernels the mode "
                             "does not see)", seen=False)
            return out
        else:
            with Nested(), _watch.recording(rec, ran=False), _Recorder(self):
                out = fn(*args, **kwargs)
        if dry:  # (what the comparison reads, and nothing that holds memory)
            self.copied_held, self.frames = [], []
            for call in self.calls:
                call.eager_out = []
                call.refs = [ref if ref[0] == P else (ref[0],) for ref in call.refs]
            return out
        self.copied_held = []
        if earlier is not None:
            self.vary_from(earlier)
            self.earlier = None
        self._guard(rec)
        self._views_alone()
        self._capture()
        self.last = self.token  # (the verifying replays ran on the call's stream)
        for i, call in enumerate(self.calls):  # (the record's copies are not needed any more)
            call.eager_out = []
            call.refs = [ref[:2] if ref[0] == X else ref for ref in call.refs]
            seg = self.segments[call.seg] if call.seg is not None else None
            if seg is not None and seg.refused is None:
                call.segment, call.outs = seg, seg.outs[i]
                call.match = _Matcher(call, i, seg, self.pool_ptrs).build()
                call.single = call.out_struct == 0 and type(call.out_struct) is int
                flat = call.out_struct
                if type(flat) is tuple and (flat[0] is tuple or flat[0] is list) and all(
                        s == 0 and type(s) is int for s in flat[1]):
                    call.flat = flat[0]
        self._members()
        self._baselines = self._use_counts()
        self.ready = True
        clock = getattr(self.backend, "clock", None)
        if clock is not None and any(seg.graph is not None for seg in self.segments):
            self.trial = Trial(clock(self.device))
        return out

    def _guard(self, rec: "_watch.Recorder") -> None:
        """What the record read of modules (their attributes, classes, forwards and hooks), as
        a guard a module call answered whole checks first: its Python, which does not run,
        would read them (and the forward may change them before it). None where the record
        met no module call."""
        if not self.frames:
            self.guard = None
            return
        root = self.state.statics.root
        mods = [m for m in self.state.statics.modules if m is not root]
        refs = [weakref.ref(m) for m in mods]
        guard = StateGuard(list(rec.reads.values()),
                           hooks=lambda: _watch.hook_fingerprint(refs), ran=mods,
                           owned=frozenset(map(id, self.state.statics.modules)),
                           tree=self.state.statics.modules)
        self.guard = guard if not guard.unguardable else None

    def _members(self) -> None:
        """The module calls of the record that a replay answers whole (:class:`_Member`):
        those whose calls are all members of one graphed segment, none returning an argument
        as it is, whose calls read no tensor but its arguments, the parameters and buffers
        and what its own calls made, and whose calls' outputs that it did not return no later
        call reads (see _Recorder.module); only where what the record read of modules can be
        guarded (see :meth:`_guard`)."""
        frames, self.frames = self.frames, []
        if self.guard is None:
            return
        calls = self.calls
        last_read: dict[tuple[int, int], int] = {}
        for i, call in enumerate(calls):
            for ref in call.refs:
                if ref[0] == P:
                    last_read[ref[1], ref[2]] = i
        for frame in frames:
            seg = calls[frame.start].segment
            if frame.why is not None or seg is None or any(
                    calls[j].segment is not seg or calls[j].same
                    for j in range(frame.start, frame.end)):
                continue
            # (a wait its Python makes would not be made: see _segmodes.waits; where the
            # profile shows no waits, any module might make one)
            if self.waits is None or any(frame.start < j < frame.end for j in self.waits):
                continue
            returned = set(frame.out_refs)
            if any(frame.start <= j < frame.end and (j, k) not in returned and i >= frame.end
                   for (j, k), i in last_read.items()):
                continue
            refs: list = []
            bufs: dict[int, list] = {}
            for a, meta in enumerate(frame.metas):
                reads = [(j, k) for j, k, b in frame.reads if b == a]
                kinds = {calls[j].refs[k][0] for j, k in reads}
                if len(kinds) > 1:
                    break
                if not reads or kinds == {X}:
                    refs.append((X, meta))
                    bufs[a] = [seg.bufs[j, k] for j, k in reads]
                else:
                    refs.append(calls[reads[0][0]].refs[reads[0][1]])
            else:
                member = _Member(frame, seg, refs)
                member.match = _Matcher(member, frame.start, seg, self.pool_ptrs, bufs).build()
                if member.out_struct == 0 and type(member.out_struct) is int \
                        and len(calls[member.hand[0]].outs) == 1:
                    member.lone = member.hand[0]
                self.members.setdefault(frame.start, []).append(member)
        for members in self.members.values():  # (the outermost first: explain lists them so)
            members.sort(key=lambda m: -m.end)

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
            if getattr(self.pool, "retired", False):  # (a capture into it failed: _capture.Pool)
                self.pool = backend.new_pool(self.device)
            try:
                self._capture_one(seg)
            except Exception as e:  # noqa: BLE001 - a segment that cannot be graphed runs eagerly
                seg.refused = f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                seg.graph = None
                continue
            for t in [*(t for i in seg.calls for t in seg.outs[i]), *seg.bufs.values()]:
                ptr = t.untyped_storage().data_ptr()
                # (a member may return a view of a parameter; an empty tensor has no memory)
                if ptr and ptr not in self.static_ptrs:
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

    def _launch(self, seg: _Segment) -> int:
        """Where ``seg`` replays (see :class:`~._segcalls._Segment`): its last call that copies
        an input in, and after every wait the record saw between its calls (a weight written
        on another stream and waited for: a replay before the wait would read it before the
        write); its last call where the profile could not show waits."""
        if self.waits is None:
            return seg.last
        return max([seg.first, *(i for i, _ in seg.bufs),
                    *(j for j in self.waits if seg.first < j <= seg.last)])

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
        # (and the random state as the call left it: the warm-up and the check draw)
        with seg.state.entered(), _writes.rng_kept(self.device):
            if not seg.state.same():
                raise RuntimeError("its calls ran under global flags set inside the forward "
                                   "that cannot be set again for the capture")
            inputs = self._inputs(seg)
            seg.launch = self._launch(seg)
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

    def _use_counts(self) -> tuple[list, list[int], list, list[int], list[int]]:
        """The storages on the graphs' memory that the segments' outputs and buffers hold, as
        :meth:`held` compares them: (their ``_cdata``, their use counts, the storages, their
        addresses, the storages' Python reference counts)."""
        # (made in a call of its own: only ``held`` refers to them here, the reference counts
        # below are its own)
        held = self._storages()
        cdatas = [x._cdata for x in held]
        return (cdatas, list(map(_use_count, cdatas)), held, list(map(_storage_ptr, held)),
                list(map(_refcount, held)))

    def _storages(self) -> list:
        storages = {}
        for seg in self.segments:
            for t in [*(t for outs in seg.outs.values() for t in outs), *seg.bufs.values()]:
                st = t.untyped_storage()
                if st.data_ptr() in self.pool_ptrs:
                    storages[st.data_ptr()] = st
        return list(storages.values())

    def held(self) -> bool:
        """Whether a tensor on the graphs' memory outlived the call that handed it out (the
        forward kept it, or returned it inside an object the output copy does not look into),
        or the storage object of one (``h.untyped_storage()``: the very Python object the
        baseline holds, PyObject preservation hands it out again, so only its reference count
        shows it): a replay would overwrite it."""
        # (a storage resized or freed: the graph's memory is gone; a resize always moves its
        # data, a tensor's resize within its storage's bytes leaves the storage as it is)
        # (one C call per storage, no Python loop: paid on every call of the forward)
        cdatas, counts, storages, ptrs, refs = self._baselines
        return list(map(_use_count, cdatas)) != counts \
            or list(map(_refcount, storages)) != refs \
            or list(map(_storage_ptr, storages)) != ptrs

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
        self.members, self.frames = {}, []
        self.pool = None
        self._baselines = ([], [], [], [], [])
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
            what = f"refused: {seg.refused}" if seg.refused else \
                f"graphed, replays at call {seg.launch}"
            lines.append(f"segment {s}: calls {seg.first}-{seg.last} ({len(names)}: "
                         f"{names[0]} at {self.sites[seg.first]} .. {names[-1]} at "
                         f"{self.sites[seg.last]}) {what}")
        members = [m for start in sorted(self.members) for m in self.members[start]]
        if members:
            lines.append("module calls answered whole (their Python not run), "
                         f"{self.whole} so far: " +
                         ", ".join(f"{m.name} at call {m.start}" for m in members))
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
