"""Graph caches: which signature maps to which captured graph, bounded and evicting.

A :class:`CachePolicy` turns a :class:`~cudagraphify._signature.Signature` into a cache key and
bounds the cache; subclass it to ignore an argument or to merge signatures you know compute the
same thing. Tensor layouts and global state are always part of the key, whatever the policy says:
a graph must never read memory of another layout.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Hashable

from ._errors import CudagraphifyUsageError
from ._signature import Signature

__all__ = ["CachePolicy", "GraphCache", "EagerEntry"]


class CachePolicy:
    """How a graphed callable keys and bounds its graphs. Subclass to customise.

    ``max_graphs``: at most this many graphs are kept; the least recently used one is released
    when another is captured. ``max_evictions``: after this many evictions, new signatures run
    eagerly (a workload with unbounded shapes should not capture forever).
    """

    def __init__(self, max_graphs: int = 16, max_evictions: int = 64):
        if not isinstance(max_graphs, int) or isinstance(max_graphs, bool) or max_graphs < 1:
            raise CudagraphifyUsageError(f"max_graphs must be a positive int, got {max_graphs!r}")
        if not isinstance(max_evictions, int) or max_evictions < 0:
            raise CudagraphifyUsageError(
                f"max_evictions must be a non-negative int, got {max_evictions!r}"
            )
        self.max_graphs = max_graphs
        self.max_evictions = max_evictions

    def key(self, signature: Signature) -> Hashable:
        """The part of the key a policy controls. Default: argument structure and constants.

        Return the same value for two signatures to let them share a graph: the graph then
        replays with the constants seen at capture.
        """
        return (signature.spec, signature.constants)

    def full_key(self, signature: Signature) -> Hashable:
        return (signature.tensors, signature.state, self.key(signature))


class KeyFnPolicy(CachePolicy):
    """A policy from a user function ``key_fn(signature) -> hashable``."""

    def __init__(self, key_fn: Callable[[Signature], Hashable], **kw):
        super().__init__(**kw)
        self._key_fn = key_fn

    def key(self, signature: Signature) -> Hashable:
        return self._key_fn(signature)


class EagerEntry:
    """A signature decided eager, with the reason."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason

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
        for e in evicted:
            e.release()
        self.evictions += len(evicted)
        return evicted

    def eviction_budget_spent(self) -> bool:
        return self.evictions >= self.policy.max_evictions

    def clear(self) -> None:
        entries = list(self._entries.values())
        self._entries.clear()
        for e in entries:
            e.release()

    def graphs(self) -> list:
        return [e for e in self._entries.values() if not isinstance(e, EagerEntry)]

    def items(self):
        return list(self._entries.items())

    def __len__(self) -> int:
        return len(self._entries)
