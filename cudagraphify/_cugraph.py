"""Reading and rewriting captured CUDA graphs through the driver API (ctypes on libcuda).

Only :mod:`._share` uses this: it reads every node of a captured graph (kernel arguments as
bytes, memset and memcpy parameters), instantiates it, writes new argument bytes into chosen
kernel nodes of the executable graph and launches it on a stream. The struct layouts are those of
``cuda.h`` (CUDA 12.4 and later: ``cuFuncGetParamInfo`` tells each argument's offset and size).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from ._errors import CudagraphifyError

__all__ = ["DriverError", "GraphNode", "read_graph", "RetargetedExec", "driver_available"]

_c_size = ctypes.c_size_t
_ptr = ctypes.c_void_p

KERNEL, MEMCPY, MEMSET, EMPTY = 0, 1, 2, 5
_NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "child graph", 5: "empty",
               6: "event wait", 7: "event record", 8: "semaphore signal", 9: "semaphore wait",
               10: "memory alloc", 11: "memory free", 12: "batch memory op", 13: "conditional"}
_PARAM_BUFFER_POINTER, _PARAM_BUFFER_SIZE, _PARAM_END = 1, 2, 0


class DriverError(CudagraphifyError):
    """A CUDA driver call for graph retargeting failed (the caller falls back)."""


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", _ptr), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("kernelParams", _ptr), ("extra", _ptr),
                ("kern", _ptr), ("ctx", _ptr)]


class _MemsetParams(ctypes.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", _c_size), ("value", ctypes.c_uint),
                ("elementSize", ctypes.c_uint), ("width", _c_size), ("height", _c_size)]


class _Memcpy3D(ctypes.Structure):  # CUDA_MEMCPY3D
    _fields_ = [("srcXInBytes", _c_size), ("srcY", _c_size), ("srcZ", _c_size),
                ("srcLOD", _c_size), ("srcMemoryType", ctypes.c_int), ("srcHost", _ptr),
                ("srcDevice", ctypes.c_uint64), ("srcArray", _ptr), ("reserved0", _ptr),
                ("srcPitch", _c_size), ("srcHeight", _c_size),
                ("dstXInBytes", _c_size), ("dstY", _c_size), ("dstZ", _c_size),
                ("dstLOD", _c_size), ("dstMemoryType", ctypes.c_int), ("dstHost", _ptr),
                ("dstDevice", ctypes.c_uint64), ("dstArray", _ptr), ("reserved1", _ptr),
                ("dstPitch", _c_size), ("dstHeight", _c_size),
                ("WidthInBytes", _c_size), ("Height", _c_size), ("Depth", _c_size)]


_lib: Any = None


def _driver():
    global _lib
    if _lib is None:
        try:
            _lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise DriverError(f"the CUDA driver library cannot be loaded: {e}") from e
    return _lib


def driver_available() -> bool:
    try:
        _fn("cuFuncGetParamInfo")
        return True
    except DriverError:
        return False


def _fn(*names: str):
    lib = _driver()
    for name in names:
        f = getattr(lib, name, None)
        if f is not None:
            return f
    raise DriverError(f"the CUDA driver has none of {names} (CUDA 12.4 or later is needed)")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        s = ctypes.c_char_p()
        _driver().cuGetErrorName(rc, ctypes.byref(s))
        raise DriverError(f"{what} failed: {s.value.decode() if s.value else rc}")


@dataclass
class GraphNode:
    """What matters of one node, in the graph's node order.

    ``key`` identifies the work (node type, kernel and launch shape); ``chunks`` are the bytes
    that may hold addresses (each kernel argument, the ``extra`` argument blob, or the pointer
    fields of a memset/memcpy).
    """

    kind: int
    key: tuple
    chunks: list[bytes]
    name: str = ""
    form: str = ""  # "params" | "extra" | "" (not a kernel)
    grid: tuple = ()  # a kernel's (gridDimX, gridDimY, gridDimZ)


def _kernel_args(p: _KernelParams) -> tuple[str, list[bytes]]:
    if p.kernelParams:
        if p.func:
            info, handle = _fn("cuFuncGetParamInfo"), p.func
        else:
            info, handle = _fn("cuKernelGetParamInfo"), p.kern
        sizes = []
        off, size = _c_size(), _c_size()
        while True:
            rc = info(_ptr(handle), _c_size(len(sizes)), ctypes.byref(off), ctypes.byref(size))
            if rc != 0:
                # An error past the last argument ends the list (CUDA_ERROR_INVALID_VALUE); a
                # kernel whose first argument cannot be read cannot be diffed.
                if not sizes:
                    _check(rc, "cuFuncGetParamInfo")
                break
            sizes.append(size.value)
        arr = ctypes.cast(p.kernelParams, ctypes.POINTER(_ptr))
        if any(not arr[i] for i in range(len(sizes))):
            raise DriverError("a kernel node has a null argument pointer")
        return "params", [ctypes.string_at(arr[i], n) for i, n in enumerate(sizes)]
    if p.extra:
        arr = ctypes.cast(p.extra, ctypes.POINTER(_ptr))
        blob = size_ptr = None
        i = 0
        while (arr[i] or 0) != _PARAM_END and i < 64:
            if arr[i] == _PARAM_BUFFER_POINTER:
                blob = arr[i + 1]
            elif arr[i] == _PARAM_BUFFER_SIZE:
                size_ptr = arr[i + 1]
            i += 2
        if blob is None or size_ptr is None:
            raise DriverError("a kernel node's extra launch parameters have no argument buffer")
        n = ctypes.cast(size_ptr, ctypes.POINTER(_c_size))[0]
        return "extra", [ctypes.string_at(blob, n)]
    return "params", []


def _func_name(p: _KernelParams) -> str:
    name = ctypes.c_char_p()
    if p.func and _driver().cuFuncGetName(ctypes.byref(name), _ptr(p.func)) == 0 and name.value:
        return name.value.decode(errors="replace")
    return "kernel"


def _nodes(graph: int) -> list[int]:
    get = _fn("cuGraphGetNodes")
    n = _c_size(0)
    _check(get(_ptr(graph), None, ctypes.byref(n)), "cuGraphGetNodes")
    arr = (_ptr * n.value)()
    _check(get(_ptr(graph), arr, ctypes.byref(n)), "cuGraphGetNodes")
    return [arr[i] for i in range(n.value)]


class _EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte),
                ("type", ctypes.c_ubyte), ("reserved", ctypes.c_ubyte * 5)]


def _get_edges_v2():
    """``cuGraphGetEdges`` with edge data (CUDA 12.3+): edges of programmatic launches carry
    data, and the query without it fails with CUDA_ERROR_LOSSY_QUERY."""
    lib = _driver()
    f = getattr(lib, "cuGraphGetEdges_v2", None)
    if f is not None:
        return f
    proc = getattr(lib, "cuGetProcAddress_v2", None)
    if proc is None:
        raise DriverError("the CUDA driver has no cuGraphGetEdges_v2")
    fn, status = _ptr(), ctypes.c_int()
    _check(proc(b"cuGraphGetEdges", ctypes.byref(fn), ctypes.c_int(12030), ctypes.c_uint64(0),
                ctypes.byref(status)), "cuGetProcAddress(cuGraphGetEdges)")
    if not fn.value:
        raise DriverError("the CUDA driver has no cuGraphGetEdges with edge data")
    return ctypes.CFUNCTYPE(ctypes.c_int, _ptr, _ptr, _ptr, _ptr, ctypes.c_void_p)(fn.value)


def _edges(graph: int, index: dict[int, int]) -> frozenset[tuple]:
    f = _get_edges_v2()
    n = _c_size(0)
    _check(f(_ptr(graph), None, None, None, _ptr(ctypes.addressof(n))), "cuGraphGetEdges")
    count = n.value
    if count == 0:  # one node, or none depending on another (asking for 0 edges is an error)
        return frozenset()
    a, b = (_ptr * max(count, 1))(), (_ptr * max(count, 1))()
    data = (_EdgeData * max(count, 1))()
    _check(f(_ptr(graph), *(_ptr(ctypes.addressof(x)) for x in (a, b, data, n))),
           "cuGraphGetEdges")
    return frozenset((index[a[i]], index[b[i]], data[i].from_port, data[i].to_port, data[i].type)
                     for i in range(n.value))


def read_graph(graph: int) -> tuple[list[GraphNode], frozenset[tuple[int, int]]]:
    """Every node of ``graph`` (a ``CUgraph`` handle) and its edges as node-index pairs."""
    handles = _nodes(graph)
    out = []
    kind = ctypes.c_int()
    for h in handles:
        _check(_fn("cuGraphNodeGetType")(_ptr(h), ctypes.byref(kind)), "cuGraphNodeGetType")
        k = kind.value
        if k == KERNEL:
            p = _KernelParams()
            _check(_fn("cuGraphKernelNodeGetParams_v2", "cuGraphKernelNodeGetParams")(
                _ptr(h), ctypes.byref(p)), "cuGraphKernelNodeGetParams")
            form, chunks = _kernel_args(p)
            key = (k, p.func or p.kern, p.gridDimX, p.gridDimY, p.gridDimZ, p.blockDimX,
                   p.blockDimY, p.blockDimZ, p.sharedMemBytes, form, tuple(map(len, chunks)))
            out.append(GraphNode(k, key, chunks, _func_name(p), form,
                                 (p.gridDimX, p.gridDimY, p.gridDimZ)))
        elif k == MEMSET:
            m = _MemsetParams()
            _check(_fn("cuGraphMemsetNodeGetParams")(_ptr(h), ctypes.byref(m)),
                   "cuGraphMemsetNodeGetParams")
            out.append(GraphNode(k, (k, m.pitch, m.value, m.elementSize, m.width, m.height),
                                 [m.dst.to_bytes(8, "little")], "memset"))
        elif k == MEMCPY:
            m = _Memcpy3D()
            _check(_fn("cuGraphMemcpyNodeGetParams")(_ptr(h), ctypes.byref(m)),
                   "cuGraphMemcpyNodeGetParams")
            fields = tuple(getattr(m, f) for f, _ in _Memcpy3D._fields_
                           if f not in ("srcDevice", "dstDevice", "srcHost", "dstHost"))
            ends = [m.srcDevice, m.dstDevice, m.srcHost or 0, m.dstHost or 0]
            out.append(GraphNode(k, (k,) + fields, [v.to_bytes(8, "little") for v in ends],
                                 "memcpy"))
        elif k == EMPTY:
            out.append(GraphNode(k, (k,), [], "empty"))
        else:
            raise DriverError(f"the graph has a {_NODE_TYPES.get(k, k)} node, which retargeting "
                              "does not handle")
    return out, _edges(graph, {h: i for i, h in enumerate(handles)})


class RetargetedExec:
    """A template graph instantiated, with some kernel nodes' arguments rewritten in the
    executable graph (``cuGraphExecKernelNodeSetParams``): no clone of the graph.

    ``patches`` maps node index to {argument chunk index: new bytes}; only kernel nodes are
    patched. ``nodes``: the template's nodes as :func:`read_graph` gave them (their argument
    chunks, so that they need not be read from the driver again, one call per argument).
    """

    __slots__ = ("_exec", "_launch", "_device")

    def __init__(self, template: int, patches: dict[int, dict[int, bytes]], device_index: int,
                 nodes: list[GraphNode]):
        self._exec = None
        self._device = device_index
        exe = _ptr()
        _check(_fn("cuGraphInstantiateWithFlags")(ctypes.byref(exe), _ptr(template),
                                                    ctypes.c_ulonglong(0)), "cuGraphInstantiate")
        self._exec = exe.value
        try:
            self._patch(template, patches, nodes)
        except BaseException:
            self.destroy()
            raise
        launch = _fn("cuGraphLaunch")
        launch.argtypes = [_ptr, _ptr]
        self._launch = launch

    def _patch(self, template: int, patches: dict[int, dict[int, bytes]],
               nodes: list[GraphNode]) -> None:
        handles = _nodes(template) if patches else []
        get = _fn("cuGraphKernelNodeGetParams_v2", "cuGraphKernelNodeGetParams")
        put = _fn("cuGraphExecKernelNodeSetParams_v2", "cuGraphExecKernelNodeSetParams")
        for idx, chunks in patches.items():
            node = _ptr(handles[idx])
            p = _KernelParams()
            _check(get(node, ctypes.byref(p)), "cuGraphKernelNodeGetParams")
            form, old = nodes[idx].form, nodes[idx].chunks
            new = [chunks.get(i, b) for i, b in enumerate(old)]
            keep = [ctypes.create_string_buffer(b, len(b)) for b in new]
            if form == "params":
                arr = (_ptr * len(keep))(*[ctypes.addressof(b) for b in keep])
                p.kernelParams, p.extra = ctypes.addressof(arr), None
            else:
                size = _c_size(len(new[0]))
                arr = (_ptr * 5)(_PARAM_BUFFER_POINTER, ctypes.addressof(keep[0]),
                                 _PARAM_BUFFER_SIZE, ctypes.addressof(size), _PARAM_END)
                p.kernelParams, p.extra = None, ctypes.addressof(arr)
            _check(put(_ptr(self._exec), node, ctypes.byref(p)), "cuGraphExecKernelNodeSetParams")

    def repatch(self, template: int, patches: dict[int, dict[int, bytes]],
                nodes: list[GraphNode]) -> None:
        """Write other argument bytes into the same kernel nodes (launches already queued
        keep the arguments they were launched with)."""
        self._patch(template, patches, nodes)

    def launch(self, stream: int) -> None:
        rc = self._launch(self._exec, stream)
        if rc != 0:
            _check(rc, "cuGraphLaunch")

    def destroy(self) -> None:
        exe, self._exec = self._exec, None
        if exe is not None:
            _fn("cuGraphExecDestroy")(_ptr(exe))

    def __del__(self):
        try:
            self.destroy()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
