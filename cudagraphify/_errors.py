"""The error and warning types cudagraphify raises, and the one-warning-per-reason helper."""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["CudagraphifyError", "CudagraphifyWarning", "CaptureFailed", "warn_once", "name_of"]


class CudagraphifyError(Exception):
    """Base class of every error cudagraphify raises on its own behalf.

    Exceptions raised by the user's own ``forward`` are never wrapped: they reach the caller
    unchanged.
    """


class CudagraphifyUsageError(CudagraphifyError, TypeError):
    """Bad input to a cudagraphify API (wrong target, wrong option)."""


class CudagraphifyWarning(UserWarning):
    """Emitted once per graphed callable and reason when a call runs eagerly."""


class CaptureFailed(CudagraphifyError):
    """The CUDA graph capture itself failed; the signature falls back to eager.

    Internal: the engine catches it, marks the signature eager and warns once. ``transient``
    failures depend on state outside the forward (an earlier call's autograd graph still alive)
    and are retried on a later call.
    """

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


def warn_once(seen: set, owner: str, reason: str, what: str = "runs eagerly") -> None:
    """Warn that ``owner`` runs eagerly (or ``what`` else) because of ``reason``, once per
    (owner, reason)."""
    if reason in seen:
        return
    seen.add(reason)
    warnings.warn(f"cudagraphify: {owner} {what}: {reason}", CudagraphifyWarning,
                  stacklevel=_user_stacklevel())


_INTERNAL = (os.path.dirname(os.path.abspath(__file__)), os.sep + "wrapt" + os.sep,
             os.path.join("torch", "nn", "modules", "module.py"))


def _user_stacklevel() -> int:
    """The stack level of the first frame outside cudagraphify, wrapt and Module.__call__."""
    frame, level = sys._getframe(1), 1
    while frame is not None and any(p in frame.f_code.co_filename for p in _INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


def name_of(obj) -> str:
    """The name messages give ``obj``: its ``__qualname__`` (a function's, a class's), else
    its class's (a callable object). A ``__getattr__`` of the object's that raises anything
    (an attribute dict's KeyError) counts as no name."""
    try:
        name = getattr(obj, "__qualname__", None)
    except Exception:  # noqa: BLE001 - the user's __getattr__: any error means none
        name = None
    return name if isinstance(name, str) else type(obj).__qualname__
