"""``graph_region``: a scope that owns the graphs captured inside it and releases them at its end.

Inside a region, every graphed callable keys into the region's own cache (one per callable), so
graphs captured there are the region's: leaving the region (or :meth:`GraphRegion.close`)
releases them and their memory. ``enabled=False`` runs every graphed callable inside eagerly.
Regions nest; the innermost one is in effect. Outside any region, callables keep their own
caches.

Inference graphs of a region share one memory pool, and chain: a graph's outputs are handed out
without a copy (as aliases of its static output, a :class:`Slot`), and a graph whose input is
such an alias, captured while it was one, reads it in place. Aliases stay safe: before a replay
that may overwrite a slot's memory (its own graph's, or one captured after it, which may have
reused that memory while it was free), the region checks the storage's use count; if the caller
still holds the last alias, it is moved to a copy (``set_``); if a view of it is held, the call
runs eagerly. So nobody's tensor changes under them, and nothing is copied when nobody kept it.
Training graphs get pools of their own (their saved activations must survive other replays).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import sys
import threading
import weakref
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from ._cache import GraphCache
from ._capture import MULTI_STREAM, collect_young, drain
from ._copies import copies_of, copy_of
from ._replay import _is_size, of_this_call, view_on
from ._signature import leaf_kind
from ._errors import CudagraphifyError, CudagraphifyUsageError
from ._options import Stats


__all__ = ["GraphRegion", "graph_region", "current", "all_open"]

_stack: contextvars.ContextVar[tuple] = contextvars.ContextVar("cudagraphify_regions", default=())
_open: "weakref.WeakSet[GraphRegion]" = weakref.WeakSet()


def current() -> "GraphRegion | None":
    stack = _stack.get()
    return stack[-1] if stack else None


def register(region: "GraphRegion") -> None:
    """Count ``region`` as open (a callable's implicit region, never entered with ``with``):
    :func:`all_open` lists it until it is closed."""
    _open.add(region)


def stack_var() -> contextvars.ContextVar:
    """The context variable holding the tuple of regions entered (the last is in effect)."""
    return _stack


def all_open() -> list["GraphRegion"]:
    return list(_open)


_use_count = torch._C._storage_Use_Count
_refcount = sys.getrefcount
_same_version = torch.autograd._unsafe_preserve_version_counter


def _storage_ptr(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage; None for a tensor without one (sparse)."""
    try:
        return t.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return None


def _handed_as(t: torch.Tensor, ptr: int) -> tuple:
    """What :func:`_shared_again` needs of ``t``, an output on a slot's memory (at ``ptr``)
    that :meth:`GraphRegion.owned_outputs` copies: the tensor itself weakly (a strong
    reference would count as a holder of that memory) and where it lies."""
    plain = type(t) is torch.Tensor and t.layout is torch.strided
    return (ptr, weakref.ref(t), plain, t.dtype, t.size(), t.stride(), t.storage_offset(),
            t.is_conj(), t.is_neg())


def _shared_again(handed: tuple, ptr: int, alias: torch.Tensor) -> bool:
    """In the leaves of what :meth:`GraphRegion.owned_outputs` made (``handed``), in place:
    the copies of ``alias`` (moved off ``ptr`` since: held outside the output too) replaced
    by ``alias`` itself, and the copies of the other tensors on that memory by views of it
    again (its dtype, or another, conj/neg bits kept): eager's caller has the tensor its
    other holder has, not a copy of it. A subclass's copy stays (a view would lose its
    class), and so does one that no view of ``alias`` can make. Whether any was replaced."""
    _, leaves, records = handed
    done = False
    for k, (p, ref, plain, dtype, size, stride, offset, conj, neg) in records.items():
        if p != ptr:
            continue
        if ref() is alias:
            t = alias
        elif not plain or alias.is_conj() or alias.is_neg():
            continue
        else:
            try:
                t = view_on(alias, dtype, size, stride, offset, conj, neg)
            except RuntimeError:  # (another element size, alias's last dimension strided)
                continue
        leaves[k] = t
        done = True
    return done


def captured_among(backend, device, tokens) -> bool:
    """Whether one of the streams ``tokens`` is under a capture of another thread's own (a
    user's ``torch.cuda.graph``): a stream that waited on it would join that capture (its
    work captured, not run), and the host may not wait on it. False for a backend that cannot
    tell (no streams)."""
    capturing = getattr(backend, "stream_capturing", None)
    return capturing is not None and any(capturing(device, t) for t in tokens)


class Slot:
    """A static output of a region graph, handed out as an alias instead of a copy."""

    __slots__ = ("region", "live", "tensor", "ptr", "storage", "cdata", "seq", "baseline",
                 "alias", "lone", "thread", "firsts", "refs")

    def __init__(self, region: "GraphRegion", tensor: torch.Tensor, seq: int, lone: bool = True,
                 firsts: dict | None = None):
        self.region = region
        # its graph's first baselines, by memory (``_cdata``): the outputs of one graph on one
        # memory take the count made before the first of their aliases was handed out (ints
        # only: no slot holds another)
        self.firsts = firsts if firsts is not None else {}
        self.lone = lone  # no other output of its graph on its memory (see hand_out)
        self.live = region._live  # the region's slots whose last alias may still be held
        self.tensor = tensor
        self.ptr = tensor.data_ptr()  # its address in the pool (an alias grown moves the tensor)
        self.storage = tensor.untyped_storage()  # held: reading its use count is then cheap
        self.cdata = self.storage._cdata  # (valid while ``storage`` is held)
        self.seq = seq
        self.baseline: int | None = None
        # the Python references to ``storage`` when the baseline was taken: a storage object
        # the caller keeps (``h.untyped_storage()``) is this very object (PyTorch keeps one per
        # storage), so it raises no use count, only this (see ``extra_users``)
        self.refs = 0
        self.alias: weakref.ref | None = None
        self.thread = 0  # the thread its last alias was handed to

    @property
    def static(self) -> torch.Tensor:
        """The graph's output memory the aliases share (see ``CapturedGraph.handed``)."""
        return self.tensor

    def users(self) -> int:
        return _use_count(self.cdata)

    def extra_users(self) -> int:
        """Tensors sharing this memory beyond cudagraphify's own, and one more where its
        storage object is kept beyond cudagraphify's own references (by the caller, the
        forward: the memory is theirs too, and no alias of it can be moved for them)."""
        return _use_count(self.cdata) - self.baseline \
            + (_refcount(self.storage) > self.refs)

    def free(self) -> bool:
        """No tensor or storage object beyond cudagraphify's own holds this memory."""
        return _use_count(self.cdata) == self.baseline and _refcount(self.storage) <= self.refs

    def own_more(self, n: int) -> None:
        """cudagraphify now holds ``n`` more (or fewer) tensors on this memory."""
        if self.baseline is not None:
            self.baseline += n

    def hand_out(self, leaves, outs) -> torch.Tensor:
        if self.baseline is None:
            self._first_baseline()
        # (``.data``: a version counter of its own, as eager's output has: an in-place write to
        # an earlier call's output must not move a later one's version; outputs of one call on
        # one memory: tensors of their own on it sharing the first's counter, as eager's views
        # of one another share theirs, see ``_replay.of_this_call``)
        alias = self.tensor.data if self.lone else of_this_call(self.tensor, outs)
        self.alias = weakref.ref(alias)
        self.thread = threading.get_ident()
        self.live[self] = None
        region = self.region
        if self.seq > region._live_top:
            region._live_top = self.seq
        return alias

    def _first_baseline(self) -> None:
        """cudagraphify's own references to this memory, before the first alias of it is handed
        out: counted once the young garbage is collected (a cycle of the capture's run holding
        a view of it), once for every output of its graph on this memory (the first output's
        alias, handed out just before, is not the second's own)."""
        n = self.firsts.get(self.cdata)
        if n is None:
            collect_young()
            n = self.firsts[self.cdata] = _use_count(self.cdata)
        self.baseline = n
        self.refs = _refcount(self.storage)

    def protect(self) -> bool:
        """Before this memory is overwritten: move a held alias to a copy. False if impossible."""
        extra = self.extra_users()
        if extra > 0:
            region = self.region
            if self.thread != threading.get_ident() and (not region.implicit
                                                         or self.thread in region.streams):
                # another thread's alias, which an op of that thread may be reading at this
                # moment, having released the GIL (on a GPU, queued on its stream): neither
                # moved under it nor overwritten (in a callable's own region, while that
                # thread runs it: after its run only a view it kept can be left, which
                # cannot be moved and blocks as a view does)
                region.held_elsewhere = True
                return False
            return self.move(extra)
        self.region._live.pop(self, None)
        return True

    def move(self, extra: int) -> bool:
        """Move the held alias (``extra`` tensors beyond cudagraphify's own share this memory)
        to a copy, on its own thread; False where it cannot be (a view or a detached copy of
        the alias)."""
        alias = self.alias() if self.alias is not None else None
        if alias is None or extra > 1:
            return False  # a view or a detached copy of the alias: cannot be moved
        try:
            # (the same values: autograd may have saved the alias for a backward, which must
            # still find it at the version it saved; an inference tensor has no version to keep)
            keep = contextlib.nullcontext() if alias.is_inference() else _same_version(alias)
            with keep:  # (its own layout: the caller may have moved it, a t_(), and eager's
                # tensor would keep that)
                alias.set_(self.storage.clone(), alias.storage_offset(), alias.size(),
                           alias.stride())
        except RuntimeError:
            return False
        self.region.moved_outputs += 1
        self.region._live.pop(self, None)
        return True


class GraphRegion:
    """The scope object that ``with graph_region(...) as region`` binds."""

    implicit = False  # a callable's own region around its pieces (see _pieces.PieceRuns.chained)

    def __init__(self, enabled: bool = True, max_graphs: int | None = None, chain: bool = True):
        if not isinstance(enabled, bool):
            raise CudagraphifyUsageError(f"enabled must be a bool, got {enabled!r}")
        if max_graphs is not None and (not isinstance(max_graphs, int) or max_graphs < 1):
            raise CudagraphifyUsageError(f"max_graphs must be a positive int, got {max_graphs!r}")
        self.enabled = enabled
        self.max_graphs = max_graphs
        # id(state) -> (weak reference to the state, its cache): a module deleted while the
        # region is open must not be kept alive by it. When one dies, its reference is queued
        # in ``_dead`` and its graphs are released by the region's next call (``_collect``),
        # not from the garbage collector, which may run in the middle of a region call.
        self._caches: dict[int, tuple[weakref.ref, GraphCache]] = {}
        self._dead: list[tuple[int, weakref.ref]] = []
        self._token = None
        self.closed = False
        self.chain = bool(chain)
        self.input_copies = 0
        self.moved_outputs = 0
        self.captures = 0
        self.capture_seconds = 0.0
        self.replays = 0
        self.lock = threading.RLock()  # region graphs share memory: one call at a time
        self._stream_token: int | None = None
        self._pools: dict = {}
        self._seq = 0
        self._slots: dict[int, Slot] = {}  # data_ptr of a static output -> its slot
        self._live: dict[Slot, None] = {}  # slots whose last alias may still be held
        # at least the highest capture order among them (see protect_before)
        self._live_top = -1
        # the capture order of the slot that made protect_before's last failure (-1: none, or
        # a borrowed input's)
        self.blocked_by = -1
        # what owned_outputs copied last, for release_aliases: (the output's pytree spec, or
        # None for a tensor; its leaves as returned, a list of its own; {leaf index:
        # _handed_as of the original})
        self._handed: tuple | None = None
        self.held_elsewhere = False  # protect_before's last failure: another thread's alias
        # a callable's own region (see _pieces): the stream of each thread running the callable
        # now, and the streams of runs that ended after another stream replayed (their last
        # ops, on memory of this region's graphs, may still be queued)
        self.streams: dict[int, int] = {}
        self.pending_streams: set[int] = set()
        self.entered = 0  # runs entered so far (a capture sees whether one began meanwhile)
        # the run each thread is in (or was in last): its number among ``entered``
        self.run_of: dict[int, int] = {}

    def enter_run(self, token: int) -> None:
        """A thread starts a run of the callable whose region this is, on stream ``token``.
        Where another thread runs it on another stream, replays here stop taking the fast path
        (the stream that replayed last is MULTI_STREAM): each orders after the other streams
        first (``order_before_replay``), since an op queued there may still read an output
        its thread has dropped."""
        streams = self.streams
        me = threading.get_ident()
        streams[me] = token
        self.entered += 1
        run_of = self.run_of
        if len(run_of) >= 256 and me not in run_of:
            for t in [t for t in run_of if t not in streams]:
                del run_of[t]  # (threads not in a run now: their next run is numbered anew)
        run_of[me] = self.entered
        if any(t != token for t in tuple(streams.values())):
            self._stream_token = MULTI_STREAM  # (whichever stream replayed last)

    def exit_run(self, token: int, backend, device) -> None:
        """The end of a run (``enter_run``), under ``lock``, after ``release_aliases``."""
        streams = self.streams
        streams.pop(threading.get_ident(), None)
        last = self._stream_token
        if last is None or last == token:
            return
        pending = self.pending_streams
        if any(t != token for t in tuple(streams.values())):
            # another thread runs on another stream: the next replay orders after this one
            if last != MULTI_STREAM:
                pending.add(last)
            pending.add(token)
            self._stream_token = MULTI_STREAM
            return
        # another stream replayed after this run began (its forward's side stream, a thread
        # gone since): the caller's stream waits for it here, once, and is the last stream
        waits = (pending | {last}) - {token, MULTI_STREAM}
        if captured_among(backend, device, waits):
            # (one is under another thread's capture of its own now: no wait on it; the next
            # replay finds it, and runs eagerly while the capture lasts: see _engine)
            pending.update(waits)
            pending.add(token)
            self._stream_token = MULTI_STREAM
            return
        for t in waits:
            backend.order_after(device, t)
        pending.clear()
        self._stream_token = token

    def other_streams(self, token: int) -> set:
        """The streams a replay on ``token`` orders after while several streams use this
        region (see ``order_before_replay``)."""
        return {t for t in (*tuple(self.streams.values()), *self.pending_streams) if t != token}

    def order_before_replay(self, backend, device, token: int) -> None:
        """Before a replay on stream ``token`` where several streams used this region: order
        it after every other (see ``enter_run``); the stream that replayed last is then
        ``token``, unless another thread still runs on another stream."""
        for t in self.other_streams(token):
            backend.order_after(device, t)
        self.pending_streams.clear()
        if not any(t != token for t in tuple(self.streams.values())):
            self._stream_token = token

    def release_aliases(self, mine: Any = None) -> Any:
        """At the end of a run of the callable whose implicit region this is (see
        ``_pieces``), on its thread: move to copies the aliases handed to this thread that
        are still held (by a cache argument that kept a piece's output, by an object the
        copy of the outputs does not flatten), so that no alias outlives its run: the next
        replay must not move or overwrite it while its holder, then on another thread or
        sharing it through DLPack, reads it.

        ``mine``: what :meth:`owned_outputs` just gave (its argument since dropped). Where an
        alias it copied is still held elsewhere (``self.last = h; return h``), eager's caller
        would share that tensor: ``mine`` again with the moved alias itself (or a view of
        it, for a view of it copied) in place of its copy; else ``mine``."""
        handed, self._handed = self._handed, None
        live = self._live
        if not live:
            return mine
        me = threading.get_ident()
        shared = False
        for slot in tuple(live):
            if slot.thread == me:
                extra = slot.extra_users()
                if extra == 0:
                    del live[slot]
                else:
                    ptr = slot.storage.data_ptr()
                    alias = slot.alias() if slot.alias is not None else None
                    if slot.move(extra) and handed is not None and alias is not None:
                        shared |= _shared_again(handed, ptr, alias)
        if not shared:
            return mine
        spec, leaves, _ = handed
        return leaves[0] if spec is None else pytree.tree_unflatten(leaves, spec)

    # -- chaining ------------------------------------------------------------------------

    def pool(self, backend, device):
        """The memory pool shared by this region's inference graphs on ``device``."""
        pool = self._pools.get(device)
        if pool is None or getattr(pool, "retired", False):  # (see _capture.Pool)
            pool = self._pools[device] = backend.new_pool(device)
        return pool

    def borrowable(self, leaves: list) -> dict[int, Slot]:
        """Leaves that are exactly a slot's tensor (an alias handed out, not a conj or neg view
        of it): read them in place (not one of another class, or that carries Python
        attributes, ``nn.Parameter(h)``: the slot is a plain tensor; such a leaf is copied, as
        the class is kept there, see ``_replay.StaticInputs``)."""
        out: dict[int, Slot] = {}
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor) and leaf_kind(x) is None:
                slot = self._slots.get(x.data_ptr())
                if slot in out.values():
                    continue  # the same alias twice: one leaf borrows it, the others copy
                # (a conj or neg view of the slot, ``h.conj()``, is no alias of it: its values
                # differ; copied, its copy keeps the bit)
                if slot is not None and x.untyped_storage().data_ptr() == \
                        slot.tensor.untyped_storage().data_ptr() and x.shape == slot.tensor.shape \
                        and x.stride() == slot.tensor.stride() and x.dtype == slot.tensor.dtype \
                        and x.is_conj() == slot.tensor.is_conj() \
                        and x.is_neg() == slot.tensor.is_neg():
                    out[i] = slot
        return out

    def adopt(self) -> tuple[int, Callable, Callable[[], None], Callable[[], None]]:
        """For a new inference graph: its capture order, the factory of its output actions
        (protected aliases), the hook that forgets its slots when it is released, and the one
        that runs once its release is done (see ``forget``)."""
        seq = self._seq
        self._seq += 1
        slots: list[Slot] = []
        firsts: dict[int, int] = {}  # (see Slot.firsts)

        def pool_output(t: torch.Tensor, lone: bool = True):
            slot = Slot(self, t, seq, lone, firsts)
            slots.append(slot)
            self._slots[slot.ptr] = slot
            return slot.hand_out

        kept: list[tuple[Slot, int]] = []

        def forget():
            # The graph goes (evicted, invalidated, a piece given back), but an alias of its
            # output may still be held: its memory is then the caller's, and graphs captured
            # before this one may still write there (their freed temporaries may lie under
            # it). The alias moves to a copy now; where a view of it is held instead, the slot
            # stays protected as before (its baseline refitted once the graph's own references
            # are gone: ``refit``).
            for slot in slots:
                if self._slots.get(slot.ptr) is slot:
                    del self._slots[slot.ptr]
                if slot not in self._live:
                    continue
                if self.closed:  # (closing: nothing replays in this pool again)
                    del self._live[slot]
                    continue
                extra = slot.extra_users()
                if extra <= 0 or slot.tensor.data_ptr() != slot.ptr:
                    # (nothing beyond ours holds it, or its storage was grown, which moved it
                    # off the pool: no replay writes where it lies now)
                    del self._live[slot]
                elif not slot.protect():  # (its tensors beyond ours: the baseline's refit)
                    kept.append((slot, _use_count(slot.cdata) - slot.baseline))

        def refit():
            for slot, extra in kept:
                slot.baseline = slot.users() - extra
            kept.clear()

        return seq, pool_output, forget, refit

    def protect_before(self, entry, leaves: list) -> bool:
        """Protect the slots a replay of ``entry`` may overwrite; False if one cannot be."""
        live = self._live
        seq = entry.seq
        self.held_elsewhere = False
        if live and self._live_top >= seq:
            # (else every live slot was captured before this graph, as the earlier pieces'
            # outputs of a chain are when the next one replays: no walk over them)
            top = -1
            # (nor, where this graph writes nothing of the pool but its outputs, one captured
            # after it: such a slot may lie on an earlier graph's temporaries, of which this
            # one has none)
            after = 1 << 62 if getattr(entry, "scratch", True) else seq
            for slot in tuple(live):
                if slot.seq < seq or slot.seq > after:
                    # captured before (or after it, above): this replay cannot reach its memory
                    if slot.seq > top:
                        top = slot.seq
                    continue
                if slot.free():
                    del live[slot]  # no alias left: nothing to protect (``protect``'s common case)
                elif not slot.protect():
                    self.blocked_by = slot.seq
                    return False
            self._live_top = top  # (the slots left are those captured before)
        if not entry.borrowed:
            return True
        for i, slot in entry.borrowed:
            if leaves[i].data_ptr() != slot.tensor.data_ptr() and not slot.protect():
                self.blocked_by = -1
                return False
        return True

    def cache_for(self, state: Any) -> GraphCache:
        """The cache of ``state`` (a callable's GraphedState) in this region."""
        if self.closed:
            raise CudagraphifyError("this graph_region is closed; open a new one")
        if self._dead:
            self._collect()
        item = self._caches.get(id(state))
        if item is None:
            policy = state.policy
            if self.max_graphs is not None:
                policy = copy.copy(policy)
                policy.max_graphs = self.max_graphs
            dead = self._dead
            ref = weakref.ref(state, lambda r, key=id(state): dead.append((key, r)))
            item = self._caches[id(state)] = (ref, GraphCache(policy))
        return item[1]

    def owned_outputs(self, out: Any) -> Any:
        """``out`` with every tensor on a slot's memory (an alias handed out, or a view of one)
        replaced by a copy: what a callable running its pieces in this region returns to its
        caller, who may share it where use counts do not see (DLPack, CuPy) or resize it.
        What was copied is kept for :meth:`release_aliases`, the next call under this lock."""
        self._handed = None
        live = self._live
        if not live:
            return out
        for slot in tuple(live):
            if slot.free():
                del live[slot]  # no alias left (the forward consumed it): nothing to copy
        if not live:
            return out
        if type(out) is torch.Tensor and out.layout is torch.strided:  # (without a flatten)
            ptr = out.untyped_storage().data_ptr()
            if not any(s.storage.data_ptr() == ptr for s in live):
                return out
            mine = copy_of(out, ptr)
            self._handed = (None, [mine], {0: _handed_as(out, ptr)})
            return mine
        ptrs = {slot.storage.data_ptr() for slot in live}
        # (a torch.Size whole: pytree would rebuild it as a plain tuple)
        leaves, spec = pytree.tree_flatten(out, is_leaf=_is_size)
        on = {k: p for k, t in enumerate(leaves)
              if isinstance(t, torch.Tensor) and (p := _storage_ptr(t)) in ptrs}
        if not on:
            return out
        copies = copies_of(leaves, ptrs)
        self._handed = (spec, copies, {k: _handed_as(leaves[k], p) for k, p in on.items()})
        return pytree.tree_unflatten(copies, spec)

    def in_use(self) -> bool:
        """Whether a callable still alive has a cache here (releases queued left out)."""
        dead = {key for key, _ in self._dead}
        return any(key not in dead and ref() is not None
                   for key, (ref, _) in list(self._caches.items()))

    def cache_of(self, state: Any) -> list[GraphCache]:
        """``state``'s cache in this region, as a list (empty where it has none)."""
        item = self._caches.get(id(state))
        return [item[1]] if item is not None and item[0]() is state else []

    def _collect(self) -> None:
        """Release the graphs of callables that were deleted while this region is open (and
        of those whose release ``forget`` queued)."""
        while self._dead:
            key, ref = self._dead.pop()
            item = self._caches.get(key)
            if item is not None and item[0] is ref:
                del self._caches[key]
                self._release(item[1])

    def _release(self, cache: GraphCache) -> None:
        graphs = cache.graphs()
        if graphs:  # the stream that replayed last may still be using their memory
            drain(getattr(graphs[0], "device", None), self._stream_token)
        self.input_copies += sum(g.input_copies for g in graphs)
        cache.clear()

    def forget(self, state: Any) -> None:
        """Release ``state``'s graphs in this region (its statics were invalidated); their
        input copies stay counted in ``stats()``.

        The caller holds ``state``'s lock, and a call in this region takes the region's lock
        before a state's: where another thread's call holds the region, waiting here could
        deadlock. The release is then queued, and the region's next ``cache_for`` (which comes
        before ``state`` can use the region again), ``stats`` or ``close`` makes it."""
        if not self.lock.acquire(blocking=False):
            item = self._caches.get(id(state))
            if item is not None:
                self._dead.append((id(state), item[0]))
            return
        try:
            item = self._caches.pop(id(state), None)
            if item is not None:  # state's, or a dead one's whose id it reuses: both go
                self._release(item[1])
        finally:
            self.lock.release()

    def record_capture(self, entry) -> None:
        self.captures += 1
        self.capture_seconds += entry.capture_seconds

    def stats(self) -> Stats:
        with self.lock:
            self._collect()
            caches = [cache for _, cache in self._caches.values()]
        graphs = [g for c in caches for g in c.graphs()]
        return Stats(captures=self.captures, replays=self.replays,
                     capture_seconds=self.capture_seconds,
                     graph_pool_bytes=sum(g.pool_bytes for g in graphs), graphs=len(graphs),
                     evictions=sum(c.evictions for c in caches),
                     input_copies=self.input_copies + sum(g.input_copies for g in graphs),
                     moved_outputs=self.moved_outputs)

    def close(self) -> None:
        """Release every graph of this region (idempotent)."""
        with self.lock:
            caches = [cache for _, cache in self._caches.values()]
            self._caches.clear()
            self._dead.clear()
            self.closed = True  # (its graphs' slots go without being protected: see adopt)
            for cache in caches:
                self._release(cache)
            self._pools.clear()
            self._slots.clear()  # their tensors live in the pool: nothing may keep it
            self._live.clear()
            self.closed = True
        _open.discard(self)

    def __enter__(self) -> "GraphRegion":
        if self.closed:
            raise CudagraphifyError("this graph_region is closed; open a new one")
        if self._token is not None:
            raise CudagraphifyError("this graph_region is already entered")
        self._token = _stack.set(_stack.get() + (self,))
        _open.add(self)
        return self

    def __exit__(self, *exc) -> None:
        _stack.reset(self._token)
        self._token = None
        self.close()


def graph_region(*, enabled: bool = True, max_graphs: int | None = None,
                 chain: bool = True) -> GraphRegion:
    """A scope that owns the graphs captured inside it and releases them when it ends.

    ``enabled=False`` runs every graphed callable inside eagerly (for debugging).
    ``max_graphs`` overrides the callables' own bound inside the region.
    ``chain=True`` (default): inference outputs are handed out without a copy and read in place
    by the next graphed call (see the module docs for how they stay safe); ``chain=False``
    copies outputs as outside a region.

    Example::

        with graph_region() as region:
            for batch in loader:
                model(batch)
        print(region.stats())   # graphs released here
    """
    return GraphRegion(enabled=enabled, max_graphs=max_graphs, chain=chain)
