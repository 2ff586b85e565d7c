"""The per-call fast paths: the previous call's decision, re-checked in a few C calls.

:class:`Fast` replays the graph the previous call replayed, when every guard of it holds
(argument layouts in C, global state, parameter addresses and buffer layouts, the module-state
epoch, the stream, a region's slots). :class:`EagerFast` runs eagerly a call the previous
call's decision covers (an opaque argument of the same type; a remembered eager or piecewise
signature with the same tensor layouts and the same other arguments). Anything else answers
:data:`MISS`, and the engine's full path decides the call afresh.
"""

from __future__ import annotations

import functools
import itertools
import operator
import sys
import threading
import weakref
from typing import Any, Callable

import torch
import torch.autograd.forward_ad as _forward_ad

from . import _guards, _region, _segrun, _statics, _trial, _watch
from ._nested import bypassing, nesting, sizes_log
from ._pieces import STATE
from ._training import settled as _settled
from ._signature import PLAIN_TYPES, is_constant, is_opaque, is_static_state, repeated, \
    storage_of, strict_key
from ._state import StateUnkeyable, may_be_static_state, state_key

__all__ = ["Bypass", "Fast", "EagerFast", "MISS"]

MISS = object()  # a fast path's answer: not for this call, take the full path
_MISS = MISS
_stack_get = _region.stack_var().get
# torch.compile's frame callback, set while it converts the Python frames called (None while
# it does not): the replay path kept aside (GraphedState.other_fast) is taken only while it is
# None (converting that path's frames failed at a graph break inside a try block: torch 2.13,
# Python 3.11, tests/test_review_data_alias.py's module.compile() case)
try:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as converting
except ImportError:  # pragma: no cover - a torch without it
    def converting() -> None:
        return None
_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter
_TensorGuards = torch._C._dynamo.guards.TensorGuards
_Slot, _use_count = _region.Slot, torch._C._storage_Use_Count
_refcount = sys.getrefcount
_saved_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_weakref = weakref.ref
_get_ident = threading.get_ident
_sizes_log = sizes_log.get
_grad_enabled = torch.is_grad_enabled
# eager decisions made (EagerFast.decided, .pending), any state: a root looks at its pieces
# again (Bypass.scan) only after one was made
decided_made = [0]


def _none(values: tuple) -> tuple:
    return ()


def _attributed(tensors) -> tuple[bool, ...] | None:
    """Which of a call's tensors carry Python attributes (part of the key:
    _signature.leaf_kind), or None where none does (nearly every call)."""
    flags = tuple(bool(t.__dict__) for t in tensors)
    return flags if any(flags) else None


class EagerFast:
    """The previous call's decision to run eagerly, for calls that would decide the same.

    - ``opaque``: a top-level argument of a type the signature cannot hold; a call with the
      same argument names, and that type in that place, runs eagerly without more ado.
    - ``decided``: a remembered decision (an eager or piecewise entry) for calls whose tensor
      arguments have the same layouts (checked in C), whose other top-level arguments are the
      same objects, while the entry's module state and the statics hold.
    - ``pending``: as ``decided``, for grad-mode calls of a training graph whose earlier
      call's backward has not run (its activations would be overwritten: a forward under grad
      mode whose output is kept, with no backward), while that stays so and grad mode is on.

    Running eagerly is always correct; these checks only make sure that a call that could be
    graphed is not kept from its graph (a change of global flags alone is not looked for: it
    turns no eager decision into a graph)."""

    __slots__ = ("state", "region", "reason", "n", "names", "types", "tensors", "tguard",
                 "others", "entry", "statics_same", "chained", "still", "flags", "flags_epoch",
                 "grads", "pick", "one", "bypass", "scanned", "grad_mode", "lone", "dicts")

    @staticmethod
    def opaque(state, region, reason: str, args: tuple,
               kwargs: dict) -> "EagerFast | None":
        if state.options.enabled is not True:
            return None
        self = EagerFast._new(state, region, reason, args, kwargs)
        values = (*args, *kwargs.values())
        # (an object of a type whose instances may be static state, an HF Cache, is checked
        # again: a cache with a growing layer and a static one can be of the same class)
        self.types = [(i, type(v), may_be_static_state(type(v))) for i, v in enumerate(values)
                      if is_opaque(type(v)) and not is_static_state(v)]
        self.entry = state.segments.opaque  # (what its segments are kept under)
        return self

    @staticmethod
    def pending(state, region, entry, reason: str, args: tuple, kwargs: dict,
                others: list = ()) -> "EagerFast | None":
        if entry.flags is None or state.static_positions or state.static_names:
            return None  # (static arguments are keyed by address: decide each call)
        self = EagerFast.decided(state, region, entry, args, kwargs, reason)
        if self is None or not all(is_constant(v) for _, v in self.others):
            return None  # (objects held by identity would be kept alive: decide each call)
        # another signature of these tensors (other flags, another set of parameters that
        # require grad) may have a graph that is not pending: checked on every call too
        # (and the signature's other training graphs: each waits for its backward)
        self.still = entry.pending if not others else \
            (lambda graphs=(entry, *others): all(g.pending() for g in graphs))
        self.flags, self.flags_epoch = entry.flags, entry.flags.epoch
        self.grads = state.statics.grad_pattern()
        self.chained = False
        return self

    @staticmethod
    def decided(state, region, entry, args: tuple, kwargs: dict,
                reason: str | None = None) -> "EagerFast | None":
        if state.options.enabled is not True:
            return None
        self = EagerFast._new(state, region, entry.reason if reason is None else reason, args,
                              kwargs)
        values = (*args, *kwargs.values())
        self.tensors = [i for i, v in enumerate(values) if type(v) is _Tensor
                        or type(v) is _Parameter]
        if len(self.tensors) != sum(isinstance(v, _Tensor) for v in values):
            return None  # a tensor subclass: decide again
        ts = [values[i] for i in self.tensors]
        if len(ts) > 1 and repeated(ts):
            # (its guard cannot tell such a call from one of distinct tensors, another key
            # that may be graphed: see _signature.repeated)
            return None
        self.tguard = _TensorGuards(*ts, dynamic_dims_sizes=[list(t.shape) for t in ts],
                                    dynamic_dims_strides=[list(t.stride()) for t in ts])
        # a decision made for tensors that carry Python attributes (another key: see
        # _signature.leaf_kind) takes only calls whose tensors carry them where these did
        # (the C guard checks the class); one made for plain tensors runs an attributed call
        # eagerly too, which is always correct
        self.dicts = _attributed(ts)
        self.others = [(i, v) for i, v in enumerate(values) if i not in set(self.tensors)]
        # the call's tensors, as the guard takes them: a tuple (one frame less than a list
        # comprehension), or the one tensor
        self.pick = operator.itemgetter(*self.tensors) if self.tensors else _none
        self.one = len(self.tensors) == 1
        # one positional tensor and nothing else: ``fits`` is its guard's check of that tensor
        # (a marked piece's DirectCall asks it so, one call less)
        self.lone = self.tguard.check if self.one and self.n == 1 and not self.names \
            and not self.others and self.dicts is None else None
        if any(is_static_state(v) for _, v in self.others):
            return None  # keyed by what it holds, never held (see _state): decide again
        self.entry = entry
        self.grad_mode = _grad_enabled()
        self.statics_same = state.statics.same
        self.chained = getattr(entry, "pieces", None) is not None  # a piecewise entry
        decided_made[0] += 1
        return self

    @staticmethod
    def _new(state, region, reason, args, kwargs) -> "EagerFast":
        self = EagerFast()
        self.state, self.region, self.reason = state, region, reason
        self.n, self.names = len(args), tuple(kwargs)
        self.types, self.tensors, self.tguard, self.others, self.entry = (), (), None, (), None
        self.pick, self.one, self.lone, self.dicts = _none, False, None, None
        self.chained = True  # (an opaque call's: see PieceRuns.chained)
        self.still = self.flags = self.grads = None
        self.flags_epoch = -1
        self.bypass, self.scanned = None, -1
        return self

    def holds(self) -> bool:
        """Whether this keyed decision would still be taken now, its arguments aside (a
        :class:`Bypass` marks it only then: one made under other flags, or before a move of its
        statics, must not be armed by another piece's decision)."""
        state = self.entry.state
        if _grad_enabled() is not self.grad_mode or (state is not None and not state.valid()) \
                or not self.statics_same():
            return False
        return self.still is None or self._still_pending()

    def _still_pending(self) -> bool:
        """A pending decision's call: the same global state (grad mode on among it), the same
        flags, the same parameters requiring grad, and the backward still pending."""
        flags = self.flags
        if not flags.global_state.check():
            return False
        now = flags.flags_since(self.flags_epoch)
        if now is None:
            return False
        self.flags_epoch = now
        return self.state.statics.grad_pattern() == self.grads and self.still()

    def call(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        stack = _stack_get()
        region = self.region
        if len(args) != self.n or (stack[-1] if stack else None) is not region or nesting[0] \
                or (region is not None and region.closed):
            return _MISS  # (inside another graph's warm-up or capture: part of it, uncounted)
        if kwargs:
            if tuple(kwargs) != self.names:
                return _MISS
            values = (*args, *kwargs.values())
        elif self.names:
            return _MISS
        else:
            values = args
        if self.types:
            for i, tp, maybe in self.types:
                if type(values[i]) is not tp or maybe and is_static_state(values[i]):
                    return _MISS
        else:
            for i, v in self.others:
                if values[i] is not v:
                    return _MISS
            if not (self.tguard.check(self.pick(values)) if self.one
                    else self.tguard.check(*self.pick(values))) \
                    or _grad_enabled() is not self.grad_mode \
                    or (self.dicts is not None and not self._same_dicts(values)):
                return _MISS
            # (global flags are not checked: they change no eager decision, but where the
            # decision is a pending backward's, another signature's graph may replay; grad
            # mode is: a training signature run eagerly, its no_grad one may have a graph)
            state = self.entry.state
            if (state is not None and not state.valid()) or not self.statics_same():
                return _MISS
            still = self.still
            if still is not None and not self._still_pending():
                return _MISS
        state = self.state
        state.eager_calls[self.reason] += 1
        if _sizes_log() is not None:  # (capture_sizes runs on this thread: each piece notes)
            state._note(False, self.reason, final=True)
        elif self.chained and state.pieces and not self.types and _grad_enabled():
            # (a keyed decision only: its tensors and statics were checked above; an opaque
            # argument's decision checks types alone)
            if self.scanned != decided_made[0]:  # (a piece's decision may be a new eager one)
                self.scanned = decided_made[0]
                if self.bypass is not None:
                    self.bypass.drop()
                self.bypass = Bypass.scan(state)
            bypass = self.bypass
            if bypass is not None and not bypass.valid():
                bypass.drop()  # (a piece decided afresh, or what they check changed)
                bypass = self.bypass = Bypass.scan(state)
            if bypass is not None:
                outer = bypassing.token
                bypassing.token = bypass
                try:
                    return self._run(state, fn, args, kwargs)
                finally:
                    bypassing.token = outer
        return self._run(state, fn, args, kwargs)

    def fits(self, args: tuple, kwargs: dict) -> bool:
        """Whether a call has this decision's arguments: the same names, the same other
        objects, its tensors' layouts (for a piece a :class:`Bypass` marked: its root's call
        fixes none of them where the data does, a row count from ``.item()``)."""
        if len(args) != self.n:
            return False
        if kwargs:
            if tuple(kwargs) != self.names:
                return False
            values = (*args, *kwargs.values())
        elif self.names:
            return False
        else:
            values = args
        for i, v in self.others:
            if values[i] is not v:
                return False
        if self.dicts is not None and not self._same_dicts(values):
            return False
        return self.tguard.check(self.pick(values)) if self.one \
            else self.tguard.check(*self.pick(values))

    def _same_dicts(self, values: tuple) -> bool:
        """Whether the call's tensors carry Python attributes where the decision's did."""
        for i, had in zip(self.tensors, self.dicts):
            if (not values[i].__dict__) is had:
                return False
        return True

    def _run(self, state, fn: Callable, args: tuple, kwargs: dict) -> Any:
        # (``chained``'s answer where segments are off and no piece of its plans may replay:
        # the plain forward, without its frames)
        if self.chained and (state.options.segments or _segrun.ENABLED
                             or (state.pieces and state._chain_needed())):
            return state.chained(fn, args, kwargs, self.entry)
        return fn(*args, **kwargs)


class Bypass:
    """A piecewise root's grad-mode calls while pieces of it are decided eager: the pieces
    whose decision is :meth:`EagerFast.pending` (a forward under grad mode whose output is kept
    with no backward: a training graph's activations would be overwritten) or an eager
    signature of their own (:meth:`EagerFast.decided`: a training signature whose graph did not
    pay, a dropout in eval mode returning its input) run their plain forward straight from their
    ``DirectCall`` (see _wrap), past their own checks (their tensors' layouts, module state,
    statics, flags, grads: 12-13 µs a piece on this project's CPU machine, as much as a small
    piece's forward).

    Armed on the root's thread for one call of the root's eager fast path
    (:attr:`bypassing`), while no pending call may have settled (``_training.settled``) and
    nothing those checks look at changed since it was made: the global state (grad mode among
    it), the flags, the pieces given back, module writes (``_watch``), which parameters require
    grad; a piece is bypassed only while its decision is the one marked. The root's own fast
    path has checked its tensors, other arguments and statics. A plain forward is always
    correct: all this decides is that no piece could replay a graph instead (a call that could
    is then decided by its own path). Pieces that are roots of their own pieces, or decided
    around an opaque argument, are not marked."""

    __slots__ = ("marked", "global_state", "flags_epoch", "pieces_epoch", "watch_epoch",
                 "settled", "statics", "grads")

    @staticmethod
    def scan(state) -> "Bypass | None":
        """The root ``state``'s pieces whose decision now is an eager one (None: none)."""
        marked = []
        settled = _settled[0]  # (before the pieces are asked: a settle meanwhile moves it)
        for m in state.pieces:
            st = m.__dict__.get(STATE)
            fast = getattr(st, "_fast", None)
            if type(fast) is EagerFast and not fast.chained and not fast.types \
                    and fast.holds():
                marked.append((st, fast))
        if not marked:
            return None
        self = Bypass()
        self.marked = tuple(marked)
        self.global_state = torch._C._dynamo.guards.GlobalStateGuard()
        self.flags_epoch, self.pieces_epoch = _guards.flags_epoch, _trial.pieces_epoch[0]
        self.watch_epoch = _watch.epoch
        self.settled = settled
        self.statics = state.statics
        self.grads = state.statics.grad_pattern()
        for st, fast in marked:
            st._bypass = (self, fast)
        return self

    def valid(self) -> bool:
        # (a marked piece whose decision was replaced is not bypassed: its DirectCall asks
        # whether the decision is the one marked; a new eager decision anywhere makes its root
        # scan again, see EagerFast.call; a pending one stays pending until a training graph's
        # backward runs or its autograd graph dies, which moves ``settled``)
        return self.global_state.check() and _guards.flags_epoch == self.flags_epoch \
            and _trial.pieces_epoch[0] == self.pieces_epoch \
            and _watch.epoch == self.watch_epoch and _settled[0] == self.settled \
            and self.statics.grad_pattern() == self.grads

    def drop(self) -> None:
        """No longer valid: the pieces let go of it (nothing here is kept alive by them)."""
        for st, _ in self.marked:
            if st._bypass is not None and st._bypass[0] is self:
                st._bypass = None
        self.marked = ()


def _mixed(leaves: tuple) -> tuple | None:
    """For a call whose top-level arguments are tensors, immutable values (``None``, flags,
    ints) and static state (an HF StaticCache): (tensor positions, (position, value) of the
    values, (position, state key) of the states); None for anything else (a container, an
    opaque object, a tensor subclass: the full path flattens and decides those)."""
    tensors, consts, states = [], [], []
    for i, v in enumerate(leaves):
        if type(v) is _Tensor or type(v) is _Parameter:
            tensors.append(i)
        elif isinstance(v, torch.Tensor) or isinstance(v, (tuple, list, dict)):
            return None
        elif is_static_state(v):
            try:
                states.append((i, state_key(v)))
            except StateUnkeyable:
                return None
        elif is_constant(v):
            # (a value whose ``==`` is not what an op sees, a float, a frozen dataclass: by its
            # strict_key, on every call, the same object too)
            consts.append((i, v, None if type(v) in PLAIN_TYPES else strict_key(v)))
        else:
            return None
    return tensors, consts, states


def _ranges(guard, storages: frozenset) -> tuple | None:
    """(first byte, end) of each of ``storages`` (addresses), from the tensors ``guard``
    holds, or None where it holds none of one: a tensor whose address lies in one shares its
    memory (storages do not overlap; an empty tensor's address lies in none)."""
    spans = {}
    for t in getattr(guard, "tensors", ()):
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            continue
        if ptr in storages:
            spans[ptr] = max(spans.get(ptr, 0), ptr + st.nbytes())
    return tuple(spans.items()) if spans.keys() == storages else None


class Fast:
    """Every check of the entry the previous call replayed, in a few C calls, then its replay.

    Made only for an inference graph of this callable's own, called with tensors (plain tensors
    or parameters; positional, or by keyword in the same order; under grad mode too, where no
    tensor of the call needs grad), with ``enabled=True`` and no moves pending. Any failed
    check (or anything unusual) hands the call to the slow path, which decides it afresh. One
    frame: every µs here is paid by every replay."""

    __slots__ = ("state", "entry", "region", "n", "names", "tguard", "global_state", "flags",
                 "read_flags", "flags_epoch", "device", "get_device", "guard", "statics",
                 "in_capture", "stream", "holder", "inplace", "outer", "lock", "mixed",
                 "state_copied", "outside", "ranges", "slot", "grads", "base", "pairs",
                 "spread", "where", "dicts", "scans")

    @staticmethod
    def make(state, entry, region, backend, args: tuple, kwargs: dict,
             token) -> "Fast | None":
        # (entries that write their inputs or the statics keep to the slow path: it checks
        # that no argument aliases what is written)
        if state.options.enabled is not True or state._moves or entry.owner is not state \
                or entry.flags is None or entry.hazard or entry.mutated or entry.written_statics \
                or entry.grads_read is not None:
            return None
        grads = None
        if torch.is_grad_enabled():  # (an inference graph: no tensor of the call needs grad)
            if state._training_refused() is not None or _saved_hooks(False) is not None:
                return None
            grads = state.statics.grad_pattern()
            if any(grads):  # (an inference graph reads no parameter that requires grad)
                return None
        leaves = (*args, *kwargs.values())  # the order build_signature flattens them in
        if not leaves:
            return None
        mixed = None
        if not all(type(a) is _Tensor or type(a) is _Parameter for a in leaves):
            mixed = _mixed(leaves)  # (keyword calls of HF models: flags, None, a cache)
            if mixed is None:
                return None
        tensors = leaves if mixed is None else [leaves[i] for i in mixed[0]]
        if not tensors or (len(tensors) > 1 and repeated(tensors)):
            return None  # (a call passing one tensor twice keeps to the slow path)
        self = Fast()
        # which tensors carry Python attributes (part of the key: _signature.leaf_kind; a
        # library's, ``nn.Buffer``'s ``persistent``, ``mark_dynamic``'s): None where none does
        self.dicts = _attributed(tensors)
        # the tensors' positions, checked to be distinct objects (part of the key: see
        # _signature.repeated): None for one tensor; pairwise where they are few, else
        # (``pairs`` empty) by a set of their ids
        where = self.where = tuple(range(len(leaves)) if mixed is None else mixed[0])
        self.pairs = None if len(where) < 2 else tuple(itertools.combinations(where, 2)) \
            if len(where) <= 5 else ()
        self.spread = (operator.itemgetter(*where), len(where)) if len(where) > 5 else None
        self.state, self.entry, self.region, self.n = state, entry, region, len(args)
        # under grad mode (its C guard checks that the call's is the same), what the slow path
        # decides on every call too: training not refused, no saved-tensor hooks, and the same
        # parameters requiring grad (one more makes it a training graph's call)
        self.grads = grads
        self.names = tuple(kwargs)
        self.mixed = mixed
        # copied arguments checked not to share the memory of a static state or of a tensor
        # read from outside the arguments, parameters and buffers (see _engine)
        self.outside = entry.state_storages | entry.held_storages
        self.state_copied = entry.copied_indices() if self.outside else ()
        self.ranges = _ranges(entry.state, self.outside) if self.outside else None
        self.tguard = _TensorGuards(*tensors,
                                    dynamic_dims_sizes=[list(a.shape) for a in tensors],
                                    dynamic_dims_strides=[list(a.stride()) for a in tensors])
        # the FlagsGuard's check, unrolled: its C guard and the current device (where several
        # GPUs make it changeable) on every call, the other flags again only after one of
        # their setters ran
        flags = entry.flags
        self.global_state, self.flags, self.read_flags = flags.global_state, flags.flags, \
            flags.read
        self.flags_epoch, self.device, self.get_device = flags.epoch, flags.flags[-1], \
            _guards.device_reader()
        self.guard = entry.state
        self.statics = state.statics
        self.scans = state.statics.scans  # (kept aside, not across a rescan: other_fast)
        self.in_capture = getattr(backend, "in_capture_now", backend.in_capture)
        getter = getattr(backend, "stream_getter", None)
        self.stream = getter(entry.device) if getter is not None else functools.partial(
            backend.stream_token, entry.device)
        self.holder = state._stream_holder(region)
        self.inplace = entry.inplace
        # a region graph's one output, handed out as an alias of its slot, where nothing is
        # read in place from another graph's slot (see ``call``)
        # (a flag: the slot itself is read through the entry on each call, so that a released
        # entry's static output is not kept alive here)
        single = entry._actions[0] if entry._single and region is not None \
            and entry.seq is not None else None
        self.slot = type(getattr(single, "__self__", None)) is _Slot \
            and single.__func__ is _Slot.hand_out
        # the region's lock (None outside a region), then the state's
        self.outer = region.lock if region is not None else None
        self.lock = state.lock
        # (the state's replays when it was made: every replay until the slow path drops it is
        # this entry's; see pending_uses)
        self.base = state.replays
        return self

    def pending_uses(self) -> int:
        """Its entry's replays through this fast path, not yet added to ``entry.uses`` (the
        slow path adds them when it drops it; see GraphCache.thrashing)."""
        return self.state.replays - self.base

    def call(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """The replay, or MISS. The caller has checked that no global module hook is
        registered (a graph holds none of their effects):
        :func:`~._watch.global_hooks_present`."""
        if len(args) != self.n or nesting[0]:
            return _MISS
        if kwargs:
            if tuple(kwargs) != self.names:
                return _MISS
            args = (*args, *kwargs.values())
        elif self.names:
            return _MISS
        stack = _stack_get()  # the regions entered (the innermost is in effect)
        region = self.region
        if (stack[-1] is not region) if stack else (region is not None):
            return _MISS
        # (the locks taken by hand: half the cost of ``with`` for each)
        outer = self.outer
        if outer is not None:
            outer.acquire()
        try:
            lock = self.lock
            lock.acquire()
            try:
                entry, state, get_device = self.entry, self.state, self.get_device
                # (global module hooks: the caller checked there are none, see ``call``)
                if state._fast is not self or entry.raw is None or not (
                        self.tguard.check(*args) if self.mixed is None
                        else self._mixed_ok(args)) or not self.global_state.check() \
                        or (get_device is not None and get_device() != self.device):
                    return _MISS
                if _forward_ad._current_level >= 0:  # (see _guards.dual_level)
                    return _MISS
                # (a tensor that carries Python attributes is another key, its class too: the
                # C guard checks the class; see _signature.leaf_kind)
                dicts = self.dicts
                if dicts is None:
                    for i in self.where:
                        if args[i].__dict__:
                            return _MISS
                else:
                    for i, had in zip(self.where, dicts):
                        if (not args[i].__dict__) is had:
                            return _MISS
                pairs = self.pairs
                if pairs is not None:
                    if pairs:
                        for i, j in pairs:
                            if args[i] is args[j]:
                                return _MISS
                    elif len(set(map(id, self.spread[0](args)))) != self.spread[1]:
                        return _MISS
                copied = self.state_copied
                if copied:  # (see _engine: an argument sharing a state's or held memory)
                    ranges = self.ranges
                    if ranges is not None:  # (an address inside one: half the cost)
                        for i in copied:
                            ptr = args[i].data_ptr()
                            for lo, hi in ranges:
                                if lo <= ptr < hi:
                                    return _MISS
                    else:
                        outside = self.outside
                        for i in copied:
                            if storage_of(args[i]) in outside:
                                return _MISS
                if _guards.flags_epoch != self.flags_epoch:
                    now = _guards.flags_epoch
                    if self.read_flags() != self.flags:
                        return _MISS
                    # (the entry's too: the next fast path made for it starts from here)
                    self.flags_epoch = entry.flags.epoch = now
                # (no stream capture can be under way on the legacy default stream, token 0)
                token = self.stream()
                if token != self.holder._stream_token or (token and self.in_capture()):
                    return _MISS
                guard = self.guard
                if guard is not None and (guard.epoch != _watch.epoch or guard.volatile) \
                        and not guard.valid():
                    return _MISS
                if self.inplace:
                    for i, ptr in self.inplace:
                        if args[i].data_ptr() != ptr:
                            return _MISS
                for t, ptr in entry.handed:  # (``handed_moved()``, inline)
                    if t.data_ptr() != ptr:
                        return _MISS
                # (``statics.same()``'s common case inline, a frame less: a few statics, no
                # buffer, no structural write since the scan)
                statics = self.statics
                pairs = statics._pairs
                if pairs is not None and statics._buffer_guard is None \
                        and statics._generation == _statics._generation:
                    for t, ptr in pairs:
                        if t.data_ptr() != ptr:
                            return _MISS
                elif not statics.same():
                    return _MISS
                grads = self.grads
                if grads is not None and (state._training_refused() is not None
                                          or _saved_hooks(False) is not None
                                          or state.statics.grad_pattern() != grads):
                    return _MISS
                slot = None
                if region is not None:
                    if self.slot:
                        slot = entry._actions[0].__self__
                        # (protect_before's common cases inline: the slot of this graph's
                        # output the only live one, its last alias dropped (it is handed out
                        # again below), or every live slot captured before this graph, as a
                        # chain's earlier pieces' outputs are: no walk over them)
                        live = region._live
                        walk = False
                        if live and not (len(live) == 1 and slot in live
                                         and _use_count(slot.cdata) == slot.baseline
                                         and _refcount(slot.storage) <= slot.refs):
                            walk = region._live_top >= entry.seq
                        if walk:
                            if not region.protect_before(entry, args):
                                return _MISS
                        else:
                            borrowed = entry.borrowed
                            # (then its loop over the slots of other graphs it reads in place,
                            # a chain's earlier piece's output, each passed in or protected:
                            # the common case, no alias of it left, inline)
                            if borrowed:
                                for i, other in borrowed:
                                    if args[i].data_ptr() != other.tensor.data_ptr():
                                        if other.baseline is not None and \
                                                _use_count(other.cdata) == other.baseline \
                                                and _refcount(other.storage) <= other.refs:
                                            other.live.pop(other, None)
                                        elif not other.protect():
                                            return _MISS
                    elif entry.seq is not None and not region.protect_before(entry, args):
                        return _MISS
                    region.replays += 1
                state.replays += 1
                # ``entry.run``, inline (a frame less): copy-in, replay (no copy-back: ``make``
                # takes no entry that writes its inputs), the outputs
                for i, buf, ptr in entry._copy_in:
                    x = args[i]
                    if x.data_ptr() != ptr:
                        buf.copy_(x)
                        entry.input_copies += 1
                entry._replay()
                fresh = entry._fresh
                if fresh is not None:
                    return fresh()
                if slot is None or slot.baseline is None:
                    return entry.outputs(args)
                alias = slot.tensor.data  # (``Slot.hand_out``, inline; one output: lone)
                slot.alias = _weakref(alias)
                slot.thread = _get_ident()
                region._live[slot] = None
                if slot.seq > region._live_top:
                    region._live_top = slot.seq
                return alias
            finally:
                lock.release()
        finally:
            if outer is not None:
                outer.release()

    def _mixed_ok(self, leaves: tuple) -> bool:
        """A call with other leaves than tensors: the same values (floats by their bits), the
        same states' keys (what each holds: see _state), and the tensors' layouts in C."""
        tensor_idx, consts, states = self.mixed
        for i, c, key in consts:
            v = leaves[i]
            if key is None:
                if v is not c and not (type(v) is type(c) and v == c):
                    return False
            elif type(v) is not type(c) or strict_key(v) != key:
                return False
        for i, key in states:
            v = leaves[i]
            if not is_static_state(v):
                return False
            try:
                k = state_key(v)
            except StateUnkeyable:
                return False
            if k is not key and k != key:
                return False
        return self.tguard.check(*[leaves[i] for i in tensor_idx])
