"""Bucketing a leading dimension (serving): :func:`bucketed`.

A server that sees every batch size from 1 to 64 would need 64 graphs. Bucketed, a call of
batch ``n`` is padded to the next size that has a graph (``sizes``), the graph runs, and the
outputs are sliced back to ``n`` rows. That is only right where rows do not interact: no
reduction or normalisation over the batch, no attention across it, nothing written that the
padding rows would touch. Nothing can prove that for a forward, so each bucket is checked on
its first call: the call runs eagerly on its own rows (that result is returned), then padded
through the graph, and the two must agree (within the tolerance of ``torch.testing``'s
defaults for the dtype: a padded shape may pick another kernel); outputs must keep the batch in
the same dimension. A bucket that fails runs unpadded from then on (graphed at its own size
by ``graphify``, or eagerly), with one warning; a forward that writes its arguments,
parameters or buffers is never bucketed (the check would run it twice).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Hashable, Iterable

import torch
import torch.utils._pytree as pytree

from ._errors import CudagraphifyUsageError, CudagraphifyWarning
from ._nested import Nested

__all__ = ["Bucketed", "bucketed"]


class Bucketed:
    """A callable that pads the ``dim`` of its tensor arguments to the next of ``sizes`` and
    slices the outputs back (see :func:`bucketed`).

    ``verified``: the buckets checked against eager (a key per bucket size and the other
    dimensions of the arguments); ``refused``: the same keys, with why they run unpadded."""

    def __init__(self, target: Callable, sizes: list[int], dim: int):
        self._target = target
        self.sizes = sizes
        self.dim = dim
        self.verified: set[Hashable] = set()
        self.refused: dict[Hashable, str] = {}
        self.padded_calls = 0  # calls that ran padded to a bucket (checks included)

    def __repr__(self) -> str:
        return f"bucketed({self._target!r}, sizes={self.sizes}, dim={self.dim})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        n = self._rows(leaves)
        bucket = next((s for s in self.sizes if s >= n), None) if n is not None else None
        if bucket is None or bucket == n:
            return self._target(*args, **kwargs)  # its own size (or no tensor): as it is
        key = (bucket, spec, tuple(_leaf_key(t, self.dim) for t in leaves),
               torch.is_grad_enabled())
        if key in self.refused:
            return self._target(*args, **kwargs)
        padded = [self._pad(t, bucket) if isinstance(t, torch.Tensor) else t for t in leaves]
        if key not in self.verified:
            return self._check(key, bucket, n, leaves, padded, spec)
        a, kw = pytree.tree_unflatten(padded, spec)
        self.padded_calls += 1
        return self._slice(self._target(*a, **kw), bucket, n)

    # -- the rows of a call ------------------------------------------------------------------

    def _rows(self, leaves: list) -> int | None:
        """The size of ``dim`` shared by every tensor argument (None: no tensor)."""
        rows = {t.shape[self.dim] for t in leaves if isinstance(t, torch.Tensor)
                and t.dim() > self.dim}
        if any(isinstance(t, torch.Tensor) and t.dim() <= self.dim for t in leaves):
            raise CudagraphifyUsageError(
                f"bucketed(dim={self.dim}): every tensor argument must have a dimension "
                f"{self.dim} (the batch), got shapes "
                f"{[tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor)]}")
        if len(rows) > 1:
            raise CudagraphifyUsageError(
                f"bucketed(dim={self.dim}): tensor arguments disagree on the batch size "
                f"(dimension {self.dim}): {sorted(rows)}; every tensor argument is padded")
        return next(iter(rows), None)

    def _pad(self, t: torch.Tensor, bucket: int) -> torch.Tensor:
        """``t`` with its last row repeated up to ``bucket`` rows (real values: no inf or NaN
        a zero row could make)."""
        n = t.shape[self.dim]
        last = t.narrow(self.dim, n - 1, 1)
        shape = list(t.shape)
        shape[self.dim] = bucket - n
        return torch.cat([t, last.expand(shape)], dim=self.dim)

    def _slice(self, out: Any, bucket: int, n: int) -> Any:
        leaves, spec = pytree.tree_flatten(out)
        return pytree.tree_unflatten(
            [t.narrow(self.dim, 0, n) if isinstance(t, torch.Tensor) else t for t in leaves],
            spec)

    # -- a bucket's first call ---------------------------------------------------------------

    def _check(self, key, bucket: int, n: int, leaves: list, padded: list, spec) -> Any:
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        state = _written_state(self._target, leaves)
        with Nested():  # eagerly, on the call's own rows: this call's result
            want = self._target(*args, **kwargs)
        wrote = state()
        if wrote:
            return self._refuse(key, want, f"forward writes {wrote}: a padded call would "
                                "write it too (and a check runs forward twice)")
        a, kw = pytree.tree_unflatten(padded, spec)
        got = self._target(*a, **kw)
        self.padded_calls += 1
        why = _disagree(want, got, self.dim, bucket, n)
        if why:
            return self._refuse(key, want, why)
        self.verified.add(key)
        return want

    def _refuse(self, key, result: Any, why: str) -> Any:
        self.refused[key] = why
        warnings.warn(f"cudagraphify: bucketed: batch {key[0]} bucket runs unpadded: {why}",
                      CudagraphifyWarning, stacklevel=3)
        return result


def _leaf_key(leaf: Any, dim: int) -> Hashable:
    """What a bucket's check holds for, of one argument: a tensor's other dimensions, dtype,
    device and grad; any other value itself (by identity where it cannot be hashed)."""
    if isinstance(leaf, torch.Tensor):
        return (leaf.shape[:dim] + leaf.shape[dim + 1:], leaf.dtype, leaf.device,
                leaf.requires_grad)
    try:
        hash(leaf)
    except TypeError:
        return ("unhashable", id(leaf))
    return (type(leaf), leaf)


def _written_state(target: Callable, leaves: list) -> Callable[[], str]:
    """A function that says which argument, parameter or buffer was written since it was made
    ("" when none), by their version counters."""
    module = target if isinstance(target, torch.nn.Module) else None
    named = [(f"argument {i}", t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
    if module is not None:
        named += [(f"parameter {k}", t) for k, t in module.named_parameters()]
        named += [(f"buffer {k}", t) for k, t in module.named_buffers()]
    versions = [t._version for _, t in named]
    return lambda: next((name for (name, t), v in zip(named, versions) if t._version != v), "")


def _disagree(want: Any, got: Any, dim: int, bucket: int, n: int) -> str:
    """Why the padded call's outputs ``got`` (``bucket`` rows) are not the unpadded ``want``
    (``n`` rows) ("" when they agree)."""
    w, wspec = pytree.tree_flatten(want)
    g, gspec = pytree.tree_flatten(got)
    if wspec != gspec:
        return "the padded call returns another structure"
    for i, (a, b) in enumerate(zip(w, g)):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return f"output {i} is a tensor in one call only"
        if not isinstance(a, torch.Tensor):
            if a != b:
                return f"output {i} differs ({a!r} vs {b!r} padded)"
            continue
        if b.dim() <= dim or b.shape[dim] != bucket or a.shape[dim] != n:
            return (f"output {i} does not keep the batch in dimension {dim} (shape "
                    f"{tuple(a.shape)}, padded {tuple(b.shape)}): rows interact")
        try:
            torch.testing.assert_close(b.narrow(dim, 0, n), a, equal_nan=True)
        except AssertionError as e:
            first = str(e).strip().splitlines()
            return (f"output {i} differs from eager when padded ({first[0] if first else ''}): "
                    "rows interact")
    return ""


def bucketed(target: Callable, sizes: Iterable[int], *, dim: int = 0) -> Bucketed:
    """Call ``target`` (a graphified module or function) through buckets of a leading
    dimension: a call whose tensor arguments have ``n`` rows in ``dim`` is padded (the last row
    repeated) to the smallest of ``sizes`` that is at least ``n``, and every tensor output is
    sliced back to ``n`` rows. A call of a size in ``sizes``, or larger than all, runs as it is.

    Valid only where rows do not interact (each output row depends on its input row alone):
    each bucket's first call checks it, running the call eagerly on its own rows (its result is
    the one returned) and padded through the graph, and comparing (``torch.testing``'s
    tolerances for the dtype). A bucket that fails, or a forward that writes its arguments,
    parameters or buffers, runs unpadded from then on, with a warning (``.refused`` says why).
    Every tensor argument is padded: pass other tensors as attributes or close over them.

    Use :func:`capture_sizes` with the same ``sizes`` to capture the buckets up front.
    """
    if not callable(target):
        raise CudagraphifyUsageError(f"bucketed: target must be callable, got "
                                     f"{type(target).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
        raise CudagraphifyUsageError(f"bucketed: dim must be a non-negative int, got {dim!r}")
    from ._sizes import _sizes

    return Bucketed(target, sorted(_sizes(sizes)), dim)
