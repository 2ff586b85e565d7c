"""The options of a graphed callable (checked once, for ``graphify`` and ``share_graph``) and
the counters it reports (plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ._cache import CachePolicy, KeyFnPolicy
from ._errors import CudagraphifyUsageError
from ._policy import OpPolicy

__all__ = ["Options", "Stats", "OPTION_NAMES"]

# The options graphify takes (share_graph passes them on); key_fn becomes a cache_policy.
OPTION_NAMES = ("num_warmup_iters", "static_argnames", "max_graphs", "enabled", "copy_outputs",
                "cache_policy", "key_fn", "probe", "op_policy", "segments")


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
    segments: bool = False  # experimental: graph the runs of calls between refused ones
    piece: bool = False  # a submodule a piecewise plan graphified (not a user option)

    @classmethod
    def build(cls, caller: str, **given: Any) -> "Options":
        """The options ``given`` to ``caller`` (``"graphify"``, ``"share_graph"``), checked:
        an unknown name or a value of the wrong kind raises a
        :class:`~cudagraphify.CudagraphifyUsageError` that names the option and the fix.

        ``max_graphs`` bounds the default cache policy; with ``cache_policy`` (whose own
        ``max_graphs`` bounds it) it may be given only when it agrees with the policy's.
        """
        unknown = sorted(set(given) - set(OPTION_NAMES))
        if unknown:
            raise CudagraphifyUsageError(
                f"{caller}() got unknown option(s) {', '.join(unknown)}; its options are "
                f"{', '.join(OPTION_NAMES)}")
        opts = {name: given.get(name, default) for name, default in _DEFAULTS.items()}
        n = opts["num_warmup_iters"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise CudagraphifyUsageError(f"num_warmup_iters must be an int >= 1, got {n!r}")
        names = opts["static_argnames"]
        names = (names,) if isinstance(names, str) else names
        try:
            names = tuple(names)
        except TypeError:
            names = None
        if names is None or not all(isinstance(x, str) for x in names):
            raise CudagraphifyUsageError(
                f"static_argnames must be an argument name or a tuple of names, got "
                f"{opts['static_argnames']!r}; e.g. static_argnames=('cache',)")
        enabled = opts["enabled"]
        if not (isinstance(enabled, bool) or callable(enabled)):
            raise CudagraphifyUsageError(
                f"enabled must be True, False or a callable returning one, got {enabled!r}")
        copy_outputs = opts["copy_outputs"]
        if not isinstance(copy_outputs, bool):
            raise CudagraphifyUsageError(
                f"copy_outputs must be True or False, got {copy_outputs!r}: True (the default) "
                "returns copies of the outputs, False the graph's own tensors, which the next "
                "call overwrites")
        probe = opts["probe"]
        if not (probe is False or probe in ("auto", "thunder")):
            raise CudagraphifyUsageError(
                f'probe must be "auto", "thunder" or False, got {probe!r}')
        op_policy = opts["op_policy"]
        if op_policy is not None and not isinstance(op_policy, OpPolicy):
            raise CudagraphifyUsageError(
                f"op_policy must be a cudagraphify.OpPolicy, got {type(op_policy).__name__}")
        segments = opts["segments"]
        if not isinstance(segments, bool):
            raise CudagraphifyUsageError(f"segments must be True or False, got {segments!r}")
        return cls(num_warmup_iters=n, static_argnames=names, enabled=enabled,
                   copy_outputs=copy_outputs, probe=probe, op_policy=op_policy,
                   segments=segments,
                   **_cache_options(opts["cache_policy"], opts["key_fn"], opts["max_graphs"]))


_DEFAULTS: dict[str, Any] = {"num_warmup_iters": 1, "static_argnames": (), "max_graphs": None,
                             "enabled": True, "copy_outputs": True, "cache_policy": None,
                             "key_fn": None, "probe": "auto", "op_policy": None,
                             "segments": False}


def _cache_options(cache_policy, key_fn, max_graphs) -> dict:
    """``cache_policy`` and ``max_graphs`` from the three options that bound the cache."""
    if cache_policy is not None and key_fn is not None:
        raise CudagraphifyUsageError("give cache_policy or key_fn, not both")
    if cache_policy is not None:
        if not isinstance(cache_policy, CachePolicy):
            raise CudagraphifyUsageError(
                f"cache_policy must be a cudagraphify.CachePolicy, got "
                f"{type(cache_policy).__name__}")
        if max_graphs is not None and max_graphs != cache_policy.max_graphs:
            raise CudagraphifyUsageError(
                f"max_graphs={max_graphs!r} and a cache_policy with max_graphs="
                f"{cache_policy.max_graphs}: the policy bounds the cache, so give max_graphs "
                f"to the policy (CachePolicy(max_graphs={max_graphs!r}, ...)) and not here")
    elif key_fn is not None:
        if not callable(key_fn):
            raise CudagraphifyUsageError(f"key_fn must be callable, got {key_fn!r}")
        cache_policy = KeyFnPolicy(key_fn, max_graphs=16 if max_graphs is None else max_graphs)
    else:
        cache_policy = CachePolicy(max_graphs=16 if max_graphs is None else max_graphs)
    return {"cache_policy": cache_policy, "max_graphs": cache_policy.max_graphs}


@dataclass
class Stats:
    """Counters of a graphified callable, a region or a share_graph group. A snapshot: it does
    not update. Fields a kind does not have stay at their empty defaults.

    A :class:`~cudagraphify.ShareGroup`'s: ``captures`` and ``capture_seconds`` are the group's
    own (template captures and the captures diffed against them), ``retargets`` the layer graphs
    made from templates, ``per_layer`` those captured per layer (sharing refused, the reasons in
    ``reasons``), ``rebased_slots`` / ``unproven_slots`` per signature, ``template_pool_bytes``,
    ``build_seconds`` (building layers' graphs from templates), ``pieces`` (a piecewise plan's
    groups, by path); the calls (replays, eager calls, graphs, pool bytes) are its layers' summed.

    A graphed callable's ``retargets`` are graphs of a static state (an HF cache) made by
    rebasing an earlier state's graph to its memory; ``reasons`` say why a signature's states
    are not rebased, ``template_pool_bytes`` is the memory of the graphs kept to rebase;
    ``set_ups`` counts the calls whose static states (a new cache) were set up before the call
    as an earlier cache's first update had set it up (so that the call is graphed).
    """

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
    # graphs made from a share_graph template, or from the first graph of a static state
    # (a cache) rebased to another state's memory: no capture of their own
    retargets: int = 0
    set_ups: int = 0  # calls whose static states were set up beforehand (HF caches)
    timed_calls: int = 0  # a piecewise plan's pieces' first calls, run eagerly to time them
    # a piecewise plan's pieces' calls of a signature seen for the first time, run eagerly (it
    # is captured when it comes again: a prompt length seen once is not worth a capture)
    seen_once: int = 0
    segments: int = 0  # graphed runs of calls inside eager signatures (experimental, _segrun)
    segment_replays: int = 0  # their replays
    # share_graph groups
    layers: int = 0
    per_layer: int = 0  # layer graphs captured on their own (sharing refused)
    reasons: dict[str, int] = field(default_factory=dict)  # why sharing was refused
    rebased_slots: dict[str, int] = field(default_factory=dict)  # per signature
    unproven_slots: dict[str, int] = field(default_factory=dict)  # per signature
    template_pool_bytes: int = 0
    build_seconds: float = 0.0
    pieces: dict[str, "Stats"] = field(default_factory=dict)  # path -> the piece group's

    @property
    def eager(self) -> int:
        return sum(self.eager_calls.values())

    def __add__(self, other: "Stats") -> "Stats":
        """Counters of two callables together (a piecewise root and its graphed pieces): numbers
        add up, and so do the values of dicts under the same key."""
        if not isinstance(other, Stats):
            return NotImplemented
        return Stats(**{f: _plus(getattr(self, f), getattr(other, f))
                        for f in self.__dataclass_fields__})


def _plus(a: Any, b: Any) -> Any:
    if isinstance(a, dict):
        out = dict(a)
        for k, v in b.items():
            out[k] = out[k] + v if k in out else v
        return out
    return a + b
