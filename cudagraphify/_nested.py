"""Which threads are inside a graphed callable's warm-up or capture.

A graphed callable called there runs eagerly and becomes part of the outer run (its ops are the
outer graph's). ``nesting`` counts such runs on all threads: the fast paths' cheap check.
"""

from __future__ import annotations

import contextvars
import threading

# While capture_sizes runs, in its thread (or context) only: a list where each call notes (its
# GraphedState, whether it made a graph or replayed one, why it ran eagerly, whether that is
# remembered for the signature; the fast path's replays note nothing); other threads' calls
# meanwhile are not its sizes'. Pieces capture at first sight there.
sizes_log: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "cudagraphify_sizes_log", default=None)

__all__ = ["Nested", "Plain", "bypassing", "in_graphed_call", "nesting", "plain_reason",
           "segment_mode"]

_tls = threading.local()
nesting = [0]  # warm-ups and captures in progress, any thread (the fast path's cheap check)
_nesting_lock = threading.Lock()


class _Bypassing(threading.local):
    """This thread's armed bypass: a piecewise root's grad-mode call whose pending pieces run
    their plain forward straight from their ``DirectCall`` (see _fast.Bypass); None outside."""

    token = None


bypassing = _Bypassing()


class _SegmentMode(threading.local):
    """This thread's segments mode while it records or replays a forward (see _segmodes): a
    graphed module's ``DirectCall`` met inside it hands the call to the mode (which may answer
    it whole, past the module's Python); None outside."""

    mode = None


segment_mode = _SegmentMode()


def in_graphed_call() -> bool:
    """True while this thread warms up or captures a graphed callable (nested calls run eagerly)."""
    return getattr(_tls, "depth", 0) > 0


class Nested:
    """Marks a warm-up or capture in progress on this thread (nested graphed calls run eagerly
    and become part of it)."""

    def __enter__(self):
        _tls.depth = getattr(_tls, "depth", 0) + 1
        with _nesting_lock:
            nesting[0] += 1

    def __exit__(self, *exc):
        _tls.depth -= 1
        with _nesting_lock:
            nesting[0] -= 1


def plain_reason() -> str | None:
    """Inside :class:`Plain` on this thread: why graphed calls there run plain (None outside)."""
    return getattr(_tls, "plain", None)


class Plain(Nested):
    """A piecewise root's forward run with every piece plain (its plan's trial, see _trial):
    as inside a warm-up, graphed calls there run their plain forward, and each is counted
    under ``reason`` (a warm-up's or capture's are part of another call, and not counted)."""

    def __init__(self, reason: str):
        self.reason = reason
        self.outer: str | None = None

    def __enter__(self):
        self.outer = getattr(_tls, "plain", None)
        _tls.plain = self.reason
        super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        _tls.plain = self.outer
