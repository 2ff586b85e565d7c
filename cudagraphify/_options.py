"""The options of a graphed callable and the counters it reports (plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ._cache import CachePolicy

__all__ = ["Options", "Stats"]


@dataclass(frozen=True)
class Options:
    """Options of one graphed callable (see :func:`cudagraphify.graphify`)."""

    num_warmup_iters: int = 1
    static_argnames: tuple[str, ...] = ()
    max_graphs: int = 16
    enabled: bool | Callable[[], bool] = True
    copy_outputs: bool = True
    cache_policy: CachePolicy | None = None
    probe: str | bool = "auto"
    op_policy: Any = None


@dataclass
class Stats:
    """Counters of one graphed callable (or one region). A snapshot: it does not update."""

    captures: int = 0
    replays: int = 0
    eager_calls: dict[str, int] = field(default_factory=dict)
    capture_seconds: float = 0.0
    warmup_seconds: float = 0.0
    graph_pool_bytes: int = 0
    graphs: int = 0
    evictions: int = 0
    invalidations: int = 0
    input_copies: int = 0
    moved_outputs: int = 0  # region outputs still held at the next replay, moved to a copy
    retargets: int = 0  # graphs made from a share_graph template (no capture of their own)

    @property
    def eager(self) -> int:
        return sum(self.eager_calls.values())

    def __add__(self, other: "Stats") -> "Stats":
        """Counters of two callables together (a piecewise root and its graphed pieces)."""
        if not isinstance(other, Stats):
            return NotImplemented
        eager = dict(self.eager_calls)
        for reason, n in other.eager_calls.items():
            eager[reason] = eager.get(reason, 0) + n
        return Stats(**{f: (eager if f == "eager_calls" else getattr(self, f) + getattr(other, f))
                        for f in self.__dataclass_fields__})
