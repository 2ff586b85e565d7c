"""What every section of the benchmark shares: timing, freeing memory, progress and errors."""

from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import time

import torch

__all__ = ["time_per_call", "hand_capture", "error_text", "free_memory", "progress", "chaining"]


@contextlib.contextmanager
def chaining(on: bool):
    """Pieces chained in their root's implicit region (the default) or not, inside the block:
    the side-by-side rows time what chaining buys."""
    from cudagraphify import _pieces

    _pieces.CHAIN_PIECES = on
    try:
        yield
    finally:
        _pieces.CHAIN_PIECES = True


@contextlib.contextmanager
def segmenting():
    """Segments (experimental, off by default: cudagraphify._segrun) on inside the block."""
    from cudagraphify import _segrun

    old, _segrun.ENABLED = _segrun.ENABLED, True
    try:
        yield
    finally:
        _segrun.ENABLED = old


def time_per_call(fn, x, calls: int, repeats: int, sync=None) -> float:
    """Median µs per call of ``fn(x)`` over ``repeats`` loops of ``calls`` calls."""
    sync = sync or torch.cuda.synchronize
    samples = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(x)
        sync()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def hand_capture(fn, x, warmups: int = 3):
    """A hand-made ``torch.cuda.CUDAGraph`` of ``fn(static_x)``, as its docs show (warm-up on a
    side stream, then capture): ``(graph, static_x, static_y)``."""
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn(static_x)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = fn(static_x)
    return g, static_x, static_y


def error_text(e: BaseException, limit: int = 300) -> str:
    """An exception in one line of at most ``limit`` characters (for a row)."""
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def free_memory() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def progress(message: str) -> None:
    """A progress line, on stderr (the rows go to stdout)."""
    print(f"  .. {message}", file=sys.stderr, flush=True)
