"""Pieces that pay: a piecewise plan's graphed piece is timed against its eager run.

A piecewise plan graphs the safe submodules of a forward that cannot be one graph. A piece of
one or two kernels costs more as a graphed call (copy-in, replay, clone, guards) than its
eager run: 73 such pieces made a model 1.5x slower than eager on the H200. So a piece's first
calls after its capture alternate between its graph and its forward run eagerly, each timed
from a device synchronisation to the next (host and device work together, as the call costs in
a forward that waits on the host anyway); after :data:`SAMPLES` of each, a piece whose graph
is slower than its eager run by more than :data:`MARGIN` is given back: it runs as plain
PyTorch from then on, its graphs released, the reason in ``stats().eager_calls``; where the
piece has graphs of other signatures (a prefill's beside a decode step's), only that
signature runs eagerly from then on.

Timing needs a backend with a ``clock(device)`` (the CUDA one); the CPU test double has none
unless a test gives it one.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["Trial", "SAMPLES", "MARGIN"]

SAMPLES = 3  # timed calls of each kind per piece
# timed calls and trials begun, any piece, any thread: a timing of a forward that runs pieces
# (segments against the forward without them) is void when this moved while it ran
activity = [0]
MARGIN = 1.1  # eager must be this much faster for a piece to be given back (ties keep graphs)


class Trial:
    """The timed first replays of one graph of a piece, and its eager runs between them."""

    __slots__ = ("clock", "graph", "eager")

    def __init__(self, clock: Callable[[], float]):
        activity[0] += 1
        self.clock = clock  # seconds, after the device is done with what was queued
        self.graph: list[float] = []
        self.eager: list[float] = []

    def eager_next(self) -> bool:
        """Whether the next call runs eagerly (they alternate, the graph first)."""
        return len(self.eager) < len(self.graph)

    def timed(self, run: Callable[[], object], eager: bool) -> object:
        activity[0] += 1
        start = self.clock()
        out = run()
        (self.eager if eager else self.graph).append(self.clock() - start)
        return out

    @property
    def done(self) -> bool:
        return len(self.graph) >= SAMPLES and len(self.eager) >= SAMPLES

    def verdict(self) -> str | None:
        """Why the piece is given back (its graph costs more), or None (it keeps its graph)."""
        graph, eager = min(self.graph), min(self.eager)
        if eager * MARGIN >= graph:
            return None
        return (f"piece given back: its graph costs more than its eager run ({graph * 1e6:.0f} "
                f"vs {eager * 1e6:.0f} µs a call, timed on its first calls)")
