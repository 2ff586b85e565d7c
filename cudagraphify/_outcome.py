"""What a signature's first call decided (:class:`Outcome`), and the kinds of decision."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._guards import FlagsGuard, StateGuard
from ._probe import Finding

__all__ = ["Outcome", "GRAPHED", "EAGER", "PIECEWISE", "DEFERRED"]

GRAPHED, EAGER, PIECEWISE, DEFERRED = "graphed", "eager", "piecewise", "deferred"

@dataclass
class Outcome:
    """What a first call decided. ``kind`` is one of GRAPHED, EAGER, PIECEWISE, DEFERRED."""

    kind: str
    result: Any
    reason: str = ""
    entry: Any = None  # GRAPHED: the CapturedGraph or TrainingGraph
    findings: dict[str, list[Finding]] = field(default_factory=dict)  # PIECEWISE
    ran: set[str] = field(default_factory=set)  # PIECEWISE: module paths that ran
    guard: StateGuard | None = None  # the module state the decision depends on
    flags: FlagsGuard | None = None
    replay: bool = False  # GRAPHED: replay once now (a chaining region hands out aliases)
    shared: bool = False  # GRAPHED: made from a share_graph template
    remember: bool = True  # EAGER: decided for the signature (False: for this call only)
    quiet: bool = False  # DEFERRED: an expected first call (no warning)
    states: list = field(default_factory=list)  # GRAPHED: static state it is keyed to
    set_up: tuple = ()  # EAGER: leaves of the static states this call set up (allocated)
