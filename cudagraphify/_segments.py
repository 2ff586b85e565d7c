"""Where a forward is cut: the runs of graphable calls between the calls the policy refuses.

A probe run with its ``trace`` on lists every torch call of the forward in order, with the
module that made it, the user's file:line and, for a refused call, its Finding. The runs of
calls between the refused ones are what a graph could hold as a whole (the issue's
"segments"); today cudagraphify graphs the largest safe *submodules* instead (pieces), so a run
that spans module boundaries, or lies in the refusing module's own code, is not graphed.
``explain`` with example inputs reports the runs, to show where a forward is cut and why.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ._probe import Finding, Probe, _user_frame

__all__ = ["Run", "runs", "TracingProbe"]


class TracingProbe(Probe):
    """A probe that also keeps every call it records, in order, in :attr:`trace`: (name,
    module path, the user's file:line, its Finding where the policy refused it). Slower than
    the probe (it looks up the user's frame of every call): for ``explain`` only."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trace: list[tuple[str, str, str, Finding | None]] = []

    def record(self, func: Any, args: tuple, kwargs: dict, name: str | None = None) -> None:
        found = len(self.findings)
        super().record(func, args, kwargs, name)
        frame = _user_frame()
        self.trace.append((self.sequences[self.path][-1], self.path,
                           f"{frame[0]}:{frame[1]}" if frame else "?",
                           self.findings[found] if len(self.findings) > found else None))


@dataclasses.dataclass(frozen=True)
class Run:
    """Calls ``start`` to ``end - 1`` of a forward's trace: no call among them is refused."""

    start: int
    end: int
    first: str  # file:line of its first call
    last: str  # and of its last
    modules: tuple[str, ...]  # the module paths its calls were made in, in order of first call
    cut_by: Finding | None  # the refused call after it (None: the forward ends)

    @property
    def calls(self) -> int:
        return self.end - self.start

    def to_dict(self) -> dict:
        return {"start": self.start, "end": self.end, "calls": self.calls, "first": self.first,
                "last": self.last, "modules": list(self.modules),
                "cut_by": self.cut_by.to_dict() if self.cut_by is not None else None}

    def __str__(self) -> str:
        where = ", ".join(m or "(root)" for m in self.modules)
        cut = f"; then {self.cut_by}" if self.cut_by is not None else ""
        return (f"calls {self.start}-{self.end - 1} ({self.calls}: {self.first} .. "
                f"{self.last}; in {where}){cut}")


def runs(trace: list) -> list[Run]:
    """The runs of unrefused calls of ``trace`` (a probe's: (name, module path, file:line,
    Finding or None) per call), each with the refused call that ends it. Refused calls that
    follow each other make no empty runs."""
    out: list[Run] = []
    start = 0
    for i, (_, _, _, finding) in enumerate(trace + [(None, None, None, None)]):
        if finding is None and i < len(trace):
            continue
        if i > start:
            calls = trace[start:i]
            modules = tuple(dict.fromkeys(path for _, path, _, _ in calls))
            out.append(Run(start, i, calls[0][2], calls[-1][2], modules, finding))
        start = i + 1
    return out
