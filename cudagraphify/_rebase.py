"""Graphs keyed to static state, rebased to another state's memory instead of captured again.

A graph that reads and writes a static state (an HF ``StaticCache``) in place is keyed by the
addresses of its tensors (see :mod:`._state`). ``generate(cache_implementation="static")``
makes a new cache for every call, at new addresses: without this module every ``generate``
captures its decode step again. A *family* is one signature up to those addresses: the same
call, with a state of the same layout (every tensor's shape, stride, dtype, storage size and
offset, its storage's alignment, every other value the state holds) at other addresses.

- The family's first capture is its *template*: captured into the family's memory pool, kept
  readable, owned by the family (the first state's graph replays it).
- A second state of the family is captured too (on the template's static inputs, in the same
  pool), and the two captures are diffed node by node (:func:`~._graphdiff.plan_rebase`, as
  ``share_graph`` does for layers): the plan holds every kernel argument that is an address
  inside the state's storages (a storage of the second state at the template's own address,
  memory of a dead state the allocator handed on, is rebased too, and the plan then proven).
  Bytes that differ and hold no address of memory the forward reads in one capture at
  least (uninitialised tails of kernels' argument structs) are kept, and the plan is then proven
  once: the forward run eagerly on one copy of the state, the template rebased to another,
  bitwise equal (outputs and copies). Any other difference, or a failed proof, refuses the
  state; after three, the family, with the reason (``stats().reasons``).
- Every later state of the family gets the template instantiated with those arguments
  rewritten to its own storages (no capture), while what the template's capture read still
  holds (its module attributes, global flags), the warm-up ran the template's ops, and the
  forward draws no random numbers (a rewritten graph launched by the driver would replay the
  template's draws).

All graphs of a family read the template's static inputs and write its static outputs and
intermediates, so only calls that copy their outputs out (``copy_outputs=True``, outside a
``graph_region``) and write none of their inputs, parameters or buffers use families.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch
import torch.utils._pytree as pytree

from . import _watch
from ._graphdiff import (RebasePlan, Refused, RetargetedRaw, Storages, host_ranges,
                         memory_ranges, plan_rebase, readable_ranges)

__all__ = ["Families", "Family", "StateArg"]

_MAX_FAMILIES = 4  # templates kept per graphed callable (each holds one graph's memory)
_SPARE = 2  # executable graphs of dead states kept per family, to be rewritten
_ATTEMPTS = 3  # states diffed against a family's template before it is refused for good


class StateArg:
    """Where a family's template output held its static state object: the call's own."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


@dataclass
class Family:
    """One signature up to its static states' addresses (see the module docs)."""

    raw: Any  # the template RawGraph (kept readable; owned here)
    pool: Any
    layout: Hashable  # the states' layout (see _state.state_layout)
    storages: Storages  # the template's state storages, in walk order
    inputs: Any  # the template's StaticInputs, read by every graph of the family
    out: Any  # the template's outputs, its state objects replaced by StateArg
    verified: bool = False  # the template's first call was recorded as a graph
    guard: Any = None  # what the template's capture read (a StateGuard)
    flags: Any = None  # the global flags it ran under (a FlagsGuard)
    pinned: tuple = ()  # (leaf, address) of parameters passed as arguments (CapturedGraph's)
    held_storages: frozenset = frozenset()  # what it reads from outside (CapturedGraph's)
    grads_read: tuple | None = None  # its parameters' requires_grad, read (CapturedGraph's)
    sets: tuple = ()  # module attributes its forward sets to a constant (CapturedGraph's)
    made: tuple = ()  # the template's output plan: (actions, spec, static outputs)
    nodes: list = field(default_factory=list)
    edges: Any = None
    plan: RebasePlan | None = None
    # why diffs (or proofs) failed: the bytes that differ beyond the addresses can be whatever
    # the host stack held (a stale device address, now and then), so a few states are tried
    failures: list[str] = field(default_factory=list)

    final: bool = False  # a failure that another state would repeat

    @property
    def reason(self) -> str | None:
        """Why the family rebases nothing (None while it may)."""
        return self.failures[-1] if self.final or len(self.failures) >= _ATTEMPTS else None

    def refuse(self, why: str, final: bool = False) -> None:
        self.plan = None
        self.failures.append(why)
        self.final = self.final or final
        # (spares were rewritten for the plan that is gone: a later plan rewrites other slots)
        spare, self.spare = self.spare, []
        for exe in spare:
            exe.destroy()

    # executable graphs of states that died, rewritten for the next state instead of
    # instantiating the template again
    spare: list = field(default_factory=list)

    def recycle(self, exe) -> None:
        if self.raw is not None and len(self.spare) < _SPARE:
            self.spare.append(exe)
        else:
            exe.destroy()

    def outputs(self, leaves: list) -> Any:
        """The template's outputs with this call's state objects in their places."""
        return pytree.tree_map(lambda v: leaves[v.index] if type(v) is StateArg else v,
                               self.out)

    def release(self) -> None:
        raw, self.raw = self.raw, None
        spare, self.spare = self.spare, []
        for exe in spare:
            exe.destroy()
        if raw is not None:
            raw.release()


class Borrowed:
    """The raw-graph face of the template for the first state's own graph: replays it, and
    leaves its release to the family."""

    __slots__ = ("_raw", "pool", "pool_bytes", "capture_seconds")

    def __init__(self, raw):
        self._raw = raw
        self.pool = raw.pool
        self.pool_bytes = raw.pool_bytes
        self.capture_seconds = raw.capture_seconds

    @property
    def replay(self) -> Callable[[], None]:
        return self._raw.replay

    def cuda_graph(self) -> int:
        return self._raw.cuda_graph()

    def release(self) -> None:
        self._raw = None


class Families:
    """The families of one graphed callable, by key; released with its graphs."""

    def __init__(self):
        self._families: dict[Hashable, Family] = {}

    def get(self, key: Hashable) -> Family | None:
        return self._families.get(key)

    def full(self) -> bool:
        return len(self._families) >= _MAX_FAMILIES

    def add(self, key: Hashable, family: Family) -> None:
        self._families[key] = family

    def drop(self, key: Hashable) -> None:
        family = self._families.pop(key, None)
        if family is not None:
            family.release()

    def entry(self, state, sig, leaves: list, backend, device: torch.device):
        """A graph for this call made by rebasing its family's template to its states (no
        warm-up, no capture: the call is the template's up to the states' addresses, and
        what the template's capture read still holds), or None."""
        if not eligible(state, backend):
            return None
        found = family_key(state, sig, leaves)
        if found is None:
            return None
        key, _, storages = found
        family = self._families.get(key)
        if family is None or family.reason is not None or not family.verified \
                or not family.guard.valid() or not family.flags.check():
            return None
        if any(leaves[i].data_ptr() != ptr for i, ptr in family.pinned):
            return None  # a parameter passed as an argument, read in place: another one
        if family.grads_read is not None and state.statics.grad_pattern() != family.grads_read:
            return None  # (its forward read requires_grad: another pattern, another branch)
        try:
            raw = retarget(family, storages, backend, device)
        except Refused:
            return None
        from ._replay import CapturedGraph

        entry = CapturedGraph(raw, family.inputs, [], *family.made, device=device)
        entry.shared = True
        entry.pinned = family.pinned
        entry.held_storages = family.held_storages
        entry.grads_read = family.grads_read
        if family.sets:
            entry.sets = family.sets
            entry._replay = _watch.setting(entry._replay, family.sets)
        entry.state_storages = frozenset(start for start, _ in storages.ranges) - {0}
        return family, entry

    def reasons(self) -> dict[str, int]:
        """Why families rebase nothing (Stats.reasons)."""
        out: dict[str, int] = {}
        for family in self._families.values():
            if family.reason is not None:
                why = f"static state not rebased: {family.reason}"
                out[why] = out.get(why, 0) + 1
        return out

    def pool_bytes(self) -> int:
        return sum(f.raw.pool_bytes for f in self._families.values() if f.raw is not None)

    def release(self) -> None:
        """Release every template (after the graphs made from them: they read its memory)."""
        for family in self._families.values():
            family.release()
        self._families.clear()

    def __len__(self) -> int:
        return len(self._families)


def eligible(state, backend) -> bool:
    """Whether a graphed callable's graphs may come from families at all: they share the
    template's static outputs (copied out on every call) and read its memory through the
    driver (a backend that can read graphs)."""
    return state.share is None and state.options.copy_outputs is True \
        and getattr(backend, "can_share", False)


def family_key(state, sig, leaves: list) -> tuple[Hashable, Hashable, Storages] | None:
    """The family of ``state``'s call passing static state: (key, the states' layout, their
    storages), or None where a state cannot be laid out (see _state.state_layout). The key is
    the engine's cache key (with which parameters require grad) up to the states' addresses."""
    from ._signature import STATIC_STATE
    from ._state import StateUnkeyable, state_layout

    try:
        layout, ranges = state_layout([leaves[i] for i in sig.static_states])
    except StateUnkeyable:
        return None
    statics = state.statics
    grads = statics.grad_pattern() if sig.state.grad and statics.tensors else None
    # parameters or buffers passed as arguments are read in place: their addresses
    ptrs = statics.storage_ptrs()
    pinned = tuple((i, x.data_ptr()) for i, x in enumerate(leaves)
                   if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() in ptrs)
    key = (sig.tensors, sig.state, sig.spec, layout, grads, pinned,
           tuple(c for c in sig.constants if c.kind != STATIC_STATE))
    return key, layout, Storages(tuple(ranges))


def state_outputs(out: Any, leaves: list, indices: list[int]) -> Any:
    """``out`` with the static state objects at leaf ``indices`` replaced by :class:`StateArg`
    (a family must not hold a state: it is keyed by what it holds, and its graphs die with it)."""
    where = {id(leaves[i]): i for i in indices}
    return pytree.tree_map(lambda v: StateArg(where[id(v)]) if id(v) in where else v, out)


def diff(family: Family, raw, storages: Storages, pool, readable=None) -> None:
    """Diff a second state's capture against the template; sets the family's plan, or records
    a failure when the difference is not only the states' addresses.

    ``readable``: the tensors the forward may read besides the states and the pool
    (parameters, buffers, the static inputs, tensors kept as module attributes: the probe
    refuses reads of anything else). Given, a differing 8-byte value that lies in none of that
    memory in either capture, nor in the pool, is kept but unproven: no tensor the forward
    reads lies there, so it is an uninitialised byte of a kernel's argument struct that held a
    stale address (seen on the H200: a neg kernel's struct tail, 0x7f3adfbea560 in one capture,
    0x7f378ffc1c00 in the other). Without it, only values outside all device memory are."""
    from ._cugraph import DriverError, read_graph

    try:
        if not family.nodes:
            family.nodes, family.edges = read_graph(family.raw.cuda_graph())
        nodes, edges = read_graph(raw.cuda_graph())
        pool_mem, device_mem = memory_ranges(pool)
        if readable is not None:
            device_mem = readable_ranges(pool_mem, [family.storages, storages], readable)
        # (bytes that hold no address of that memory in either capture, uninitialised tails of
        # kernels' argument structs, are kept but unproven; the caller proves such a plan
        # against eager once, on copies of the state)
        # (a storage of the second cache at the template's address, where the allocator
        # handed it memory of a dead cache, is rebased like the others: tied=False)
        family.plan = plan_rebase(family.nodes, nodes, family.edges, edges, family.storages,
                                  storages, pool_mem, None, device_mem,
                                  functools.cache(host_ranges), tied=False, one_sided=True)
    except Refused as e:
        family.refuse(f"two caches' captures differ in more than the caches' addresses: {e}")
    except DriverError as e:
        family.refuse(f"reading the captured graph failed: {e}")
    except Exception as e:  # noqa: BLE001 - unproven means refused, with the reason
        family.refuse(f"rebasing failed unexpectedly: {type(e).__name__}: {e}")


def prove(family: Family, states: list, run_eager: Callable[[list], Any], inputs: list,
          backend, device: torch.device, live: list = ()) -> None:
    """Prove a plan with unproven bytes: on two copies of ``states`` (their state as it is
    now), the forward run eagerly (``run_eager(copies)``) and the template rebased to the
    other copy must give bitwise the same outputs and leave the copies bitwise the same. Sets
    a failure (and drops the plan) otherwise. ``inputs``: this call's leaves, copied
    into the template's static inputs.

    A slot the plan missed still points where the template's or ``live`` (this call's own
    states, diffed with it) state lies, which may hold what the copies hold: the copies are
    made away from both (``Refused`` where the allocator keeps handing that memory back), and
    ``live``'s memory holds 0xff bytes (NaN) while the proof runs (put back after)."""
    from ._state import state_layout

    try:
        avoid = [family.storages, Storages(_ranges(live))]
        held: list = []  # copies that landed in that memory, held so that the next do not
        mine, theirs = (_fresh_copy(states, avoid, held) for _ in range(2))
        del held
        layout, ranges = state_layout(theirs)
        if layout != family.layout:
            raise Refused("a copy of the cache is laid out differently (its alignment)")
        with _poisoned(_tensors(live)):
            want = run_eager(mine)
            # (destroyed after, never kept as a spare: it points at a copy that dies here)
            raw = retarget(family, Storages(tuple(ranges)), backend, device, spare=False)
            try:
                with torch.no_grad():
                    for i, buf in family.inputs.copy:
                        buf.copy_(inputs[i])
                raw.replay()
                got = [t for t in pytree.tree_leaves(family.out) if isinstance(t, torch.Tensor)]
                want = [t for t in pytree.tree_leaves(want) if isinstance(t, torch.Tensor)]
                a, b = _tensors(mine), _tensors(theirs)
                same = len(got) == len(want) and len(a) == len(b) and all(
                    x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)
                    for x, y in zip(got + a, want + b))
            finally:
                raw.release()
        if not same:
            raise Refused("the first capture rebased to a copy of the cache does not equal "
                          "the forward run eagerly on another copy, bitwise")
    except Refused as e:
        family.refuse(f"rebasing is not proven: {e}")
    except torch.OutOfMemoryError:
        family.refuse("rebasing is not proven: out of memory copying the cache to prove it")
    except Exception as e:  # noqa: BLE001 - unproven means refused, with the reason
        family.refuse(f"proving a rebase failed unexpectedly: {type(e).__name__}: {e}")


def _ranges(states) -> tuple[tuple[int, int], ...]:
    """(address, bytes) of the storage of every tensor the states hold."""
    return tuple((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                 for t in _tensors(states))


def _fresh_copy(states: list, avoid: list[Storages], held: list) -> list:
    """A copy of ``states`` none of whose storages overlaps ``avoid`` (copies that do are
    kept in ``held``, so that the allocator hands out other memory)."""
    import copy

    for _ in range(3):
        made = copy.deepcopy(states)
        mine = _ranges(made)
        if not any(start < s_start + s_n and s_start < start + n
                   for s in avoid for s_start, s_n in s.ranges for start, n in mine):
            return made
        held.append(made)
    raise Refused("copies of the cache keep landing in the memory of the caches diffed")


@contextlib.contextmanager
def _poisoned(tensors: list):
    """Inside, the storages of ``tensors`` hold 0xff bytes; after, what they held."""
    storages = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr():
            storages.setdefault(st.data_ptr(), st)
    with torch.no_grad():
        saved = {k: st.clone() for k, st in storages.items()}
        try:
            for st in storages.values():
                st.fill_(0xFF)
            yield
        finally:
            for k, st in storages.items():
                st.copy_(saved[k])


def _tensors(states: list) -> list[torch.Tensor]:
    from ._state import _Walk, _key

    walk = _Walk()
    for v in states:
        _key(v, 0, [0], walk)
    return walk.tensors


def retarget(family: Family, storages: Storages, backend, device: torch.device,
             spare: bool = True):
    """The template's graph with the state addresses rewritten to ``storages``: a raw graph
    (replay, release) owned by the caller. Raises :class:`Refused`. ``spare``: it may be a
    dead state's graph rewritten, and goes back to the spares when released (else it is
    instantiated, and destroyed when released)."""
    from ._cugraph import DriverError, RetargetedExec

    plan = family.plan
    if plan is None:
        # no plan yet: only a state at the template's own addresses (a dead state's memory,
        # reused by the allocator for the next one) can take the template, as it is (a new
        # instance: a spare holds the addresses of the state it was rewritten for)
        if storages.ranges != family.storages.ranges:
            raise Refused("no plan to rebase with")
        plan, spare = RebasePlan(), False
    plan.check(family.storages, storages, 0, 256 if device.type == "cuda" else 1)
    t0 = time.perf_counter()
    chunks = {i: n.chunks for i, n in enumerate(family.nodes)}
    patches = plan.patches(chunks, storages)
    template = family.raw.cuda_graph()
    try:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            exe = None
            while spare and family.spare and exe is None:  # a dead state's, rewritten
                exe = family.spare.pop()
                try:
                    exe.repatch(template, patches, family.nodes)
                except DriverError:
                    exe.destroy()
                    exe = None
            if exe is None:
                exe = RetargetedExec(template, patches, device.index or 0, family.nodes)
    except DriverError as e:
        raise Refused(f"rewriting the graph failed: {e}") from e
    return RetargetedRaw(exe, lambda: backend.stream_token(device), time.perf_counter() - t0,
                         family.pool, recycle=family.recycle if spare else None)
