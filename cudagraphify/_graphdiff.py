"""Diffing two captures of the same work on different memory, and the rewrite it proves.

Two captures that differ only in where some tensors lie (two identical layers' parameters for
``share_graph``, two KV caches for a family of static-state graphs) are compared node by node:
:func:`plan_rebase` finds every kernel argument that is an address inside those tensors'
storages and refuses anything else it cannot prove harmless; :class:`RebasePlan` then writes
another set of storages into a copy of the first capture's arguments. Pure: the graphs' nodes
are read elsewhere (:mod:`._cugraph`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ._unread import unread_bytes

__all__ = ["Refused", "Storages", "RebasePlan", "plan_rebase", "memory_ranges",
           "readable_ranges", "host_ranges", "RetargetedRaw"]


class Refused(Exception):
    """A rewrite is not proven (sharing, or rebasing a family); the reason says why."""


@dataclass(frozen=True)
class Storages:
    """Storages (a layer's parameters and buffers, a cache's tensors), in a canonical order:
    (start, nbytes) each."""

    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, layer: torch.nn.Module) -> "Storages":
        seen: dict[int, int] = {}
        for t in list(layer.parameters()) + list(layer.buffers()):
            s = t.untyped_storage()
            seen.setdefault(s.data_ptr(), s.nbytes())
        return cls(tuple(seen.items()))

    def find(self, value: int) -> tuple[int, int] | None:
        for j, (start, n) in enumerate(self.ranges):
            if start <= value < start + n:
                return j, value - start
        return None


@dataclass
class RebasePlan:
    """Which slots to rewrite: node index -> chunk index -> [(byte offset, storage j, offset)]."""

    slots: dict[int, dict[int, list[tuple[int, int, int]]]] = field(default_factory=dict)
    count: int = 0
    unproven: int = 0  # differing non-address slots kept on the strength of verification
    same: int = 0  # of them, slots into a storage at one address in both (tied=False)
    shared: frozenset = frozenset()  # storages the two diffed layers have in common (tied)

    def check(self, template: Storages, mine: Storages, k: int, alignment: int = 256) -> None:
        """Refuse layer ``k`` when its storages do not fit the plan made from the template's.

        ``alignment``: storage addresses must agree modulo it (CUDA libraries pick kernels by
        pointer alignment; 256 bytes covers what they test for)."""
        if len(mine.ranges) != len(template.ranges) or any(
                n != m for (_, n), (_, m) in zip(mine.ranges, template.ranges)):
            raise Refused(f"layer {k}'s storages differ in number or size from the template's")
        for j, ((start, _), (t_start, _)) in enumerate(zip(mine.ranges, template.ranges)):
            if j in self.shared and start != t_start:
                raise Refused(f"layer {k} has its own storage {j}, which the diffed layers "
                              "share (tied): its address is not rebased")
            if (start - t_start) % alignment:
                raise Refused(f"layer {k}'s storage {j} is aligned differently from the "
                              "template's (kernels may have been chosen for the alignment)")

    def patches(self, chunks_of: dict[int, list[bytes]], storages: Storages) -> dict:
        out: dict[int, dict[int, bytes]] = {}
        for node, per_chunk in self.slots.items():
            for c, slots in per_chunk.items():
                buf = bytearray(chunks_of[node][c])
                for pos, j, off in slots:
                    buf[pos:pos + 8] = (storages.ranges[j][0] + off).to_bytes(8, "little")
                out.setdefault(node, {})[c] = bytes(buf)
        return out


def _in(ranges: list[tuple[int, int]], v: int) -> bool:
    return any(start <= v < start + n for start, n in ranges)


def plan_rebase(nodes0: list, nodes1: list, edges0, edges1, a: Storages, b: Storages,
                pool: list[tuple[int, int]], again: list | None = None,
                device: list[tuple[int, int]] | None = None,
                host: Callable[[], list[tuple[int, int]]] | None = None,
                tied: bool = True, one_sided: bool = False) -> RebasePlan:
    """Diff two captures of identical layers (``a`` then ``b``); raise :class:`Refused` unless
    every difference is proven harmless to keep or is a rebased address of the layer's storages.

    A differing 8-byte slot is rebased when it holds an address inside one of ``a``'s storages
    and ``b``'s capture holds the same offset in the same storage of ``b``. It keeps the
    template's value when it is capture-dependent, not layer-dependent: two addresses of
    graph-owned memory (``pool``: intermediates), or a slot whose value also differs in
    ``again``, a second capture of layer ``a`` itself (struct padding, which holds whatever the
    host stack held). With ``device`` (every device memory segment, or the memory the forward
    may read: :func:`readable_ranges`) given, a slot whose two values are both outside it is
    kept too but counted as unproven (``plan.unproven``): kernels take structs with
    uninitialised tails (unused dimensions of an offset calculator) that differ with whatever
    the host stack held; the caller must verify such a graph against eager. With
    ``one_sided`` (a family of static states, whose plan is proven against eager before any
    use), one value outside it is enough, when neither is an address of the storages diffed:
    a stale device address in a struct's tail may lie in memory the forward reads (its pool)
    in one capture, and a pointer the launch wrote would point into that memory in both. A
    one-byte argument that differs is kept and counted as unproven in any case: it cannot
    hold an address, and empty functors (elementwise kernels' lambdas, one byte the kernel
    never reads) hold whatever the host stack held, which two captures of the same layer may
    well agree on (seen on the H200: 0xf0 twice for one layer, 0x00 for the
    other). With ``host`` (a function giving :func:`host_ranges`, called for each such slot:
    cache it), an 8-byte slot of a kernel's arguments whose value in one capture lies in
    host-only memory (a stack, a mapped file's code or data), and in neither in the two
    layers' storages, is kept and counted as unproven too: that capture's kernel ran with a
    host address there, so it does not read the slot; the other capture may hold a stale
    device address there. (Struct
    padding that held a stack or a return address, seen on the H200 in HF Llama's mean
    reduction, stable across two captures of one layer; in a comparison kernel of HF's mask,
    a stack address against an address in the pool.) Bytes of a PyTorch kernel's arguments
    that the kernel never reads (offset calculators' entries past their ``dims``, a cat's
    entries past its launch's inputs, padding: :func:`._unread.unread_bytes`), left unset on
    the host, may differ too, not counted.
    Anything else refuses.

    ``tied``: a storage at the same address in ``a`` and ``b`` is one storage both layers
    share (tied weights: kept, and :meth:`RebasePlan.check` refuses a layer with its own).
    With ``tied=False`` (two caches, the second made where the first one's memory was freed)
    it is two storages that happen to lie at one address: every kernel's 8-byte slot holding
    an address inside it, the same in both captures, is rebased too (:func:`_same_address_slots`),
    and each such slot counts as unproven (equal bytes prove no address: the caller must verify
    the plan against eager at other addresses).
    """
    if len(nodes0) != len(nodes1):
        raise Refused(f"the two captures have {len(nodes0)} and {len(nodes1)} nodes")
    if edges0 != edges1:
        raise Refused("the two captures' node dependencies differ")
    if again is not None and [n.key for n in again] != [n.key for n in nodes0]:
        raise Refused("two captures of the same layer differ in their work")
    if len(a.ranges) != len(b.ranges) or any(
            na != nb for (_, na), (_, nb) in zip(a.ranges, b.ranges)):
        raise Refused("the layers' storages differ in number or size")
    shared = {j for j, (sa, sb) in enumerate(zip(a.ranges, b.ranges)) if sa[0] == sb[0]}
    plan = RebasePlan(shared=frozenset(shared) if tied else frozenset())
    unread = _Unread()
    if not tied and shared:
        _same_address_slots(plan, nodes0, nodes1, a, shared)
        shared = set()
    for i, (n0, n1) in enumerate(zip(nodes0, nodes1)):
        if n0.key != n1.key:
            raise Refused(f"node {i} ({n0.name}) is different work in the two captures")
        for c, (x, y) in enumerate(zip(n0.chunks, n1.chunks)):
            if x == y:
                continue
            z = again[i].chunks[c] if again is not None else x
            for pos in range(0, len(x), 8):
                w0, w1, w2 = x[pos:pos + 8], y[pos:pos + 8], z[pos:pos + 8]
                if w0 == w1:
                    continue
                v0, v1 = int.from_bytes(w0, "little"), int.from_bytes(w1, "little")
                hit = a.find(v0) if len(w0) == 8 else None
                if hit is not None and hit[0] not in shared \
                        and b.ranges[hit[0]][0] + hit[1] == v1 and w2 == w0:
                    if n0.kind != 0:
                        raise Refused(f"node {i} ({n0.name}) copies or sets a parameter's memory")
                    plan.slots.setdefault(i, {}).setdefault(c, []).append((pos, *hit))
                    plan.count += 1
                elif hit is None and b.find(v1) is None and (
                        w2 != w0 or (len(w0) == 8 and _in(pool, v0) and _in(pool, v1))):
                    continue  # capture-dependent: the template's own value stands for every layer
                elif unread(i, c, n0, x, y, z) >= _differing(pos, w0, w1, w2):
                    continue  # bytes the kernel never reads (a reduction's unused entries, padding)
                elif len(x) == 1 or (device is not None
                                     and _stale(v0, v1, device, one_sided, a, b)):
                    plan.unproven += 1  # a one-byte argument, or a stale struct byte
                elif len(w0) == 8 and n0.kind == 0 and host is not None \
                        and _host_garbage(v0, v1, host(), a, b):
                    plan.unproven += 1  # a host address in one capture: never a kernel's pointer
                else:
                    raise Refused(f"node {i} ({n0.name}): argument {c} at byte {pos} differs "
                                  f"({v0:#x} vs {v1:#x}) and is not a rebased parameter address")
    return plan


def _differing(pos: int, *words: bytes) -> frozenset[int]:
    """Positions (in the argument) of the bytes of an argument's window at ``pos`` that are
    not the same in all ``words``."""
    return frozenset(pos + k for k in range(len(words[0]))
                     if len({w[k] for w in words}) > 1)


class _Unread:
    """Bytes of a node's argument its kernel never reads, found once per node and argument
    (see :func:`._unread.unread_bytes`); empty where none are known."""

    def __init__(self):
        self._found: dict[tuple[int, int], frozenset[int]] = {}

    def __call__(self, i: int, c: int, node, *chunks: bytes) -> frozenset[int]:
        key = (i, c)
        if key not in self._found:
            self._found[key] = unread_bytes(node, c, chunks)
        return self._found[key]


def _same_address_slots(plan: RebasePlan, nodes0: list, nodes1: list, a: Storages,
                        same: set[int]) -> None:
    """Add to ``plan`` the 8-byte kernel-argument slots that hold, identically in both
    captures, an address inside one of the storages ``same`` (at one address in both), or
    its end (one past its last byte, a loop's bound, where no storage starts there), each
    counted as unproven; refuse a copy or memset node that reaches one."""
    ranges = [(a.ranges[j][0], a.ranges[j][1], j) for j in sorted(same)]
    starts = {start for start, _ in a.ranges}
    for i, (n0, n1) in enumerate(zip(nodes0, nodes1)):
        for c, (x, y) in enumerate(zip(n0.chunks, n1.chunks)):
            for pos in range(0, len(x) - 7, 8):
                w = x[pos:pos + 8]
                if w != y[pos:pos + 8]:
                    continue  # (a differing slot is the main diff's)
                v = int.from_bytes(w, "little")
                hit = next(((j, v - start) for start, n, j in ranges
                            if start <= v < start + n or (v == start + n and v not in starts)),
                           None)
                if hit is None:
                    continue
                if n0.kind != 0:
                    raise Refused(f"node {i} ({n0.name}) copies or sets a cache's memory")
                plan.slots.setdefault(i, {}).setdefault(c, []).append((pos, *hit))
                plan.count += 1
                plan.unproven += 1
                plan.same += 1


def _stale(v0: int, v1: int, device: list[tuple[int, int]], one_sided: bool, a: Storages,
           b: Storages) -> bool:
    """Two differing values no kernel reads as a pointer: both outside ``device``; with
    ``one_sided``, one of them, and neither in the storages diffed."""
    out0, out1 = not _in(device, v0), not _in(device, v1)
    return (out0 and out1) or (one_sided and (out0 or out1) and not _in_either(v0, v1, a, b))


def _in_either(v0: int, v1: int, a: Storages, b: Storages) -> bool:
    """Whether either value lies in either layer's storages."""
    return any(s.find(v) is not None for s in (a, b) for v in (v0, v1))


def _host_garbage(v0: int, v1: int, host: list[tuple[int, int]], a: Storages,
                  b: Storages) -> bool:
    """One of two differing values lies in host-only memory, and neither in the layers'
    storages: the kernel of that capture ran with a host address in the slot, so it does not
    read the slot (the other capture's kernel is the same, with the same other arguments)."""
    return (_in(host, v0) or _in(host, v1)) and not _in_either(v0, v1, a, b)


def readable_ranges(pool: list[tuple[int, int]], storages: list[Storages],
                    tensors) -> list[tuple[int, int]]:
    """Address ranges of the memory a captured forward may read: its pool, the storages of
    the layers or states diffed, and the storages of ``tensors`` (parameters, buffers, static
    inputs, tensors kept as module attributes: the probe refuses a run that reads anything
    else). Given to :func:`plan_rebase` as ``device``, a differing value in none of these in
    either capture is an uninitialised struct byte that held a stale address (kept, unproven)."""
    out = set(pool)
    for s in storages:
        out.update(s.ranges)
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr():
            out.add((s.data_ptr(), s.nbytes()))
    return sorted(out)


def host_ranges(maps: str | None = None) -> list[tuple[int, int]]:
    """Address ranges of this process's host-only memory that no plain number lands in, from
    ``/proc/self/maps`` (or the text ``maps``): its stacks and the mappings of files (the
    interpreter's and the libraries' code and data) above 4 GiB. Unified addressing reserves
    device memory in mappings of its own (anonymous, or of a ``/dev`` device file), never in
    these: a value inside them is not a device address. (The heap, and a non-PIE executable
    mapped low, are left out: an ordinary integer may lie in them.) Empty where the maps
    cannot be read. Read from this process (no ``maps``), it also holds the stack protector's
    canary as a range of one byte (:func:`stack_canary`): a random word, in every protected
    frame of the host stack, that no plain number or address equals."""
    out = []
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            return []
        canary = stack_canary()
        if canary:
            out.append((canary, 1))
    for line in maps.splitlines():
        fields = line.split(None, 5)
        if not fields:
            continue
        path = fields[5].strip() if len(fields) == 6 else ""  # none: anonymous
        start, _, end = fields[0].partition("-")
        if path.startswith("[stack") or (
                path.startswith("/") and not path.startswith(("/dev/", "/memfd:"))
                and int(start, 16) >= 1 << 32):
            out.append((int(start, 16), int(end, 16) - int(start, 16)))
    return out


_AT_RANDOM = 25  # the auxiliary vector's entry: the address of 16 random bytes


def stack_canary(auxv: bytes | None = None,
                 read: Callable[[int, int], bytes] | None = None) -> int | None:
    """This process's stack protector canary, where it can be known (64-bit little-endian
    Linux with glibc, which makes it from the first 8 of the 16 random bytes the kernel passes
    at ``AT_RANDOM``, low byte zeroed; None elsewhere). ``auxv``: the auxiliary vector's bytes
    (``/proc/self/auxv``); ``read(address, n)``: n bytes of this process's memory. Seen on the
    H200 in the tail of HF Llama's mean reduction's argument struct, in one layer's captures
    and not in another's."""
    import ctypes
    import struct
    import sys

    if sys.byteorder != "little" or struct.calcsize("P") != 8 or not sys.platform.startswith(
            "linux"):
        return None
    try:
        if auxv is None:
            with open("/proc/self/auxv", "rb") as f:
                auxv = f.read()
        for i in range(0, len(auxv) - 15, 16):
            kind, value = struct.unpack_from("<QQ", auxv, i)
            if kind == _AT_RANDOM and value:
                word = (read or ctypes.string_at)(value, 8)
                return int.from_bytes(word, "little") & ~0xFF or None
    except (OSError, ValueError, struct.error):
        return None
    return None


def memory_ranges(pool) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Address ranges of the segments of a graph memory pool, and of all device memory."""
    want = tuple(pool)
    segments = torch.cuda.memory_snapshot()
    return ([(s["address"], s["total_size"]) for s in segments
             if tuple(s.get("segment_pool_id", ())) == want],
            [(s["address"], s["total_size"]) for s in segments])


class RetargetedRaw:
    """The raw-graph face of a retargeted executable graph (a CapturedGraph's ``raw``)."""

    pool_bytes = 0

    def __init__(self, exe, stream: Callable[[], int], seconds: float, pool,
                 recycle: Callable | None = None):
        self._exe = exe
        self.pool = pool
        self.capture_seconds = seconds
        self._recycle = recycle  # takes the executable graph back (else it is destroyed)
        launch = exe.launch
        self.replay = lambda: launch(stream())

    def release(self) -> None:
        exe, self._exe = self._exe, None
        if exe is not None:
            if self._recycle is not None:
                self._recycle(exe)
            else:
                exe.destroy()
