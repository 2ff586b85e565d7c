"""The hot path of one graphed callable: replay, run eagerly, or hand a new signature's first
call to :mod:`._first_call` and record what it decided.

One :class:`GraphedState` exists per graphed module instance (or graphed function). A call:

1. **fast path** — the entry the previous call replayed, for calls whose arguments are tensors,
   under ``no_grad``/``inference_mode``: every guard in a few C calls (argument layouts, global
   flags, parameter addresses and buffer layouts, the module-state epoch, the stream), then
   replay.
   Likewise the previous call's decision to run eagerly (an opaque argument, or a remembered
   eager or piecewise decision), re-checked cheaply (:mod:`._fast`).
2. **slow path** — the statics guard (parameters and buffers still where the graphs read them);
   top-level arguments of opaque types decide "eager" without flattening anything; else the
   signature is built, its key looked up (the active region's cache, else the state's own),
   and the first entry that fits (module state, global flags) is replayed or run eagerly;
3. **first call** — :class:`~._first_call.FirstCall` warms up, screens, captures and verifies;
   its :class:`~._outcome.Outcome` is recorded here (the engine is the only place that
   counts or writes a cache).

Nothing here touches ``torch.cuda``: the backend (``_capture``) does.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any, Callable

import torch

from . import _capture, _guards, _region, _segrun, _trial, _watch
from ._capture import MULTI_STREAM, drain
from ._cache import (THRASH_EVICTIONS, THRASH_USES, CachePolicy, EagerEntry, GraphCache,
                     SetUpEntry)
from ._errors import CudagraphifyUsageError, warn_once
from ._fast import MISS, EagerFast, Fast, converting
from ._first_call import DEFERRED, EAGER, GRAPHED, PIECEWISE, FirstCall, Outcome
from ._nested import in_graphed_call, plain_reason, segment_mode, sizes_log
from ._fsdp import RESHARDS, ParentReshard, reshards_after_forward
from ._options import Options, Stats
from ._piecewise import PiecewiseEntry, plan
from ._pieces import PLAN_PLAIN, STATE, PieceRuns, keyed_root
from ._trial import PlanTrial, Trial
from ._rebase import Families
from ._replay import CapturedGraph
from ._signature import Unkeyable, build_signature, opaque_argument, storage_of
from ._writes import inputs_alias
from ._state import (SetUp, StateUnkeyable, demote, demoted, first_of_kind, is_static_state,
                     pooled, state_key)
from ._statics import StaticState
from ._training import TrainingGraph

__all__ = ["GraphedState", "PLAN_PLAIN", "STATE"]

_region_stack = _region.stack_var()


def _keep_until_release(ref: weakref.ref) -> Callable[[], None]:
    """A release hook holding ``ref`` (a weak reference with a callback) until the graph is
    released: the callback then never fires for a graph that is gone."""
    return lambda: ref


_MAX_DEFERRED = 8  # transient capture failures before a signature is decided for good
_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_MAX_MOVES = 4  # calls that find the statics moved (with under _STILL_CALLS calls between)
_STILL_CALLS = 16  # calls without a move after which re-capturing is tried again
# Training graphs of one signature that may wait for their backward at once: a grad-mode call
# while every one of them waits gets a graph of its own (gradient accumulation over two
# forwards, a forward whose output is kept and never backpropagated); past this it runs eagerly
_IN_FLIGHT = 2
# graphs captured in a row, none replayed before the next new signature (at least this many,
# and as many as the cache holds: a warm-up over the sizes a server will see is no storm),
# after which new signatures run eagerly, _STORM_CALLS distinct ones (a shape or a cache's
# memory that changes every call: beam search's reorder_cache), before capturing is tried
# again; a signature met twice in that time ends it
_MAX_FRUITLESS = 8
_STORM_CALLS = 64
# region graphs released to be captured again after the graph whose held output blocked
# their replay (see _replay): per signature of a callable, this many in a row (a plan nested in
# a plan delays its pieces' captures by a call per level; a blocker captured anew every call, a
# growing shape, or two graphs that block each other, would block each recapture again), where
# a blocked graph that had replayed _RECAPTURE_WORKED times itself (its eager calls not
# counted) starts its signature's row again: a graph blocked anew whenever a graph that makes
# its inputs is captured again after it (parameters reassigned, a new signature of that one
# alone) is put after it for good by each recapture
_MAX_RECAPTURES = 4
_RECAPTURE_WORKED = 32
# a piecewise plan's piece captures a signature the second time it is seen: the first call of
# a new one runs eagerly (a prompt length seen once, or a shape that grows every step, such as
# T5's position bias over a growing cache, is not worth a capture); the signatures seen once,
# the most recent this many, are kept. Pieces capture at first sight under capture_sizes
# (_sizes) and in a keyed root's first run with pieces of a signature (_pieces.keyed_root: the
# root's own first call of it was the first sight)
_SEEN_ONCE = 64
HELD_BY_ANOTHER_THREAD = ("an output of this graph is held by another thread's run of the "
                          "same callable; running eagerly so that it is neither overwritten nor "
                          "moved while that thread reads it")
CAPTURED_ELSEWHERE = ("the stream that replayed this callable's graphs last is under another "
                      "thread's CUDA graph capture of its own: no stream may wait on it (it would "
                      "join that capture), and work queued there before it may still read this "
                      "graph's memory; running eagerly while that capture lasts")
_BLOCKED_CALLS = 3  # blocked calls (see _BLOCKED_GAP) before it is captured again
_BLOCKED_GAP = 8  # uses from one blocked call to the next that still count them together


def _fruitless_limit(policy: CachePolicy) -> int:
    return max(_MAX_FRUITLESS, policy.max_graphs)
_Tensor = torch.Tensor
PENDING = ("the backward of an earlier call with this signature has not run yet (its "
           "activations would be overwritten); call under torch.no_grad() when no backward "
           "follows")
FORWARD_AD = ("inside a forward-mode AD level (torch.autograd.forward_ad.dual_level, "
              "torch.func.jvp): a graph carries no tangents")
FUNCTORCH = ("inside a torch.func transform (grad, vjp, jacrev, vmap): its tensors are "
             "wrapped, a graph's copy-in and outputs are not")
_functorch_stack = torch._C._functorch.peek_interpreter_stack
LAZY = ("uninitialized parameters (a LazyModule): this call initializes them; graphed from "
        "the next call")
STATE_ALIAS = ("an argument shares memory with a static state (a cache) the graph reads and "
               "writes in place: a graph would read a copy made before the forward's write")
WRITTEN_ALIAS = ("an argument the forward writes in place shares memory with a parameter or "
                 "buffer it reads: a graph would write a copy of the argument and read the "
                 "parameter as it was before the write")
HELD_ALIAS = ("an argument shares memory with a tensor the forward reads from outside its "
              "arguments, parameters and buffers (an attribute, closure or global): a graph "
              "reads the argument from a copy and that tensor in place, so a write to either "
              "is not seen through the other")


class GraphedState(PieceRuns):
    """Caches, counters and the lock of one graphed callable."""

    def __init__(self, module: torch.nn.Module | None, options: Options, name: str,
                 static_positions: frozenset[int], static_names: frozenset[str], *,
                 install_pieces: Callable[[list[str]], list] | None = None, share=None):
        _watch.install()
        self.name = name
        self.options = options
        self.policy = options.cache_policy or CachePolicy(max_graphs=options.max_graphs)
        self.cache = self.policy.new_cache()
        self.statics = StaticState(module)
        self.static_positions = static_positions
        self.static_names = static_names
        self.share = share  # a _wrap.Share (its group, its layer index) under share_graph
        self.dispatch = None  # the _wrap.Dispatch that made it (a graphify of a module)
        # a share_graph group's layers replay through one set of static buffers: one lock
        self.lock = share.group.lock if share is not None else (
            self.policy.shared_lock or threading.RLock())
        self.install_pieces = install_pieces  # graphifies submodules (a piecewise plan)
        _trial.pieces_epoch[0] += 1  # (a module graphified anew may be another's piece)
        self.pieces: list = []  # submodules a piecewise plan graphified
        # whether one of them is not given back (see _trial), as of _trial.pieces_epoch
        self._pieces_live: tuple[int, bool] = (-1, False)
        self.last_plan: tuple | None = None
        self.captures = 0
        self.retargets = 0  # graphs made from a share_graph template instead of a capture
        self.set_ups = 0  # calls whose static states were set up before them (see _state.SetUp)
        self.replays = 0
        self.capture_seconds = 0.0
        self.warmup_seconds = 0.0
        self.eager_calls: collections.Counter[str] = collections.Counter()
        self.invalidations = 0
        self._warned: set[str] = set()
        self._retired_copies = 0
        self.accel = frozenset({"cuda"})  # device types whose work graphs capture
        self._device: torch.device | None = None
        self._deferred = 0  # captures put off by a transient failure
        # keys whose first call set up an object passed as it is (a cache's first update) and
        # was put off once: the next one is decided as it comes
        self.set_up_keys: set = set()
        # keys whose first call met modules with tensors it could not see written (deferred
        # once: see FirstCall.warm_up)
        self.adopt_keys: set = set()
        # graphs keyed to static state that died (an HF StaticCache generate() dropped):
        # (cache, weak reference to the graph), queued by a weakref callback, released by the
        # next call (not an eviction: no later call can pass that cache)
        self._state_died: list[tuple[GraphCache, weakref.ref]] = []
        self._moves = 0  # calls that found parameters or buffers moved, since they last stood
        self._still = 0  # calls in a row since the last move
        self._moved_why = ""
        # captures that were never replayed (see _MAX_FRUITLESS): ``replays`` right after the
        # last capture's call, how many in a row, and new signatures run eagerly since
        self._capture_mark: int | None = None
        self._fruitless = 0
        self._storm_keys: set = set()  # the signatures run eagerly by the storm
        self._storm_mark = 0
        self._recaptures = 0  # all of them (see _MAX_RECAPTURES)
        # the key of a graph released to be captured again -> its row (recaptures in a row),
        # until the key's next graph takes it on (see _replay, _record_graph)
        self._recapture_rows: dict = {}
        self._seen_once: collections.OrderedDict = collections.OrderedDict()  # (_SEEN_ONCE)
        self._train_eager: str | None = None  # why grad-mode calls run eagerly from now on
        self._parent_reshards = ParentReshard()
        self._stream_token: int | None = None
        # the previous call's decision, checked cheaply: a Fast (a replay) or an EagerFast
        self._fast: Fast | EagerFast | None = None
        # the replay path of the signature replayed before it, tried when ``_fast`` misses
        # (see ``other_fast``): a prefill's and a decode step's, in turn
        self._alt: Fast | None = None
        # (a root's Bypass that marked this piece, the eager decision it marked: see _fast)
        self._bypass: tuple | None = None
        # (thread, host clock) when the slow path took the last call (see _timed_replay)
        self._slow_at: tuple[int, float] | None = None
        # graphs keyed to static state, rebased to a new state's memory (see _rebase)
        self.families = Families()
        self._pools: dict = {}  # device index -> the memory pool of this callable's graphs
        # a piece whose graph cost more than its eager run: why it runs as plain PyTorch
        # (see _trial); calls run eagerly, checked first (the DirectCall checks it too)
        self.given_back: str | None = None
        self._backward_pending = False  # given back, a training graph's backward still to run
        # puts a given-back piece's plain forward back in place (set by _wrap for a plan's
        # pieces; called once, when no backward of it is pending): its calls then cost what
        # they cost without cudagraphify, and are no longer counted
        self.retire: Callable[[], None] | None = None
        self._opaque_planned = False  # pieces planned around an opaque argument (once)
        # the plan's forwards timed with and without its pieces (see _trial): None before,
        # False once decided (timed again when pieces are added)
        self._plan_trial: PlanTrial | bool | None = None
        self.plan_verdict: str | None = None  # the plan trial's outcome, for explain
        # the implicit region in which this callable's eager runs call its pieces (see chained)
        self._chain: _region.GraphRegion | None = None
        self.segments = _segrun.Segments(self)  # graphed runs of calls in eager signatures
        self.seen_once = 0  # a piece's new signatures run eagerly the first time (_SEEN_ONCE)
        self.timed_calls = 0  # a piece's first calls run eagerly to time its graph against
        # a rehearsal that capture_sizes lends to its later sizes (see _rehearsal.lend): made
        # on these statics, it goes with the graphs (release, invalidate)
        self.rehearsed = None

    # A copied or unpickled module starts with no graphs: graphs belong to the memory they read.
    def __deepcopy__(self, memo) -> None:
        return None

    def __reduce__(self):
        return (_no_state, ())

    # -- the call path ---------------------------------------------------------------------

    def __call__(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """Call ``fn(*args, **kwargs)`` through the graphs of this state."""
        if not _watch.global_hooks_present():
            fast = self._fast
            if fast is not None:
                out = fast.call(fn, args, kwargs)
                if out is not MISS:
                    return out
            if self._alt is not None and converting() is None:
                out = self.other_fast(fn, args, kwargs)
                if out is not MISS:
                    return out
        return self.slow(fn, args, kwargs)

    def other_fast(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """The replay path of the signature replayed before the last one (``_alt``), tried
        where the last one's missed: it becomes the current one, and the current one is kept
        aside in its place; a miss puts them back (MISS). Its own checks decide, as they do
        for the current one (the caller has checked that no global module hook is
        registered, and that torch.compile converts no frame now: ``_fast.converting``). Not
        across a rescan of the statics: the slow path finds their objects again first
        (``Counters.resolve``)."""
        alt = self._alt
        with self.lock:
            if alt is None or self._alt is not alt:
                return MISS
            if alt.scans != self.statics.scans:
                self._alt = None
                return MISS
            fast = self._fast
            kept = fast if type(fast) is Fast else None
            if kept is not None:
                n = kept.pending_uses()
                kept.entry.uses += n
                kept.entry.replayed += n
            self._fast, self._alt = alt, kept
            alt.base = self.replays  # (its replays count from here: see Fast.pending_uses)
        out = alt.call(fn, args, kwargs)
        if out is MISS:
            with self.lock:
                if self._fast is alt and self._alt is kept:
                    self._fast, self._alt = fast, alt
                    if kept is not None:
                        kept.base = self.replays
        return out

    def slow(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """A call the fast path did not take: decided afresh."""
        # (a training graph's timed turn counts from here; the thread's own: another thread's
        # slow path may run meanwhile)
        self._slow_at = (threading.get_ident(), _trial.host_clock())
        if self.given_back is not None:
            return self._given_back(fn, args, kwargs)
        enabled = self.options.enabled
        if enabled is not True and not (enabled() if callable(enabled) else enabled):
            return self._eager("disabled (enabled=False)", fn, args, kwargs, warn=False)
        region = _region.current()
        if region is not None and not region.enabled:
            return self._eager("disabled by graph_region(enabled=False)", fn, args, kwargs,
                               warn=False)
        backend = _capture.default_backend()
        if in_graphed_call() or backend.in_capture():
            # Inside another graphed callable's warm-up or capture: become part of it (a
            # plan trial's plain forward: counted).
            plain = plain_reason()
            if plain is not None:
                self.eager_calls[plain] += 1
            mode = segment_mode.mode
            if mode is not None and self.statics.root is not None and in_graphed_call():
                # (a segments' record meets a module's first calls here, before its
                # DirectCall is in place; answered whole only from there, see _segmodes)
                return mode.module(self.statics.root, fn, args, kwargs, whole=False)
            return fn(*args, **kwargs)
        if region is not None:
            with region.lock, self.lock:
                return self._call(backend, region, fn, args, kwargs)
        with self.lock:
            return self._call(backend, region, fn, args, kwargs)

    @property
    def train_eager(self) -> str | None:
        """Why grad-mode calls run eagerly from now on (None while they may be graphed)."""
        return self._train_eager

    def refuse_training(self, reason: str) -> None:
        """From now on, grad-mode calls run eagerly (a backward found its parameters moved)."""
        self._train_eager = reason

    def _call(self, backend, region, fn: Callable, args: tuple, kwargs: dict,
              set_up: bool = False) -> Any:
        if self.given_back is not None:  # (given back while this call waited for the lock)
            return self._given_back(fn, args, kwargs)
        fast = self._fast
        if type(fast) is Fast:
            n = fast.pending_uses()
            fast.entry.uses += n
            fast.entry.replayed += n
            self._alt = fast  # (kept aside for its signature's next call: see other_fast)
        self._fast = None  # remade by a replay that qualifies
        if _guards.dual_level() >= 0:
            return self._eager(FORWARD_AD, fn, args, kwargs)
        if _functorch_stack() is not None:
            return self._eager(FUNCTORCH, fn, args, kwargs)
        while self._state_died:
            cache, ref = self._state_died.pop()
            entry = ref()
            if entry is not None:
                cache.discard(entry)
        moved = self.statics.changed()
        if moved is not None:
            self.invalidate(moved)
            self._moves += 1
            self._still = 0
        elif self._moves:
            self._still += 1
            if self._still >= _STILL_CALLS:
                self._moves = 0
        if self.statics.lazy:
            # (materialized in place by its module's first forward: no registry write to see)
            try:
                return self._eager(LAZY, fn, args, kwargs)
            finally:
                self.statics.rescan()
        if self.statics.opaque is not None:
            return self._eager(self.statics.opaque, fn, args, kwargs)
        if torch.is_grad_enabled():
            why = self._training_refused()
            if why is not None:
                return self._eager(why, fn, args, kwargs)
        if self._moves > _MAX_MOVES:
            return self._eager(
                f"parameters or buffers keep moving to new memory ({self._last_move(moved)}; "
                "FSDP2 gathers them anew when it reshards): running eagerly until they stay "
                f"put for {_STILL_CALLS} calls", fn, args, kwargs)
        opaque = opaque_argument(args, kwargs, self.static_positions, self.static_names)
        if opaque is not None:
            _refuse_tracers(args, kwargs)
            if not self._opaque_planned:
                if (region is None or region.implicit) and not torch.is_grad_enabled():
                    self._fast = EagerFast.opaque(self, region, opaque, args, kwargs)
                    return self._plan_around(opaque, backend, fn, args, kwargs)
                # (no fast path yet: a later inference call must reach the plan)
                return self._eager(opaque, fn, args, kwargs)
            self._fast = EagerFast.opaque(self, region, opaque, args, kwargs)
            return self._eager(opaque, fn, args, kwargs, chained=True,
                               entry=self.segments.opaque)
        sig, leaves, static_flags = build_signature(args, kwargs, self.static_positions,
                                                    self.static_names)
        if isinstance(sig, Unkeyable):
            if self._demote_unkeyable(args, kwargs):  # (then passed as opaque objects)
                return self._call(backend, region, fn, args, kwargs, set_up)
            return self._eager(sig.reason, fn, args, kwargs)
        if sig.state.grad and _saved_tensors_hooks(False) is not None:
            return self._eager("inside saved-tensor hooks (activation checkpointing, "
                               "save_on_cpu): they must see the forward's own tensors, which a "
                               "graph keeps to itself", fn, args, kwargs)
        cache = region.cache_for(self) if region is not None else self.cache
        key = self.policy.full_key(sig)
        if sig.state.grad and self.statics.tensors:  # which parameters require grad
            key = (key, self.statics.grad_pattern())
        busy = None  # training graphs of the key waiting for their backward
        for entry in cache.get(key):
            owner = entry.owner
            if owner is not self:
                # A graph of another module (a shared policy): it reads that module's statics.
                if owner is None:
                    if entry.orphaned:  # that module is gone, and its memory with it
                        cache.drop_orphan(entry)
                    continue
                moved = owner.statics.changed()
                if moved is not None:
                    owner.invalidate(moved)
                    continue
            if not entry.fits(leaves):
                continue
            kind = type(entry)
            if kind is TrainingGraph and entry.pending():
                busy = [entry] if busy is None else busy + [entry]
                continue  # (another graph of the key may be free)
            cache.touch(entry)
            if kind is CapturedGraph or kind is TrainingGraph:
                entry.uses += 1  # (the key came back while its graph was kept)
                return self._replay(backend, region, entry, leaves, fn, args, kwargs)
            if kind is SetUpEntry and not set_up:
                states = [leaves[i] for i in sig.static_states]
                if entry.demoted is not None and states:
                    # (a state an earlier call of it set up was demoted, its Python state
                    # changed by every call: this one, of its kind, is passed as it is at once,
                    # not probed on two calls first; the call is decided anew, around it)
                    for v in states:
                        demote(v, entry.demoted)
                    if all(demoted(v) is not None for v in states):
                        return self._call(backend, region, fn, args, kwargs, set_up=True)
                for v in states:
                    first_of_kind(v, entry)
            if kind is SetUpEntry and not set_up and self._set_up(entry, leaves):
                # the call's states are now as its first update leaves them: decided anew
                # (once: a key that finds this entry again runs eagerly, see ``set_up``)
                captures = self.captures
                out = self._call(backend, region, fn, args, kwargs, set_up=True)
                if self.captures > captures:
                    # (the first two states capture: a family's template and its diff; a
                    # third that captures was not rebased, nor will the next ones be)
                    entry.captured += 1
                    if entry.captured > 2:
                        entry.set_ups = []
                return out
            self._fast = EagerFast.decided(self, region, entry, args, kwargs)
            return self._eager(entry.reason, fn, args, kwargs,
                               chained=type(entry) is PiecewiseEntry, entry=entry)
        if busy is not None:
            if self._another_in_flight(busy, region, cache):
                return self._in_flight(busy, backend, region, cache, key, sig, leaves,
                                       static_flags, fn, args, kwargs)
            # (the next calls like this one run eagerly at a fast path's cost while it stays so)
            self._fast = EagerFast.pending(self, region, busy[0], PENDING, args, kwargs,
                                           busy[1:])
            return self._eager(PENDING, fn, args, kwargs)
        reason = self._ineligible(backend, leaves, cache)
        if reason is not None:
            cache.put(key, EagerEntry(reason, self))
            return self._eager(reason, fn, args, kwargs)
        if cache.thrashing_now(key):
            # (no entry: it would hide the key's graphs under another module state or flags)
            return self._eager(
                f"its graph was evicted {THRASH_EVICTIONS} times before it was used "
                f"{THRASH_USES} times (more distinct signatures come round than "
                f"max_graphs={cache.policy.max_graphs} holds: each capture would evict another "
                "graph before it pays); this signature runs eagerly, the graphs kept replay "
                "(raise max_graphs to graph it)",
                fn, args, kwargs)
        if sig.static_states and region is None and self.families:
            made = self.families.entry(self, sig, leaves, backend, self._device)
            if made is not None:  # a family's template rebased to this call's states
                family, entry = made
                outcome = Outcome(GRAPHED, None, entry=entry, guard=family.guard,
                                  flags=family.flags, replay=True, shared=True,
                                  states=[leaves[i] for i in sig.static_states])
                return self._record(outcome, backend, region, cache, key, leaves, fn, args,
                                    kwargs)
        storm = self._storming(key)
        if storm is not None:
            return self._eager(storm, fn, args, kwargs)
        if self.options.piece and not keyed_root.get() and sizes_log.get() is None \
                and self._first_sight(key):
            _trial.activity[0] += 1  # (a plan's forward timed with it in is timed again)
            self.seen_once += 1
            return fn(*args, **kwargs)
        first = FirstCall(self, backend, region, key, sig, leaves, static_flags, fn, args,
                          kwargs, self._device)
        try:
            outcome = first.run()
        finally:
            self.warmup_seconds += first.warmup_seconds
        out = self._record(outcome, backend, region, cache, key, leaves, fn, args, kwargs)
        if outcome.kind == GRAPHED:
            self._capture_mark = self.replays  # (its call's own replay counted)
        return out

    def _in_flight(self, busy: list, backend, region, cache, key, sig, leaves, static_flags,
                   fn, args, kwargs) -> Any:
        """The call captures another training graph of its signature, whose graphs (``busy``)
        all wait for their backward. Nothing but that graph is recorded under the key (an
        eager entry would hide the graphs it has): a capture that does not come out graphed
        runs eagerly, and no other graph of the key is tried again."""
        first = FirstCall(self, backend, region, key, sig, leaves, static_flags, fn, args,
                          kwargs, self._device)
        try:
            outcome = first.run()
        finally:
            self.warmup_seconds += first.warmup_seconds
        if outcome.kind != GRAPHED:
            busy[0].no_other = outcome.reason or "not captured"
            self.eager_calls[PENDING] += 1
            self._note(False, PENDING)
            return outcome.result
        return self._record(outcome, backend, region, cache, key, leaves, fn, args, kwargs,
                            timed=False)

    def _another_in_flight(self, busy: list, region, cache) -> bool:
        """Whether a grad-mode call whose signature's training graphs (``busy``) all wait for
        their backward gets a graph of its own (captured by this call): fewer than
        :data:`_IN_FLIGHT` of them, each with a pool of its own (its saved activations stay
        apart), outside an explicit region and a shared policy, none of them another
        callable's, no earlier attempt that failed, (a piece's) each one's trial over with a
        verdict to keep it: the new one is not timed again (a verdict to give back one graph
        of a signature, made while another stays, would leave that one behind its eager
        entry), and room in the cache for it without evicting a graph (a graph waiting for
        its backward would be the first to go, and the backward would raise)."""
        return len(busy) < _IN_FLIGHT and (region is None or region.implicit) \
            and not self.policy.shared and all(e.owner is self for e in busy) \
            and busy[0].no_other is None and all(e.trial is None for e in busy) \
            and len(cache.graphs()) < cache.policy.max_graphs

    def _demote_unkeyable(self, args: tuple, kwargs: dict) -> bool:
        """Demote the static states among the call's top-level arguments that
        :func:`~._state.state_key` cannot describe (an HF ``EncoderDecoderCache`` nests its
        caches deeper than a key walks): a plan can run eagerly around such an object, as
        around a ``DynamicCache``, where the call would otherwise run eagerly as a whole.
        Whether one was."""
        found = False
        values = [v for i, v in enumerate(args) if i not in self.static_positions]
        values += [v for k, v in kwargs.items() if k not in self.static_names]
        for v in values:
            if not is_static_state(v):
                continue
            try:
                state_key(v)
            except StateUnkeyable as e:
                demote(v, f"cannot be keyed as static state (it {e})")
                found = found or demoted(v) is not None  # (not without a weak reference)
        return found

    def _storming(self, key) -> str | None:
        """Before a new signature's first call: why it runs eagerly instead, where the last
        graphs captured were never replayed (each call a new signature), else None. (Not for
        callables sharing one cache: their replays count on the callable that replays.)"""
        if self._capture_mark is not None:
            self._fruitless = self._fruitless + 1 if self.replays == self._capture_mark else 0
            self._capture_mark = None
        if self._fruitless < _fruitless_limit(self.policy) or self.policy.shared:
            return None
        seen = self._storm_keys
        if (seen and self.replays != self._storm_mark) or key in seen \
                or len(seen) >= _STORM_CALLS:
            # (over: a graph replays again, a signature came back, or tried again after as
            # many distinct ones)
            seen.clear()
            self._fruitless = 0
            return None
        seen.add(key)
        self._storm_mark = self.replays
        return (f"a new signature on every call: the last {self._fruitless} graphs captured "
                "were never replayed (a shape, or a cache's memory, that changes every call: "
                "beam search's reorder_cache); new signatures run eagerly, until one comes "
                f"back, a graph replays again or {_STORM_CALLS} of them have (the graphs made go "
                "on replaying)")

    def _first_sight(self, key) -> bool:
        """Whether ``key`` is seen for the first time (else it is forgotten: captured now)."""
        seen = self._seen_once
        if key in seen:
            del seen[key]
            return False
        seen[key] = None
        if len(seen) > _SEEN_ONCE:
            seen.popitem(last=False)
        return True

    def expect_captures(self) -> None:
        """New signatures in a row are expected (``capture_sizes``): none counts as a capture
        that was never replayed."""
        self._capture_mark = None
        self._fruitless = 0
        self._storm_keys.clear()

    def _set_up(self, entry: SetUpEntry, leaves: list) -> bool:
        """Set the call's static states up as the entry's first call left its own; False (and
        the entry's set-ups dropped) where one does not come out the same."""
        if not entry.set_ups:
            return False
        for i, set_up in entry.set_ups:
            if not set_up.apply(leaves[i]):
                entry.set_ups = []
                return False
        self.set_ups += 1
        return True

    def _training_refused(self) -> str | None:
        """Why grad-mode calls run eagerly (a backward cannot follow), or None."""
        if self._train_eager:
            return self._train_eager
        if reshards_after_forward(self.statics.root) or \
                self._parent_reshards(self.statics.modules):
            return RESHARDS
        return None

    def _replay(self, backend, region, entry, leaves: list, fn, args, kwargs) -> Any:
        if entry.handed and entry.handed_moved():
            return self._eager("an output handed out without a copy (copy_outputs=False, or "
                               "chained in a region or piecewise plan) was resized in place (an "
                               "out= of another size, resize_): the graph's own memory moved "
                               "with it; clone outputs you resize",
                               fn, args, kwargs)
        if entry.written_statics and any(storage_of(leaves[i]) in entry.written_statics
                                         for i in entry.copied_indices()):
            return self._eager("an argument shares memory with a parameter or buffer the "
                               "forward writes: a graph would read a copy made before the "
                               "write", fn, args, kwargs)
        if entry.state_storages and any(storage_of(leaves[i]) in entry.state_storages
                                        for i in entry.copied_indices()):
            return self._eager(STATE_ALIAS, fn, args, kwargs)
        if entry.held_storages and any(storage_of(leaves[i]) in entry.held_storages
                                       for i in entry.copied_indices()):
            return self._eager(HELD_ALIAS, fn, args, kwargs)
        if entry.mutated:
            if inputs_alias(leaves):
                return self._eager("inputs share memory and forward writes to them", fn, args,
                                   kwargs)
            if entry.read_statics and any(
                    storage_of(leaves[i]) in entry.read_statics
                    for i in set(entry.mutated).intersection(entry.copied_indices())):
                return self._eager(WRITTEN_ALIAS, fn, args, kwargs)
            if entry.hazard and any(storage_of(leaves[i]) in entry.hazard
                                    for i in entry.mutated):
                return self._eager("an output of this graph (copy_outputs=False) is passed back "
                                   "as an input the forward writes: the copy-back would "
                                   "overwrite the new output", fn, args, kwargs)
        training = type(entry) is TrainingGraph
        if training and entry.pending():  # (a fresh graph's own first replay: see _call)
            return self._eager(PENDING, fn, args, kwargs)
        counters = entry.counters
        if counters is not None and counters.stale():
            # (the statics were rescanned: a parameter or buffer rebound to another tensor
            # object on the same memory moves, and is checked, through that object)
            why = counters.resolve()
            if why is not None:
                drain(entry.device, self._stream_holder(region)._stream_token)
                (region.cache_for(self) if region is not None else self.cache).discard(entry)
                return self._eager(why, fn, args, kwargs)
        if training and entry.grads_held(self.statics.grad_params()):
            return self._eager("a gradient this graph handed out as .grad is still referenced "
                               "through another tensor (a view of .grad kept from an earlier "
                               "step); clone gradients you keep", fn, args, kwargs)
        device = entry.device
        holder = self._stream_holder(region)
        token = backend.stream_token(device)
        if token != holder._stream_token:
            last = holder._stream_token
            if _region.captured_among(backend, device, region.other_streams(token)
                                      if last == MULTI_STREAM else (last,) if last else ()):
                return self._eager(CAPTURED_ELSEWHERE, fn, args, kwargs)
            if last == MULTI_STREAM:
                # (a callable's own region, run by threads on streams of their own)
                region.order_before_replay(backend, device, token)
            else:
                if last is not None:
                    # Another stream replayed last: its copies may still be in flight (and the
                    # outputs protect_before copies below may not be written yet).
                    backend.order_after(device, last)
                holder._stream_token = token
        if not training and entry.seq is not None and not region.protect_before(entry, leaves):
            # (blocked on calls of this graph on one thread, each within _BLOCKED_GAP uses of
            # the last: a callable called a few times per step with one signature, T5's
            # decoder.dropout, replays on some calls and is blocked on another; another
            # thread's blocked call or more uses between start the count again; an alias that
            # another thread holds blocks it for a while, not call after call: see Slot.protect)
            me = threading.get_ident()
            if region.held_elsewhere:
                entry.blocked = (0, entry.uses, me)
                return self._eager(HELD_BY_ANOTHER_THREAD, fn, args, kwargs)
            count, last, thread = entry.blocked
            count = count + 1 if thread == me and entry.uses - last <= _BLOCKED_GAP else 1
            entry.blocked = (count, entry.uses, me)
            if entry.replayed >= _RECAPTURE_WORKED:
                entry.row = 0  # (this graph served: its signature's row starts again)
            if region.blocked_by > entry.seq and count >= _BLOCKED_CALLS \
                    and entry.row < _MAX_RECAPTURES:
                # What blocks it, call after call with a few replays of it at most between (not
                # another thread's output held for a while), is the output of a graph captured
                # after it, held through a view (as a piece of an opaque piece's own plan is
                # captured a call after the outer pieces, whose inputs it makes): that graph's
                # memory may lie in this one's freed temporaries. Captured again by the next
                # call, it comes after.
                self._recaptures += 1
                cache = region.cache_for(self)
                rows = self._recapture_rows
                try:
                    key = cache.key_of(entry)
                except KeyError:  # (not in this cache: released meanwhile)
                    key = None
                if key is not None:
                    if len(rows) >= 64 and key not in rows:
                        rows.clear()  # (signatures not seen again since)
                    rows[key] = entry.row + 1  # (the next graph of the key takes it on)
                drain(device, token)  # (its buffers go back to the allocator)
                cache.discard(entry)
            return self._eager("an output of an earlier call in this graph_region is still "
                               "referenced through a view; running eagerly so it is not "
                               "overwritten (clone outputs you keep)", fn, args, kwargs)
        trial = entry.trial
        if trial is not None:
            if trial.eager_next():
                self.timed_calls += 1
                out = trial.timed(lambda: fn(*args, **kwargs), True)
            else:
                out = self._timed_replay(trial, backend, region, entry, leaves, fn, args,
                                         kwargs, token)
            return self._judge(entry, out, region)
        self.replays += 1
        entry.replayed += 1
        if region is not None:
            region.replays += 1
        self._note(True)
        if training:
            return entry.run(leaves, self.statics.grad_params(), self)
        out = entry.run(leaves)
        self._fast = Fast.make(self, entry, region, backend, args, kwargs, token)
        return out

    def _timed_replay(self, trial, backend, region, entry, leaves: list, fn, args: tuple,
                      kwargs: dict, token) -> Any:
        """A timed replay of a piece's graph (see _trial) as the calls after the trial would
        replay it: through the fast path, its checks included (they cost a one-kernel piece
        what its graph saves), where this call can have one."""
        fast = trial.fast  # (one for all its turns: what a first fast call pays once, too)
        training = type(entry) is TrainingGraph  # (its forward only: no fast path for it)
        if not training and (fast is None or fast.region is not region
                             or fast.entry is not entry):
            fast = trial.fast = Fast.make(self, entry, region, backend, args, kwargs, token)
        if fast is not None:
            self._fast = fast  # (for this call only: the trial's next call decides afresh)
            try:
                out = trial.timed(lambda: fast.call(fn, args, kwargs), False)
            finally:
                self._fast = None
            if out is not MISS:  # (counted by the fast path)
                return out
            trial.untime(False)
            trial.fast = None
        self.replays += 1
        if region is not None:
            region.replays += 1
        self._note(True)
        if training:
            # (no fast path for it: its calls pay this path's decision too, which its turns
            # count, from ``slow`` on, as an inference graph's count its fast path's checks)
            since, self._slow_at = self._slow_at, None
            before = max(0.0, trial.host() - since[1]) \
                if since is not None and since[0] == threading.get_ident() else 0.0
            out = trial.timed(lambda: entry.run(leaves, self.statics.grad_params(), self),
                              False)
            trial.graph[-1] += before
            trial.graph_host[-1] += before
            return out
        return trial.timed(lambda: entry.run(leaves), False)

    def _last_move(self, moved: str | None) -> str:
        if moved is not None:
            self._moved_why = moved
        return self._moved_why

    def _stream_holder(self, region):
        """Who records the stream that replayed last: the region, the share_graph group (its
        layers use one set of buffers), or this callable."""
        if region is not None:
            return region
        return self.share.group if self.share is not None else self

    def _eager(self, reason: str, fn: Callable, args: tuple, kwargs: dict,
               warn: bool = True, chained: bool = False, entry=None) -> Any:
        """Count and warn (once per reason), then run ``fn`` eagerly (``chained``: with its
        pieces chained, or its segments graphed, see :meth:`chained`)."""
        self.eager_calls[reason] += 1
        self._note(False, reason)
        if warn:
            warn_once(self._warned, self.name, reason)
        return self.chained(fn, args, kwargs, entry) if chained else fn(*args, **kwargs)

    def _note(self, graphed: bool, reason: str | None = None, final: bool = False) -> None:
        """Note a call's outcome for capture_sizes (see sizes_log), where it runs (``final``:
        an eager outcome remembered for the signature: the next calls run eagerly too, a
        piecewise plan's with its pieces graphed)."""
        log = sizes_log.get()
        if log is not None:
            log.append((self, graphed, reason, final))

    # -- recording a first call's outcome -----------------------------------------------------

    def _record(self, outcome: Outcome, backend, region, cache: GraphCache, key, leaves: list,
                fn, args, kwargs, timed: bool = True) -> Any:
        kind = outcome.kind
        if kind != GRAPHED and self._pools and region is None and not self.cache.graphs(self):
            self._pools.clear()  # a failed capture's memory goes with its pool
        if kind == GRAPHED:
            return self._record_graph(outcome, backend, region, cache, key, leaves, fn, args,
                                      kwargs, timed)
        if kind == EAGER and not outcome.remember:
            return self._eager(outcome.reason, lambda: outcome.result, (), {})
        if kind == DEFERRED and (outcome.quiet or self._deferred < _MAX_DEFERRED):
            # (an expected deferral, a set-up, is bounded per signature by FirstCall: it does
            # not spend the budget of transient failures)
            self._deferred += not outcome.quiet
            self.eager_calls[outcome.reason] += 1
            self._note(False, outcome.reason)
            if not outcome.quiet:
                warn_once(self._warned, self.name, outcome.reason)
            return outcome.result
        if kind == DEFERRED:
            outcome = Outcome(EAGER, outcome.result, reason=outcome.reason.replace(
                "capture deferred (retried on a later call)", "capture failed repeatedly"),
                guard=outcome.guard, flags=outcome.flags)
        if kind == PIECEWISE:
            reason, pieces = plan(self.statics.root, outcome.findings, outcome.ran)
            if pieces or self.options.segments or _segrun.ENABLED:
                if self.install_pieces and pieces:
                    self._add_pieces(self.install_pieces(pieces))
                self.last_plan = (outcome.findings, pieces)
                entry = PiecewiseEntry(reason, self, outcome.findings, pieces, outcome.guard,
                                       outcome.flags)
            else:
                entry = EagerEntry(reason, self, outcome.guard, outcome.flags)
        else:
            reason = outcome.reason
            set_ups = [(i, SetUp.read(leaves[i])) for i in outcome.set_up]
            if set_ups and all(s is not None for _, s in set_ups):
                entry = SetUpEntry(reason, self, outcome.guard, outcome.flags, set_ups)
            else:
                entry = EagerEntry(reason, self, outcome.guard, outcome.flags)
        cache.put(key, entry)
        self.eager_calls[reason] += 1
        self._note(False, reason, final=type(entry) is not SetUpEntry)
        warn_once(self._warned, self.name, reason)
        return outcome.result

    def _record_graph(self, outcome: Outcome, backend, region, cache, key, leaves, fn, args,
                      kwargs, timed: bool = True) -> Any:
        entry = outcome.entry
        entry.owner = self
        entry.state = outcome.guard
        entry.flags = outcome.flags
        rows = self._recapture_rows
        if rows and key in rows:
            entry.row = rows.pop(key)
        if outcome.shared:
            self.retargets += 1
        else:
            self.captures += 1
        self._note(True)
        self.capture_seconds += entry.capture_seconds
        if region is not None:
            region.record_capture(entry)
        clock = getattr(backend, "clock", None)
        # (not a second training graph of a signature in flight: its twin's verdict, to keep
        # it, was given before it was made, see _another_in_flight)
        if timed and self.options.piece and clock is not None \
                and (region is None or region.implicit) \
                and self.share is None and type(entry) in (CapturedGraph, TrainingGraph):
            # (a training graph's forward is timed: what its backward graph saves is not
            # counted, so a piece kept is faster than eager in its forward at least)
            entry.trial = Trial(clock(entry.device))  # (see _trial)
        evicted = cache.put(key, entry)
        if evicted and region is None:
            # the pool holds the evicted graphs' memory until its last graph is gone: later
            # captures go to a new pool, so that eviction gives memory back
            self._pools.clear()
        for obj in outcome.states if hasattr(entry, "on_release") else ():
            if pooled(obj):
                continue  # (the next state set up is given its memory: it replays this graph)
            # keyed by the addresses its tensors had: once it dies the graph is dead weight
            ref = weakref.ref(entry)
            died = self._state_died
            entry.on_release.append(_keep_until_release(
                weakref.ref(obj, lambda _r, c=cache, e=ref: died.append((c, e)))))
        self._retired_copies += sum(e.input_copies for e in evicted)
        if evicted:
            warn_once(self._warned, self.name,
                      f"more distinct signatures than max_graphs={self.policy.max_graphs}; "
                      "least recently used graphs are released and re-captured when needed",
                      what="evicts graphs")
        if outcome.replay:
            # In a chaining region the first call returns the graph's own (aliased) outputs, so
            # the next graphed call is captured reading them in place. Nothing was written, so
            # replaying once more has no effect beyond its outputs (none is made where it reads
            # tensors from outside: see verify). A family's rebased graph
            # was not captured (no device synchronisation): it shares the template's memory,
            # so the replay orders after the stream that replayed last (in _replay).
            return self._replay(backend, region, entry, leaves, fn, args, kwargs)
        holder = self._stream_holder(region)
        if holder._stream_token != MULTI_STREAM:
            holder._stream_token = backend.stream_token(entry.device)
        return outcome.result

    def _ineligible(self, backend, leaves: list, cache: GraphCache) -> str | None:
        """Why no graph can be made for these leaves at all (before any warm-up), or None;
        sets the device and the device types whose work graphs capture."""
        devices = {leaf.device for leaf in leaves if isinstance(leaf, _Tensor)}
        devices |= self.statics.devices()
        if not devices:
            return "no tensors to graph (no tensor arguments, parameters or buffers)"
        if len(devices) > 1:
            return f"tensors on several devices: {sorted(map(str, devices))}"
        (device,) = devices
        if not backend.supports(device):
            if device.type == "cuda":
                return "CUDA is not available"
            return f"tensors are on {device}, not on a CUDA device"
        if cache.eviction_budget_spent():
            return (f"more than {self.policy.max_evictions} evictions: too many distinct "
                    f"signatures for max_graphs={self.policy.max_graphs}; raise max_graphs or "
                    "make the shapes static (pad)")
        self._device = device
        self.accel = frozenset({device.type})
        return None

    # -- upkeep ----------------------------------------------------------------------------

    def invalidate(self, why: str) -> None:
        """Drop every graph (they read memory that is no longer the module's)."""
        self.invalidations += 1
        self._parent_reshards.forget()  # the statics were re-read: its modules may differ
        self.segments.release()
        self.release()
        for region in _region.all_open():
            region.forget(self)

    def release(self, keep: Callable[[Any], bool] | None = None) -> None:
        """Release every graph of this callable's own cache (but those ``keep`` names, and
        then its eager decisions stay too), once the work queued on the stream that replayed
        last is done (its memory may be handed to another stream at once)."""
        self._fast = self._alt = None
        self.rehearsed = None
        graphs = self.cache.graphs(self)
        gone = graphs if keep is None else [g for g in graphs if not keep(g)]
        if gone:
            drain(gone[0].device, self._stream_holder(None)._stream_token)
        self._retired_copies += sum(g.input_copies for g in gone)
        if keep is None:
            self.cache.clear(owner=self)
        else:
            for g in gone:
                self.cache.discard(g)
        if len(gone) == len(graphs):
            self.families.release()  # after the graphs made from the templates
            self._pools.clear()  # (a pool lives while a graph captured into it does)

    def close_chain(self) -> None:
        """Release the implicit region the pieces chain in (``ungraphify``). (An invalidation
        leaves it open: each piece forgets its own graphs in it when its statics move.)"""
        self.segments.release()
        chain, self._chain = self._chain, None
        if chain is not None:
            chain.close()

    def pool(self, backend, device: torch.device):
        """The memory pool shared by this callable's own inference graphs on ``device`` that
        copy their outputs out (see FirstCall._capture_inference)."""
        idx = device.index or 0
        pool = self._pools.get(idx)
        if pool is None or getattr(pool, "retired", False):  # (see _capture.Pool)
            pool = self._pools[idx] = backend.new_pool(device)
        return pool

    def all_graphs(self) -> list:
        """This callable's graphs: its own cache's and those chained in implicit regions (see
        :meth:`chained`; a ``graph_region``'s are the region's)."""
        return [g for _, g in self._graph_items()]

    def _graph_items(self) -> list:
        """(key, graph) of :meth:`all_graphs`."""
        caches = [self.cache] + [c for region in _region.all_open() if region.implicit
                                 for c in region.cache_of(self)]
        return [(k, e) for c in caches for k, e in c.items(self) if not isinstance(e, EagerEntry)]

    def stats(self) -> Stats:
        graphs = self.all_graphs()
        segments, segment_replays = self.segments.counts()
        return Stats(
            captures=self.captures,
            replays=self.replays,
            eager_calls=dict(self.eager_calls),
            capture_seconds=self.capture_seconds,
            warmup_seconds=self.warmup_seconds,
            graph_pool_bytes=sum(g.pool_bytes for g in graphs),
            graphs=len(graphs),
            evictions=self.cache.evictions,
            invalidations=self.invalidations,
            input_copies=self._retired_copies + sum(g.input_copies for g in graphs),
            retargets=self.retargets,
            set_ups=self.set_ups,
            timed_calls=self.timed_calls,
            seen_once=self.seen_once,
            segments=segments,
            segment_replays=segment_replays,
            reasons=self.families.reasons(),
            template_pool_bytes=self.families.pool_bytes(),
        )

    def decisions(self) -> list[tuple[Any, str]]:
        """(key, 'graphed' | 'eager: reason') for each cached signature."""
        return [(k, "graphed" if isinstance(e, (CapturedGraph, TrainingGraph))
                 else f"eager: {e.reason}") for k, e in self.cache.items(self)]


def _refuse_tracers(args: tuple, kwargs: dict) -> None:
    """A clear error where a tracer calls a graphified module with its proxies for tensors
    (``thunder.jit`` over a model with graphified parts): running forward on them eagerly
    fails deep inside, and graphs could not be traced anyway."""
    if any(type(x).__module__.startswith("thunder.") for x in (*args, *kwargs.values())):
        raise CudagraphifyUsageError(
            "thunder.jit is tracing a graphified module (its tensors are Thunder proxies): "
            "graphify the thunder.jit'd model instead (graphify(thunder.jit(model))), or "
            "ungraphify its parts before thunder.jit")


def _no_state() -> None:
    return None
