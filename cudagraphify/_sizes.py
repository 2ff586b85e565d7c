"""Capturing a list of input sizes up front (serving): :func:`capture_sizes`.

A server knows the sizes it will see (batch sizes, decode widths). Captured on demand, each
size pays its warm-up and capture on the first request of that size; captured here, they are
paid once, before serving, largest first: the graphs of one graphed callable share one memory
pool (see ``FirstCall._capture_inference``), and a capture reuses the memory earlier ones
freed, so capturing the largest size first makes the smaller ones fit in its memory.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from . import _nested, _rehearsal
from ._errors import CudagraphifyUsageError, name_of
from ._options import Stats

__all__ = ["Captured", "capture_sizes"]


@dataclass
class Captured:
    """What :func:`capture_sizes` did. ``str()`` is its one-line summary."""

    name: str
    graphed: list[int] = field(default_factory=list)  # sizes that have a graph, largest first
    eager: dict[int, str] = field(default_factory=dict)  # sizes that run eagerly, and why
    seconds: float = 0.0
    memory_bytes: int = 0  # device memory reserved while capturing (CUDA), else pool bytes
    evicted: int = 0  # graphs these captures evicted (made earlier, by other calls)

    def __str__(self) -> str:
        sizes = _span(self.graphed) if self.graphed else "none"
        line = (f"cudagraphify: {self.name}: {len(self.graphed)} sizes graphed ({sizes}) in "
                f"{self.seconds:.2f} s, {self.memory_bytes / 2**20:.1f} MB")
        if self.eager:
            why = next(iter(self.eager.values()))
            line += f"; {len(self.eager)} eager ({_span(sorted(self.eager))}: {why})"
        if self.evicted:
            line += f"; evicted {self.evicted} graphs made before (max_graphs is full)"
        return line


def capture_sizes(target: Any, inputs: Callable[[int], Any], sizes: Iterable[int], *,
                  progress: bool = True) -> Captured:
    """Capture ``target``'s graph for every size in ``sizes``, largest first.

    ``target``: a graphified module or function. ``inputs(size)`` makes the call's arguments for
    one size: a tuple (positional arguments), a dict (keyword arguments) or a single tensor.
    Each size is called with them, under the caller's grad mode (``torch.no_grad()`` around
    this for inference graphs), until it has a graph (a call that sets something up, such as
    a cache's first update, is followed by another): these calls run the model, with their
    effects. A size whose call runs eagerly is reported with the reason, not raised.

    With ``progress`` (the default) a line on stderr shows the size being captured, and the
    summary (``str()`` of the result) is printed there at the end.
    """
    from .api import _state_of

    def stats(target):  # the callable's own counters: a piecewise plan's pieces are not its graph
        state = _state_of(target)
        return state.stats() if state is not None else Stats()

    if not callable(inputs):
        raise CudagraphifyUsageError(
            f"inputs must be a function of the size that makes its arguments, got "
            f"{type(inputs).__name__}")
    order = _sizes(sizes)
    room = _max_graphs(target, _state_of(target))  # (raises for what is not graphified)
    if len(order) > room:
        raise CudagraphifyUsageError(
            f"{len(order)} sizes, but the callable keeps at most {room} graphs (max_graphs): "
            f"the later captures would evict the earlier ones; graphify it with "
            f"max_graphs={len(order)} or more")
    name = type(target).__name__ if isinstance(target, torch.nn.Module) else \
        name_of(target)
    done = Captured(name)
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    device = torch.cuda.current_device() if cuda else None
    reserved = torch.cuda.memory_reserved(device) if cuda else 0
    before = stats(target)
    t0 = time.perf_counter()
    log: list = []  # (its calls' outcomes; a plan's pieces capture at once)
    token = _nested.sizes_log.set(log)
    try:
        for n, size in enumerate(order, 1):
            if progress:
                print(f"\rcudagraphify: capturing {name}: size {size} ({n}/{len(order)})",
                      end="", file=sys.stderr, flush=True)
            state = _state_of(target)
            if state is not None:
                state.expect_captures()  # (a size after size, none replayed: as asked)
            why = _capture_one(target, inputs, size, stats)
            if why is None:
                done.graphed.append(size)
            else:
                done.eager[size] = why
    finally:
        _nested.sizes_log.reset(token)
        _rehearsal.forget(log)  # (what its sizes were lent: see _rehearsal.lend)
    done.seconds = time.perf_counter() - t0
    if cuda or (torch.cuda.is_available() and torch.cuda.is_initialized()):
        device = torch.cuda.current_device() if device is None else device
        done.memory_bytes = max(0, torch.cuda.memory_reserved(device) - reserved)
    else:
        done.memory_bytes = max(0, stats(target).graph_pool_bytes - before.graph_pool_bytes)
    done.evicted = stats(target).evictions - before.evictions
    if progress:
        print(f"\r{done}", file=sys.stderr, flush=True)
    return done


def _max_graphs(target: Any, state: Any) -> int:
    """How many graphs ``target`` keeps (its state's policy, or its options before its first
    call made the state)."""
    from ._wrap import graphed_forward

    if state is not None:
        return state.policy.max_graphs
    fwd = graphed_forward(target) if isinstance(target, torch.nn.Module) else target
    options = fwd._self_dispatch.options
    return options.cache_policy.max_graphs if options.cache_policy else options.max_graphs


_CALLS = 3  # calls per size at most: a set-up (a cache's first update), a deferral, the capture


def _capture_one(target: Any, inputs: Callable[[int], Any], size: int, stats) -> str | None:
    """Call ``target`` with ``inputs(size)`` until the call replays a graph or a graph was made
    for it; None then, else the reason its last call ran eagerly. What the call's slow path
    noted decides (``_nested.sizes_log``: this thread's calls only, not those of a thread that
    serves meanwhile); after an eager outcome remembered for the signature the size is eager
    (the calls go on while a plan's pieces may still capture); a call that took a fast path
    noted nothing: its counters decide."""
    from .api import _state_of

    why, settled = "no graph after three calls", None
    log = _nested.sizes_log.get()
    for _ in range(_CALLS):
        args, kwargs = _arguments(inputs(size), size)
        before = stats(target)
        del log[:]
        target(*args, **kwargs)
        state = _state_of(target)
        mine = [note[1:] for note in log if note[0] is state]
        del log[:]
        if settled is not None:
            continue
        if mine:
            if any(graphed for graphed, _, _ in mine):
                return None
            why, final = mine[-1][1:]
            if final:
                settled = why
            continue
        after = stats(target)
        if after.captures + after.retargets > before.captures + before.retargets \
                or after.replays > before.replays:
            return None
        new = {k: v - before.eager_calls.get(k, 0) for k, v in after.eager_calls.items()
               if v > before.eager_calls.get(k, 0)}
        if new:
            why = next(iter(new))
    return why if settled is None else settled


def _arguments(made: Any, size: int) -> tuple[tuple, dict]:
    if isinstance(made, torch.Tensor):
        return (made,), {}
    if isinstance(made, tuple):
        return made, {}
    if isinstance(made, dict) and all(isinstance(k, str) for k in made):
        return (), made
    raise CudagraphifyUsageError(
        f"inputs({size}) must return a tuple of positional arguments, a dict of keyword "
        f"arguments or a tensor, got {type(made).__name__}")


def _sizes(sizes: Iterable[int]) -> list[int]:
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
        raise CudagraphifyUsageError(f"sizes must be an iterable of positive ints, got {sizes!r}")
    out = []
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise CudagraphifyUsageError(f"sizes must be positive ints, got {s!r}")
        if s not in out:
            out.append(s)
    if not out:
        raise CudagraphifyUsageError("sizes is empty")
    return sorted(out, reverse=True)


def _span(sizes: list[int]) -> str:
    """``[16, 8, 4, 3, 2, 1]`` -> ``"1-4, 8, 16"``."""
    ordered = sorted(sizes)
    parts, start = [], ordered[0]
    for a, b in zip(ordered, ordered[1:] + [None]):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(parts)
