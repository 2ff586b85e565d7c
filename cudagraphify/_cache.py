"""Graph caches: which signature maps to which captured graph, bounded and evicting.

A :class:`CachePolicy` turns a :class:`~cudagraphify._signature.Signature` into a cache key and
bounds the cache; subclass it to ignore an argument or to merge signatures you know compute the
same thing. Tensor layouts and global state are always part of the key, whatever the policy says:
a graph must never read memory of another layout.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable

from ._capture import drain_all
from ._errors import CudagraphifyUsageError
from ._signature import STATIC_OBJECT, STATIC_STATE, Signature

_HELD = (STATIC_OBJECT, STATIC_STATE)  # the kinds of constants always in the key

__all__ = ["CachePolicy", "GraphCache", "EagerEntry", "Owned"]

_MAX_EAGER = 256  # eager decisions remembered per cache
# a key whose graph was evicted this many times, each time used fewer than THRASH_USES times
# since its capture (a capture costs a few eager runs), is not captured again (see
# thrashing): keys remembered per cache
THRASH_EVICTIONS = 2
THRASH_USES = 4
_MAX_EVICTED_KEYS = 4096


class CachePolicy:
    """How a graphed callable keys and bounds its graphs. Subclass to customise.

    ``max_graphs``: at most this many graphs are kept; the least recently used one is released
    when another is captured. ``max_evictions``: after this many evictions, new signatures run
    eagerly (a workload with unbounded shapes should not capture forever).

    ``shared=True``: every callable graphified with this policy object uses one cache, so
    modules you know are interchangeable (same computation, and you accept the capturing
    module's parameters) replay one graph. The capturing module's parameters stay guarded: if
    they move, or that module is deleted, its graphs are dropped for everyone.
    """

    def __init__(self, max_graphs: int = 16, max_evictions: int = 64, shared: bool = False):
        if not isinstance(max_graphs, int) or isinstance(max_graphs, bool) or max_graphs < 1:
            raise CudagraphifyUsageError(f"max_graphs must be a positive int, got {max_graphs!r}")
        if not isinstance(max_evictions, int) or max_evictions < 0:
            raise CudagraphifyUsageError(
                f"max_evictions must be a non-negative int, got {max_evictions!r}"
            )
        self.max_graphs = max_graphs
        self.max_evictions = max_evictions
        self.shared = bool(shared)
        self._shared_cache: GraphCache | None = None
        # callables sharing a cache replay each other's graphs: one lock for all of them
        self.shared_lock = threading.RLock() if self.shared else None

    def new_cache(self) -> "GraphCache":
        """The cache for one more callable: its own, or the policy's one when ``shared``."""
        if not self.shared:
            return GraphCache(self)
        if self._shared_cache is None:
            self._shared_cache = GraphCache(self)
        return self._shared_cache

    def key(self, signature: Signature) -> Hashable:
        """The part of the key a policy controls. Default: the constants.

        Return the same value for two signatures to let them share a graph: the graph then
        replays with the constants seen at capture. Tensor layouts, global state, the argument
        structure (which leaf is which argument) and the objects passed as they are (named in
        ``static_argnames``, or recognised static state such as an HF ``StaticCache``) are
        always part of the key.
        """
        return signature.constants

    def full_key(self, signature: Signature) -> Hashable:
        # (objects passed as they are, named in ``static_argnames`` or recognised static state
        # such as an HF StaticCache, are keyed whatever the policy says: a graph reads their
        # memory in place, as it reads a tensor argument's)
        held = tuple(c for c in signature.constants if c.kind in _HELD)
        return (signature.tensors, signature.state, signature.spec, held, self.key(signature))


class KeyFnPolicy(CachePolicy):
    """A policy from a user function ``key_fn(signature) -> hashable``."""

    def __init__(self, key_fn: Callable[[Signature], Hashable], **kw):
        super().__init__(**kw)
        self._key_fn = key_fn

    def key(self, signature: Signature) -> Hashable:
        return self._key_fn(signature)


def _uses(entry) -> int:
    """``entry.uses`` with its owner's replays through the fast path not yet counted (they are
    at the owner's next slow call; another callable of a shared cache may evict it first)."""
    uses = getattr(entry, "uses", 0)
    owner = entry.owner if isinstance(entry, Owned) else None
    fast = getattr(owner, "_fast", None)
    if getattr(fast, "entry", None) is entry and hasattr(fast, "pending_uses"):
        uses += fast.pending_uses()
    return uses


class Owned:
    """A cache entry (a graph, or an eager decision) and what it depends on.

    ``owner``: the engine state that made it, held weakly (a region's cache must not keep a
    deleted module, or its graphs, alive). ``state``: the module state the decision was made
    under (a :class:`~cudagraphify._guards.StateGuard`, or None when it depends on none);
    ``flags``: the global flags of its capture (a ``FlagsGuard``, or None); ``pinned``: leaves
    read in place that are not keyed by address (parameters or buffers passed as arguments),
    as (leaf index, address).
    """

    __slots__ = ()
    _owner: "weakref.ref | None" = None
    state: Any = None
    flags: Any = None
    pinned: tuple = ()
    written_statics: frozenset = frozenset()  # storages of parameters/buffers forward writes
    # (one that writes its arguments) storages of the parameters/buffers it reads in place: a
    # written argument sharing one must not be written into a copy
    read_statics: frozenset = frozenset()
    uses = 0  # (a graph's) calls that found it after its capture (see GraphCache.thrashing)
    # (a graph's) replays: its slow path's, and its fast path's once that is dropped (not the
    # calls that found it and ran eagerly, blocked or aliased: see _engine._replay)
    replayed = 0
    state_storages: frozenset = frozenset()  # storages of the static states' tensors
    held_storages: frozenset = frozenset()  # storages of tensors read from outside (attributes)
    # (a graph's) the version counters its replay moves and its backward checks: a
    # _versions.Counters, or None where there are none
    counters: Any = None
    # (an inference graph whose forward read ``requires_grad`` under no_grad) which of its
    # owner's parameters and buffers required grad then: another pattern is another graph
    grads_read: tuple | None = None

    @property
    def owner(self):
        ref = self._owner
        return ref() if ref is not None else None

    @owner.setter
    def owner(self, state) -> None:
        self._owner = weakref.ref(state) if state is not None else None

    @property
    def orphaned(self) -> bool:
        """Its owner is gone: a graph in a shared cache would read the freed memory of the
        module that captured it."""
        ref = self._owner
        return ref is not None and ref() is None

    def fits(self, leaves: list) -> bool:
        """Whether this entry applies to a call with these leaves, under today's state."""
        for i, ptr in self.pinned:
            if leaves[i].data_ptr() != ptr:
                return False
        flags = self.flags
        if flags is not None and not flags.check():
            return False
        grads = self.grads_read
        if grads is not None:
            owner = self.owner
            if owner is None or owner.statics.grad_pattern() != grads:
                return False
        state = self.state
        return state is None or state.valid()


class EagerEntry(Owned):
    """A signature decided eager, with the reason."""

    __slots__ = ("reason", "_owner", "state", "flags", "pinned")

    def __init__(self, reason: str, owner=None, state=None, flags=None):
        self.reason = reason
        self.owner = owner
        self.state = state
        self.flags = flags
        self.pinned = ()

    def release(self) -> None:
        pass


class SetUpEntry(EagerEntry):
    """A signature whose call sets up static states (a cache's first update allocates its
    tensors): it runs eagerly, but a later call's states are first set up as this one's were
    (``set_ups``: (leaf index, :class:`~._state.SetUp`)), and that call is then decided as one
    with them set up. ``set_ups`` is emptied when a set-up does not give the layout expected,
    and when set-up calls keep capturing (``captured``: their states' graphs are not rebased,
    so each new state would cost a capture instead of an eager call). ``demoted``: why a
    state one of its calls set up was demoted (see _state.first_of_kind): the next calls'
    states are passed as they are at once."""

    __slots__ = ("set_ups", "captured", "demoted")

    def __init__(self, reason: str, owner, state, flags, set_ups: list):
        super().__init__(reason, owner, state, flags)
        self.set_ups = set_ups
        self.captured = 0
        self.demoted: str | None = None


def _waiting(entry) -> bool:
    """Whether ``entry`` is a training graph an earlier call's backward still reads."""
    pending = getattr(entry, "pending", None)
    return pending is not None and pending()


class GraphCache:
    """An LRU map from key to the entries made for it (graphs or eager decisions) that releases
    what it drops.

    A key can hold several entries (variants): one per module state and global flags a graph
    was captured under (``model.train()`` then ``model.eval()``, a flag toggled back), each
    checked by :meth:`Owned.fits`. ``max_graphs`` bounds the graphs over all keys.
    """

    def __init__(self, policy: CachePolicy):
        self.policy = policy
        self._lru: OrderedDict[int, tuple[Hashable, Any]] = OrderedDict()  # id(entry) ->
        self._by_key: dict[Hashable, list] = {}
        self.evictions = 0
        # key -> times a graph of it was evicted hardly used (see thrashing)
        self._evicted: dict[Hashable, int] = {}

    def get(self, key: Hashable) -> list:
        """The entries of ``key``, the most recently used first."""
        entries = self._by_key.get(key)
        if not entries:
            return []
        return sorted(entries, key=self._rank, reverse=True) if len(entries) > 1 else entries

    def _rank(self, entry) -> int:
        return self._order.get(id(entry), -1)

    @property
    def _order(self) -> dict[int, int]:
        return {k: i for i, k in enumerate(self._lru)}

    def touch(self, entry) -> None:
        if id(entry) in self._lru:
            self._lru.move_to_end(id(entry))

    def put(self, key: Hashable, entry) -> list:
        """Insert ``entry``; returns the entries evicted to make room (already released)."""
        self._lru[id(entry)] = (key, entry)
        self._by_key.setdefault(key, []).append(entry)
        evicted = []
        graphs = [e for _, e in self._lru.values() if not isinstance(e, EagerEntry)]
        excess = len(graphs) - self.policy.max_graphs
        for old in graphs:
            if excess <= 0:
                break
            if old is entry:
                break  # (the one put now: older ones all wait, see below)
            if _waiting(old):
                # (a training graph whose backward is still to run: released now, that
                # backward would raise; kept past max_graphs until a later put finds it done)
                continue
            self._drop(old, evicted=True)
            evicted.append(old)
            excess -= 1
        eager = [e for _, e in self._lru.values() if isinstance(e, EagerEntry)]
        for old in eager[:-_MAX_EAGER]:  # eager decisions are cheap to make again
            self._drop(old)
        for e in evicted:
            e.release()
        self.evictions += len(evicted)
        return evicted

    def thrashing(self, key: Hashable) -> bool:
        """Whether graphs of ``key`` were evicted :data:`THRASH_EVICTIONS` times, each before
        it was used (``uses``: found by a later call, or replayed) :data:`THRASH_USES` times:
        capturing it again would cost more than it saves and evict another graph. More
        distinct signatures come round than ``max_graphs`` holds (a decode loop's growing
        shapes, over and over), where least recently used is the worst order to drop them in.
        Such a key runs eagerly; the graphs kept go on replaying. Graphs used often before
        their eviction (working sets used in turn, a module attribute's old value) do not
        count, nor do they where the cache has room left (a capture would evict nothing)."""
        return self._evicted.get(key, 0) >= THRASH_EVICTIONS and \
            len(self.graphs()) >= self.policy.max_graphs

    def forget_evictions(self) -> None:
        """Forget which keys were thrashing (the graphs they competed with are gone)."""
        self._evicted.clear()

    def thrashing_now(self, key: Hashable) -> bool:
        """:meth:`thrashing`, once the graphs of callables that are gone (a shared policy's
        cache) have been dropped: with them, what the keys competed for."""
        if not self.thrashing(key):
            return False
        for e in [e for _, e in self._lru.values() if getattr(e, "orphaned", False)]:
            self.drop_orphan(e)
        return self.thrashing(key)

    def drop_orphan(self, entry) -> None:
        """Drop and release ``entry``, whose owner is gone (a shared policy's), once all of the
        device's queued work is done (any callable of the policy may have replayed it last, on
        a stream of its own), and forget which keys were thrashing (its graphs no longer
        compete)."""
        drain_all(getattr(entry, "device", None))
        self.discard(entry)
        self.forget_evictions()

    def _drop(self, entry, evicted: bool = False) -> None:
        key, _ = self._lru.pop(id(entry))
        variants = self._by_key[key]
        variants[:] = [e for e in variants if e is not entry]
        if not variants:
            del self._by_key[key]
        if evicted and _uses(entry) < THRASH_USES:
            times = self._evicted.pop(key, 0) + 1  # (re-inserted: the newest last)
            if len(self._evicted) >= _MAX_EVICTED_KEYS:
                del self._evicted[next(iter(self._evicted))]
            self._evicted[key] = times

    def key_of(self, entry) -> Hashable:
        return self._lru[id(entry)][0]

    def discard(self, entry) -> None:
        """Drop and release ``entry`` (not an eviction)."""
        if id(entry) in self._lru:
            self._drop(entry)
            entry.release()

    def eviction_budget_spent(self) -> bool:
        return self.evictions >= self.policy.max_evictions

    def clear(self, owner=None) -> None:
        """Release every entry, or only those whose ``owner`` is ``owner`` (and forget which keys
        were thrashing: the graphs they competed with are gone)."""
        self.forget_evictions()
        entries = [e for _, e in self._lru.values() if owner is None or e.owner is owner]
        for e in entries:
            self._drop(e)
        for e in entries:
            e.release()

    def graphs(self, owner=None) -> list:
        return [e for _, e in self._lru.values() if not isinstance(e, EagerEntry)
                and (owner is None or e.owner is owner)]

    def items(self, owner=None):
        return [(k, e) for k, e in self._lru.values() if owner is None or e.owner is owner]

    def __len__(self) -> int:
        return len(self._lru)
