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

from ._errors import CudagraphifyUsageError
from ._signature import Signature

__all__ = ["CachePolicy", "GraphCache", "EagerEntry", "Owned"]

_MAX_EAGER = 256  # eager decisions remembered per cache


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
        replays with the constants seen at capture. Tensor layouts, global state and the
        argument structure (which leaf is which argument) are always part of the key.
        """
        return signature.constants

    def full_key(self, signature: Signature) -> Hashable:
        return (signature.tensors, signature.state, signature.spec, self.key(signature))


class KeyFnPolicy(CachePolicy):
    """A policy from a user function ``key_fn(signature) -> hashable``."""

    def __init__(self, key_fn: Callable[[Signature], Hashable], **kw):
        super().__init__(**kw)
        self._key_fn = key_fn

    def key(self, signature: Signature) -> Hashable:
        return self._key_fn(signature)


class Owned:
    """A cache entry's ``owner`` (the engine state that made it), held weakly: a region's
    cache must not keep a deleted module, or its graphs, alive."""

    __slots__ = ()
    _owner: "weakref.ref | None" = None

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


class EagerEntry(Owned):
    """A signature decided eager, with the reason."""

    __slots__ = ("reason", "_owner")

    def __init__(self, reason: str, owner=None):
        self.reason = reason
        self.owner = owner

    def release(self) -> None:
        pass


class GraphCache:
    """An LRU map from key to captured graph (or eager decision) that releases what it drops."""

    def __init__(self, policy: CachePolicy):
        self.policy = policy
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self.evictions = 0

    def get(self, key: Hashable):
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: Hashable, entry) -> list:
        """Insert ``entry``; returns the entries evicted to make room (already released)."""
        self._entries[key] = entry
        self._entries.move_to_end(key)
        evicted = []
        graphs = [k for k, e in self._entries.items() if not isinstance(e, EagerEntry)]
        while len(graphs) > self.policy.max_graphs:
            old = graphs.pop(0)
            evicted.append(self._entries.pop(old))
        if len(self._entries) - len(graphs) > _MAX_EAGER:
            # eager decisions are cheap to make again: forget the oldest
            for k in [k for k, e in self._entries.items() if isinstance(e, EagerEntry)][:-_MAX_EAGER]:
                del self._entries[k]
        for e in evicted:
            e.release()
        self.evictions += len(evicted)
        return evicted

    def discard(self, key: Hashable) -> None:
        """Drop and release the entry of ``key`` (not an eviction)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            entry.release()

    def eviction_budget_spent(self) -> bool:
        return self.evictions >= self.policy.max_evictions

    def clear(self, owner=None) -> None:
        """Release every entry, or only those whose ``owner`` is ``owner``."""
        if owner is None:
            entries = list(self._entries.values())
            self._entries.clear()
        else:
            keys = [k for k, e in self._entries.items() if e.owner is owner]
            entries = [self._entries.pop(k) for k in keys]
        for e in entries:
            e.release()

    def graphs(self, owner=None) -> list:
        return [e for e in self._entries.values() if not isinstance(e, EagerEntry)
                and (owner is None or e.owner is owner)]

    def items(self, owner=None):
        return [(k, e) for k, e in self._entries.items() if owner is None or e.owner is owner]

    def __len__(self) -> int:
        return len(self._entries)
