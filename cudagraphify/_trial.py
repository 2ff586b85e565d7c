"""Pieces that pay: a piecewise plan's graphed piece is timed against its eager run.

A piecewise plan graphs the safe submodules of a forward that cannot be one graph. A piece of
one or two kernels costs more as a graphed call (copy-in, replay, clone, guards) than its
eager run: 73 such pieces made a model 1.5x slower than eager on the H200. So a piece's first
calls after its capture alternate between its graph and its forward run eagerly, each timed
from a device synchronisation to the next (host and device work together, as the call costs in
a forward that waits on the host anyway), and on the host alone (until the call returns: what
it costs a forward whose kernels keep up with its Python). After :data:`SAMPLES` of each, a
piece is given back when its graph is slower than its eager run by more than :data:`MARGIN`,
or when it is faster by less than that margin both end to end and on the host (a one-kernel
piece: its copy-in, replay and clone cost about what launching its kernel does; a tie goes to
eager). A graph's turn replays it as the calls after the trial would, through the fast path
with its per-call checks, where the call can have one. A given-back piece then runs
as plain PyTorch from then on, its graphs released, the reason in ``stats().eager_calls``;
where the piece has graphs of other signatures (a prefill's beside a decode step's), only that
signature runs eagerly from then on.

Timing needs a backend with a ``clock(device)`` (the CUDA one); the CPU test double has none
unless a test gives it one.
"""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["Trial", "SAMPLES", "MARGIN"]

SAMPLES = 3  # timed calls of each kind per piece
# timed calls and trials begun, any piece, any thread: a timing of a forward that runs pieces
# (segments against the forward without them) is void when this moved while it ran
activity = [0]
MARGIN = 1.1  # a clear difference: one run this much faster than the other
# moves when a piece is given back or a callable's state is made (a module graphified anew),
# any callable: a plan that chains pieces looks again whether any of its pieces may still
# replay a graph when this moved (see GraphedState.chained)
pieces_epoch = [0]
host_clock = time.perf_counter  # seconds on the host (a test's fake clock replaces it)


class Trial:
    """The timed first replays of one graph of a piece, and its eager runs between them."""

    __slots__ = ("clock", "host", "graph", "eager", "graph_host", "eager_host", "fast")

    def __init__(self, clock: Callable[[], float]):
        activity[0] += 1
        self.clock = clock  # seconds, after the device is done with what was queued
        self.host = host_clock
        self.graph: list[float] = []  # seconds from a synchronisation to the next
        self.eager: list[float] = []
        self.graph_host: list[float] = []  # seconds until the call returned
        self.eager_host: list[float] = []
        self.fast = None  # the fast path its graph's turns replay through (see _engine)

    def eager_next(self) -> bool:
        """Whether the next call runs eagerly (they alternate, the graph first)."""
        return len(self.eager) < len(self.graph)

    def timed(self, run: Callable[[], object], eager: bool) -> object:
        activity[0] += 1
        start = self.clock()
        host = self.host()
        out = run()
        host = self.host() - host
        (self.eager if eager else self.graph).append(self.clock() - start)
        (self.eager_host if eager else self.graph_host).append(host)
        return out

    def untime(self, eager: bool) -> None:
        """Forget the last sample of that kind (a call that did not run what it timed)."""
        (self.eager if eager else self.graph).pop()
        (self.eager_host if eager else self.graph_host).pop()

    @property
    def done(self) -> bool:
        return len(self.graph) >= SAMPLES and len(self.eager) >= SAMPLES

    def verdict(self) -> str | None:
        """Why the piece is given back (its graph costs more), or None (it keeps its graph)."""
        graph, eager = min(self.graph), min(self.eager)
        if eager * MARGIN < graph:
            return (f"piece given back: its graph costs more than its eager run "
                    f"({graph * 1e6:.0f} vs {eager * 1e6:.0f} µs a call, timed on its first "
                    "calls)")
        graph_host, eager_host = min(self.graph_host), min(self.eager_host)
        if graph * MARGIN > eager and graph_host * MARGIN > eager_host:
            # (a tie goes to eager)
            return (f"piece given back: its graph saves under {MARGIN - 1:.0%} of its eager "
                    f"run, end to end ({graph * 1e6:.0f} vs {eager * 1e6:.0f} µs a call) and "
                    f"on the host ({graph_host * 1e6:.1f} vs {eager_host * 1e6:.1f} µs), timed "
                    "on its first calls")
        return None
