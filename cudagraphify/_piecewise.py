"""Piecewise graphing: when a module cannot be captured whole, graph its largest safe parts.

The first call of a signature is probed (:class:`~cudagraphify._probe.Probe`). Findings (unsafe
ops, submodules whose hooks must run on every call, tensors read from outside), op sequences
that differ between the warm-up and the capture (data-dependent Python control flow), or a
failed capture make the module unsafe; it then runs eagerly for that signature, and its largest
safe submodules are graphified (same run options): they capture and replay on their own, with
their own guards, and can in turn go piecewise. The engine remembers the decision in a
:class:`PiecewiseEntry`, so the next call does not try again. This module only plans.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ._cache import EagerEntry
from ._policy import default_policy
from ._probe import Finding, Probe, control_flow_findings, plan_pieces

if TYPE_CHECKING:  # pragma: no cover - annotations only
    import torch

__all__ = ["PiecewiseEntry", "new_probe", "write_tracker", "probed", "plan",
           "sequence_findings"]


class PiecewiseEntry(EagerEntry):
    """A signature whose module runs eagerly while the listed submodules are graphed."""

    __slots__ = ("findings", "pieces", "chained_once")

    def __init__(self, reason: str, owner, findings: dict[str, list[Finding]], pieces: list[str],
                 state=None, flags=None):
        super().__init__(reason, owner, state, flags)
        self.findings = findings
        self.pieces = pieces
        self.chained_once = False  # whether a run of it called its pieces (see _pieces.keyed_root)


def new_probe(state, *, thunder: bool | None = None) -> Probe | None:
    """A probe for ``state``'s callable (None when its ``probe`` option is off)."""
    mode = state.options.probe
    if not mode:
        return None
    policy = state.options.op_policy or default_policy
    use_thunder = (mode == "thunder") if thunder is None else thunder
    return Probe(state.statics.root, policy, thunder=use_thunder, accel=state.accel)


def write_tracker(state, known: set[int], saved: dict, versions: dict,
                  weights: set[int], layouts: dict | None = None) -> Probe | None:
    """A probe of what a run beyond the real call writes in memory from before the call (None
    when ``state``'s probe is off): the storages ``saved`` holds no entry for and ``known``
    does not name (the run's copies of the inputs) are copied into it before their first
    write, the versions of the tensors written through into ``versions`` (see
    ``Probe.saved``); the ``weights`` only where an op writes them in place; the layouts of
    the tensors its ops take into ``layouts`` (``Probe.layouts``). It screens nothing: no op
    is recorded or tagged, no module path kept."""
    if not state.options.probe:
        return None
    probe = Probe(None, state.options.op_policy or default_policy, accel=state.accel)
    probe.screens = False
    probe.known, probe.written, probe.locate = known, set(), False
    probe.saved, probe.versions, probe.weights = saved, versions, weights
    probe.layouts = layouts
    return probe


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


def plan(root: "torch.nn.Module | None", findings: dict[str, list[Finding]],
         ran: set[str]) -> tuple[str, list[str]]:
    """The reason a signature runs piecewise (or, for a function, eagerly) and the submodule
    paths to graph (none for a function)."""
    first = next(iter(f for fs in findings.values() for f in fs))
    if root is None:
        return f"unsafe op {first}", []
    pieces = plan_pieces(root, set(findings), ran)
    paths = [p for p in findings if p != ""] or ["(root)"]
    return (f"piecewise: {len(pieces)} submodule(s) graphed, unsafe in {', '.join(paths)}: "
            f"{first}"), pieces

