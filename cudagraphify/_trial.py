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

Each piece is judged alone, right after its capture, timed from one synchronisation to the
next; in its forward it runs among the others, without them. On the H200 that measure kept
one-kernel pieces that cost a forward more than they saved (the inline-attention GPT: 1.15x
eager with them, 1.04x with every piece given back). So once the pieces settled, the root
itself is judged (:class:`PlanTrial`): its forward as planned against its forward with every
piece run as plain PyTorch, in turn; where the plan is not faster, every piece is given back.

Timing needs a backend with a ``clock(device)`` (the CUDA one); the CPU test double has none
unless a test gives it one.
"""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["Trial", "PlanTrial", "SAMPLES", "MARGIN", "PLAN_PAIRS"]

SAMPLES = 3  # timed calls of each kind per piece
# timed calls and trials begun, any piece, any thread: a timing of a forward that runs pieces
# (segments against the forward without them) is void when this moved while it ran
activity = [0]
MARGIN = 1.1  # a clear difference: one run this much faster than the other
# moves when a piece is given back or a callable's state is made (a module graphified anew),
# any callable: a plan that chains pieces looks again whether any of its pieces may still
# replay a graph when this moved (see _pieces.PieceRuns.chained)
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


PLAN_TRIAL = True  # roots' plan trials on (off only in tests of one piece's trial)
PLAN_PAIRS = 4  # timed pairs of a root's forwards (after an untimed first pair)
MAX_PLAN_VOID = 32  # forwards timed again because pieces were still timing themselves in them


class PlanTrial:
    """A piecewise root's forwards, once its pieces settled: as planned (its pieces graphed and
    chained) and plain (every piece run as plain PyTorch), in turn, each timed from a device
    synchronisation to the next.

    The pairs alternate their order (plan first, then plain first, ...), so that a trend in the
    host's speed over the trial weighs on both alike; the first pair is not counted (warm-up).
    A forward during which a piece was still timed or captured (:data:`activity` moved) is
    timed again, up to :data:`MAX_PLAN_VOID` times. Only calls like the first one timed are
    (the same shape and dtype of the first tensor argument: one prefill among decode steps
    would weigh as an outlier). The verdict takes the middle of the pairs'
    ratios: one disturbed pair does not decide it."""

    __slots__ = ("clock", "plan", "plain", "voided", "key")

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.key = None  # the kind of call timed (its first tensor's shape and dtype)
        self.plan: list[float] = []
        self.plain: list[float] = []
        self.voided = 0

    def plain_next(self) -> bool:
        """Whether the next forward runs plain."""
        n = len(self.plan) + len(self.plain)
        return (n % 2 == 1) != ((n // 2) % 2 == 1)

    def timed(self, run: Callable[[], object], plain: bool) -> object:
        activity[0] += 1  # (an outer root's forward that runs this one is timed again)
        before = activity[0]
        start = self.clock()
        out = run()
        took = self.clock() - start
        if activity[0] != before and self.voided < MAX_PLAN_VOID:
            self.voided += 1  # (not the plan's steady cost: timed again)
        else:
            (self.plain if plain else self.plan).append(took)
        return out

    @property
    def done(self) -> bool:
        return min(len(self.plan), len(self.plain)) > PLAN_PAIRS

    def medians(self) -> tuple[float, float, float]:
        """The middle of the counted pairs: seconds a forward with the plan, without it, and
        the middle of their ratios."""
        pairs = list(zip(self.plan[1:], self.plain[1:]))
        ratios = sorted(a / b if b > 0 else (1.0 if a <= 0 else float("inf")) for a, b in pairs)
        mid = len(ratios) // 2
        ratio = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
        return sorted(a for a, _ in pairs)[mid], sorted(b for _, b in pairs)[mid], ratio

    def verdict(self) -> str | None:
        """Why the pieces are given back (the forward is not faster with them), or None."""
        plan, plain, ratio = self.medians()
        if ratio < 1.0:
            return None
        return (f"piece given back: the forward that runs it is not faster with its pieces "
                f"graphed ({plan * 1e6:.0f} µs) than with all of them plain ({plain * 1e6:.0f} "
                f"µs; {ratio:.2f}x, timed after the pieces' own trials)")

    def summary(self) -> str:
        """The verdict in one line, for ``explain``."""
        plan, plain, ratio = self.medians()
        kept = "kept" if ratio < 1.0 else "given back"
        return (f"plan timed as a whole: its pieces {kept} ({plan * 1e6:.0f} µs a forward with "
                f"them, {plain * 1e6:.0f} µs with all of them plain; {ratio:.2f}x)")
