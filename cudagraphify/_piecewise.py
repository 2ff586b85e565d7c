"""Piecewise graphing: when a module cannot be captured whole, graph its largest safe parts.

The engine probes a module's first call of a signature (:class:`~cudagraphify._probe.Probe`).
Findings (unsafe ops), op sequences that differ between the warm-up and the capture
(data-dependent Python control flow), or a failed capture make the module unsafe; it then runs
eagerly for that signature, and its largest safe submodules are graphified (same options): they
capture and replay on their own, with their own guards, and can in turn go piecewise if their own
capture fails. The decision is remembered, so the next call does not try again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ._cache import EagerEntry
from ._errors import warn_once
from ._policy import default_policy
from ._probe import Finding, Probe, control_flow_findings, plan_pieces

if TYPE_CHECKING:
    from ._engine import GraphedState

__all__ = ["PiecewiseEntry", "new_probe", "probed", "go_piecewise", "sequence_findings"]


class PiecewiseEntry(EagerEntry):
    """A signature whose module runs eagerly while the listed submodules are graphed."""

    __slots__ = ("findings", "pieces")

    def __init__(self, reason: str, owner, findings: dict[str, list[Finding]], pieces: list[str]):
        super().__init__(reason, owner)
        self.findings = findings
        self.pieces = pieces


def new_probe(state: "GraphedState", *, thunder: bool | None = None) -> Probe | None:
    mode = state.options.probe
    if not mode:
        return None
    policy = state.options.op_policy or default_policy
    use_thunder = (mode == "thunder") if thunder is None else thunder
    return Probe(state.statics.root, policy, thunder=use_thunder, accel=state.accel)


def probed(probe: Probe | None, fn: Callable) -> Callable:
    """``fn`` run with ``probe`` active (just ``fn`` without a probe)."""
    if probe is None:
        return fn

    def run(*args, **kwargs):
        with probe:
            return fn(*args, **kwargs)

    return run


def sequence_findings(first: Probe, second: Probe) -> dict[str, list[Finding]]:
    why = "the op sequence differs between two runs (data-dependent Python control flow)"
    return {p: [f] for p, f in control_flow_findings(first, second, why).items()}


def go_piecewise(state: "GraphedState", cache, key, findings: dict[str, list[Finding]],
                 ran: set[str], result: Any) -> Any:
    """Remember that ``key`` runs piecewise (or eagerly, for a function); return ``result``."""
    first = next(iter(f for fs in findings.values() for f in fs))
    root = state.statics.root
    if root is None:
        return state._decide_eager(cache, key, f"unsafe op {first}", lambda: result)
    pieces = plan_pieces(root, set(findings), ran)
    installed = state.install_pieces(pieces) if state.install_pieces else []
    paths = [p for p in findings if p != ""] or ["(root)"]
    reason = (f"piecewise: {len(pieces)} submodule(s) graphed, unsafe in {', '.join(paths)}: "
              f"{first}")
    state.pieces.extend(m for m in installed if all(m is not x for x in state.pieces))
    state.last_plan = (findings, pieces)
    cache.put(key, PiecewiseEntry(reason, state, findings, pieces))
    state.eager_calls[reason] += 1
    warn_once(state._warned, state.name, reason)
    return result
