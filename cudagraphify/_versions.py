"""The version counters a graph's replay moves and its backward checks, on the tensor objects
the user holds now.

Eager in-place ops move the version counters of what they write, and autograd checks, at
backward, those of what it saved. A replay runs no such op, so a graph moves by hand the
counters its capture's run moved (parameters, buffers, tensors read from outside), by as much,
and a training graph's backward checks those of the buffers and frozen parameters autograd
saves (see :mod:`._training`). Which tensor objects those are is decided here:

- A parameter or buffer is kept by its slot among the statics (the module's dict and name
  that hold it, ``StaticState._slots``), not as the object met at capture: rebound to another tensor object on the same memory
  (``m.b = m.b.data``, ``load_state_dict(assign=True)`` of tensors over that memory), it keeps
  its graphs (the same addresses), but the object, and its counter, is another. After each
  rescan of the statics, which is the only way such a rebinding is seen, the next replay finds
  the objects again (:meth:`Counters.resolve`, off the fast path: a rescan makes it miss). A
  tensor read from outside (a plain attribute, a closure, a global) is kept as it is: its
  guard holds it by identity.
- Tensors that share one counter (a buffer and a view of it, a ``detach()``) have it moved
  once, not once each. Which do is found by moving one and looking at the others
  (:func:`counter_groups`), at capture and after a rescan; where that changed (the base of a
  view rebound), what the capture's run moved cannot be told apart per counter any more: the
  graph is dropped, and the next call captures again.
- The statics a training graph's backward checks are those whose counter a tensor autograd
  saved shares (:func:`sharing`, found the same way), not every one over its memory: a buffer
  registered as a view of another's ``.data`` has a counter of its own.
"""

from __future__ import annotations

import weakref

import torch

from ._signature import storage_of
from ._writes import set_version

__all__ = ["Counters", "counter_groups", "moving", "sharing"]

# (torch.autograd.graph.increment_version's own call: a tuple, each tensor moved once per time
# it is in it; one C call for a whole replay's moves)
_increment_version = torch._C._increment_version

# Why a graph is dropped when its statics' counters are shared otherwise than at capture.
REGROUPED = ("a parameter or buffer the forward writes, or its backward checks, was rebound "
             "to a tensor object that "
             "shares its version counter otherwise than at capture (the base of a registered "
             "view rebound, m.base = m.base.data): the graph's version moves no longer fit; "
             "it is captured again")


class Counters:
    """Where one graph's version counters are: ``written``, (tensor, count) per counter its
    replay moves; ``saved``, the tensors its backward checks (a training graph's).

    ``moves`` are (tensor, count) as the capture's run moved them, ``saved`` the tensors; each
    of them that is one of ``statics.tensors`` is found there again after a rescan
    (:meth:`stale`, :meth:`resolve`)."""

    __slots__ = ("written", "saved", "scan", "_bumps", "_statics", "_moves", "_saved",
                 "_groups", "_saved_groups")

    def __init__(self, statics, moves: list[tuple[torch.Tensor, int]],
                 saved: list[torch.Tensor]):
        at = {id(t): key for key, t in zip(_keys(statics), statics.tensors)}
        # (its slot among the statics, the dict and name that hold it, or None where it is
        # kept as it is; the tensor now)
        self._moves = [(at.get(id(t)), t, n) for t, n in moves]
        self._saved = [(at.get(id(t)), t) for t in saved]
        self._statics = weakref.ref(statics)  # (an entry must not keep its owner's modules)
        self.scan = statics.scans
        self._groups = counter_groups([t for _, t, _ in self._moves])
        self._saved_groups = counter_groups(self.saved_now())
        self._settle()

    def _settle(self) -> None:
        groups = self._groups
        self.written = tuple((t, n) for k, (_, t, n) in enumerate(self._moves) if groups[k] == k)
        self._bumps = tuple(t for t, n in self.written for _ in range(n))
        self.saved = self.saved_now()  # (a new list: a pending backward keeps its own)

    def saved_now(self) -> list[torch.Tensor]:
        return [t for _, t in self._saved]

    def stale(self) -> bool:
        """Whether the statics were rescanned since the objects were found."""
        statics = self._statics()
        return statics is not None and statics.scans != self.scan

    def resolve(self) -> str | None:
        """Find the statics' objects again (after a rescan that kept the graph: each slot
        holds a tensor on the memory it held). None, or why the graph cannot keep its
        moves."""
        statics = self._statics()
        if statics is None:
            return None
        self.scan = statics.scans
        now = dict(zip(_keys(statics), statics.tensors))

        def find(key, t):
            if key is None:
                return t
            new = now.get(key)
            # (on the memory it held, with a counter: not an inference tensor)
            return new if new is not None and new.data_ptr() == t.data_ptr() \
                and not new.is_inference() else None

        moves = [(i, find(i, t), n) for i, t, n in self._moves]
        saved = [(i, find(i, t)) for i, t in self._saved]
        if any(t is None for _, t, _ in moves) or any(t is None for _, t in saved):
            return ("a parameter or buffer whose version counter the graph moves or checks "
                    "is no longer in its module's slot, or has no counter (an "
                    "inference tensor): it is captured again")
        # (the saved ones too: one that shared a saved tensor's counter through another
        # static, a view buffer, may not any more, and eager's backward would not check it)
        if counter_groups([t for _, t, _ in moves]) != self._groups \
                or counter_groups([t for _, t in saved]) != self._saved_groups:
            return REGROUPED
        self._moves, self._saved = moves, saved
        self._settle()
        return None

    def move(self) -> None:
        """Move the counters as the capture's run did (after a replay)."""
        if self._bumps:
            _increment_version(self._bumps)


def moving(replay, counters: Counters):
    """``replay`` followed by :meth:`Counters.move` (an inference graph's replay, whichever
    path calls it: the fast path too)."""
    def run():
        replay()
        bumps = counters._bumps  # (``move``, inline: a frame less on every replay)
        if bumps:
            _increment_version(bumps)
    return run


def _keys(statics) -> list[tuple[int, str]]:
    """Each of ``statics.tensors``' slot: its dict (a module's ``_parameters`` or ``_buffers``,
    by identity: the statics hold their modules) and name. By slot, not by position: two
    buffers over one memory and layout (``m.c = m.a.data``), registered again in another order,
    keep every position's layout, not its object."""
    return [(id(d), n) for d, n in statics._slots]


def counter_groups(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    """For each of ``tensors``, the position of the first of them that shares its version
    counter (its own where none does before it)."""
    groups = list(range(len(tensors)))
    for same in _by_storage(tensors).values():
        if len(same) < 2:
            continue
        for a, k in enumerate(same):
            if groups[k] != k:
                continue
            rest = [j for j in same[a + 1:] if groups[j] == j]
            if not rest:
                break
            for j, moved in zip(rest, _move_with(tensors[k], [tensors[j] for j in rest])):
                if moved:
                    groups[j] = k
    return tuple(groups)


def sharing(tensors: list[torch.Tensor], others: list[torch.Tensor]) -> list[torch.Tensor]:
    """Those of ``tensors`` whose version counter one of ``others`` shares (the buffers whose
    versions autograd checks for the tensors it saved: the buffer itself, a view of it, a
    ``detach()``; not a ``.data``, which has a counter of its own)."""
    by_storage = _by_storage(others)
    out = []
    for t in tensors:
        same = by_storage.get(storage_of(t))
        if same is not None and any(_move_with(t, [others[j] for j in same])):
            out.append(t)
    return out


def _by_storage(tensors: list[torch.Tensor]) -> dict[int, list[int]]:
    """Positions of ``tensors`` by storage: only tensors over one storage can share a counter
    (a view, a ``detach()``). (Empty ones, and those with no storage of their own, are left
    out.)"""
    out: dict[int, list[int]] = {}
    for k, t in enumerate(tensors):
        ptr = storage_of(t)
        if ptr:
            out.setdefault(ptr, []).append(k)
    return out


def _move_with(t: torch.Tensor, others: list[torch.Tensor]) -> list[bool]:
    """Whether each of ``others`` shares ``t``'s version counter: ``t``'s is moved, those whose
    version moved with it share it; then it is put back."""
    before, seen = t._version, [o._version for o in others]
    _increment_version((t,))
    try:
        return [o._version != v for o, v in zip(others, seen)]
    finally:
        set_version(t, before)
