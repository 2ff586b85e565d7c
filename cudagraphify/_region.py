"""``graph_region``: a scope that owns the graphs captured inside it and releases them at its end.

Inside a region, every graphed callable keys into the region's own cache (one per callable), so
graphs captured there are the region's: leaving the region (or :meth:`GraphRegion.close`)
releases them and their memory. ``enabled=False`` runs every graphed callable inside eagerly.
Regions nest; the innermost one is in effect. Outside any region, callables keep their own
caches.
"""

from __future__ import annotations

import contextvars
import copy
import weakref
from typing import TYPE_CHECKING

from ._cache import CachePolicy, GraphCache
from ._errors import CudagraphifyError, CudagraphifyUsageError

if TYPE_CHECKING:
    from ._engine import GraphedState, Stats

__all__ = ["GraphRegion", "graph_region", "current", "all_open"]

_stack: contextvars.ContextVar[tuple] = contextvars.ContextVar("cudagraphify_regions", default=())
_open: "weakref.WeakSet[GraphRegion]" = weakref.WeakSet()


def current() -> "GraphRegion | None":
    stack = _stack.get()
    return stack[-1] if stack else None


def all_open() -> list["GraphRegion"]:
    return list(_open)


class GraphRegion:
    """The scope object that ``with graph_region(...) as region`` binds."""

    def __init__(self, enabled: bool = True, max_graphs: int | None = None):
        if not isinstance(enabled, bool):
            raise CudagraphifyUsageError(f"enabled must be a bool, got {enabled!r}")
        if max_graphs is not None and (not isinstance(max_graphs, int) or max_graphs < 1):
            raise CudagraphifyUsageError(f"max_graphs must be a positive int, got {max_graphs!r}")
        self.enabled = enabled
        self.max_graphs = max_graphs
        self._caches: dict[GraphedState, GraphCache] = {}
        self._token = None
        self.closed = False
        self.captures = 0
        self.capture_seconds = 0.0
        self.replays = 0

    def cache_for(self, state: "GraphedState") -> GraphCache:
        if self.closed:
            raise CudagraphifyError("this graph_region is closed; open a new one")
        cache = self._caches.get(state)
        if cache is None:
            policy = state.policy
            if self.max_graphs is not None:
                policy = copy.copy(policy)
                policy.max_graphs = self.max_graphs
            cache = self._caches[state] = GraphCache(policy)
        return cache

    def forget(self, state: "GraphedState") -> None:
        cache = self._caches.pop(state, None)
        if cache is not None:
            cache.clear()

    def record_capture(self, entry) -> None:
        self.captures += 1
        self.capture_seconds += entry.capture_seconds

    def stats(self) -> "Stats":
        from ._engine import Stats

        graphs = [g for c in self._caches.values() for g in c.graphs()]
        return Stats(captures=self.captures, replays=self.replays,
                     capture_seconds=self.capture_seconds,
                     graph_pool_bytes=sum(g.pool_bytes for g in graphs), graphs=len(graphs),
                     evictions=sum(c.evictions for c in self._caches.values()))

    def close(self) -> None:
        """Release every graph of this region (idempotent)."""
        caches = list(self._caches.values())
        self._caches.clear()
        for cache in caches:
            cache.clear()
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


def graph_region(*, enabled: bool = True, max_graphs: int | None = None) -> GraphRegion:
    """A scope that owns the graphs captured inside it and releases them when it ends.

    ``enabled=False`` runs every graphed callable inside eagerly (for debugging).
    ``max_graphs`` overrides the callables' own bound inside the region.

    Example::

        with graph_region() as region:
            for batch in loader:
                model(batch)
        print(region.stats())   # graphs released here
    """
    return GraphRegion(enabled=enabled, max_graphs=max_graphs)
