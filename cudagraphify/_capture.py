"""How a graph is made: warm-up and capture on a side stream. The only module that drives CUDA.

The engine talks to a backend object with a few verbs (``supports``, ``in_capture``,
``warmup``, ``capture``, ``new_pool``, ``stream_token``/``order_after``/``drain``);
:class:`CudaBackend` is the real one. Tests on a
machine without a GPU substitute a simulated backend to exercise the engine's bookkeeping.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import threading
import time
from typing import Any, Callable

import torch

from ._errors import CaptureFailed, CudagraphifyError

__all__ = ["CudaBackend", "Pool", "RawGraph", "default_backend", "drain", "set_backend"]

# One C call (the Python wrapper adds a lookup and a check per call on the replay path).
_stream_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing",
                            torch.cuda.is_current_stream_capturing)


class Pool(tuple):
    """A graph memory pool id (a tuple, as torch takes it) that keeps its pool usable.

    ``retired``: a capture into it failed part way, which leaves the pool marked as being
    recorded to (see ``CudaBackend._recover``): no later capture goes into it (its owner makes
    another); the graphs already in it keep it."""

    keeper: Any = None
    retired = False


class RawGraph:
    """One captured CUDA graph and its private memory pool."""

    __slots__ = ("_graph", "pool", "pool_bytes", "capture_seconds", "allocs", "frees")

    def __init__(self, graph: torch.cuda.CUDAGraph, pool, pool_bytes: int, capture_seconds: float,
                 counts: tuple[int, int] | None = None):
        self._graph = graph
        self.pool = pool
        self.pool_bytes = pool_bytes
        self.capture_seconds = capture_seconds
        # blocks the device's allocator handed out and freed while it was captured (any pool,
        # stream or thread; None: not counted)
        self.allocs, self.frees = counts if counts is not None else (None, None)

    @property
    def replay(self) -> Callable[[], None]:
        return self._graph.replay

    def cuda_graph(self) -> int:
        """The ``CUgraph`` handle (captures made with ``keep_graph=True`` only)."""
        return int(self._graph.raw_cuda_graph())

    def release(self) -> None:
        graph, self._graph = self._graph, None
        if graph is not None:
            graph.reset()


def _alloc_counts() -> tuple[int, int] | None:
    """How many blocks the current device's caching allocator has handed out and freed so far
    (every pool, stream and thread), or None where it keeps no such counts (cudaMallocAsync
    lists them at 0)."""
    try:
        if torch.cuda.memory.get_allocator_backend() != "native":
            return None
        stats = torch.cuda.memory_stats()
    except (RuntimeError, AssertionError):
        return None
    made, freed = stats.get("allocation.all.allocated"), stats.get("allocation.all.freed")
    return None if made is None or freed is None else (made, freed)


_gc_lock = threading.Lock()
_gc_holds = 0
_gc_was_enabled = False


def _gc_hold(delta: int) -> None:
    """Garbage collection off while any thread captures; back as it was when the last ends."""
    global _gc_holds, _gc_was_enabled
    with _gc_lock:
        if delta > 0 and _gc_holds == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_holds += delta
        if _gc_holds == 0 and _gc_was_enabled:
            gc.enable()


def collect_young() -> None:
    """Collect the young generations' garbage: a reference cycle a forward just made (a view
    kept in a closure that refers to itself, a caught exception kept in a local) holds its
    tensors until a collection, and a use count read before it counts them (see _region.Slot).
    Not while a capture runs on any thread (see _gc_hold): the collection waits for none."""
    with _gc_lock:
        if not _gc_holds:
            gc.collect(1)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


class CudaBackend:
    """Warm-up and capture with ``torch.cuda``: one side stream per device and thread, reused.

    A first call's real call runs on the caller's stream, as the eager call it is (see
    ``warmup``): autograd runs each backward op on the stream its forward op ran on, and a
    parameter's gradient accumulation on the stream of the op that first used it, so the
    user's backward of that call, run later from any thread, would otherwise enqueue on the
    side stream, where a capture may be under way: the capturing stream would wait on
    uncaptured work (an error), or that backward would be recorded into the graph instead of
    running. And its tensors, the user's, are not kept in the side stream's cache once freed.
    The extra warm-ups, rehearsals and proofs run on the side stream, on copies, and the capture.

    Per thread, not per device: a warm-up's freed memory goes back to the side stream's cache,
    reused by the next warm-up there after it waits only for its own caller's stream. Captures
    stay one at a time per device (``_capturing``): a capture begins with a device sync and
    pauses garbage collection."""

    def __init__(self):
        self._local = threading.local()  # (its ``side``: device index -> this thread's stream)
        self._capture_locks: dict[int, threading.RLock] = {}
        self._lock = threading.Lock()
        # every side stream handed out, by (device, stream handle): torch's pool has 32 per
        # priority, so this stays small however many threads come and go
        self.side_streams: dict[tuple[int, int], torch.cuda.Stream] = {}

    def available(self) -> bool:
        return torch.cuda.is_available()

    def supports(self, device: torch.device) -> bool:
        return device.type == "cuda" and torch.cuda.is_available()

    def in_capture(self) -> bool:
        """True while the caller's stream is being captured (someone else's graph)."""
        return torch.cuda.is_initialized() and _stream_capturing()

    def _capturing(self, device: torch.device) -> threading.RLock:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            return self._capture_locks.setdefault(idx, threading.RLock())

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        streams = getattr(self._local, "side", None)
        if streams is None:
            streams = self._local.side = {}
        s = streams.get(idx)
        if s is None:
            s = streams[idx] = torch.cuda.Stream(device=idx)
            with self._lock:
                self.side_streams[(idx, s.cuda_stream)] = s
        return s

    @staticmethod
    def _prime(side: torch.cuda.Stream, idx: int) -> None:
        """Before a capture on ``side``: cuBLAS keeps a workspace per (this thread's handle,
        stream), made on first use with the caching allocator; made inside the capture, it would
        come from the graph's pool and keep that pool's memory for good (the real call does not
        run on the side stream, inference has no extra warm-up by default, and
        ``torch._C._cuda_clearCublasWorkspaces()``, which torch.compile's cudagraph trees call,
        drops them). A matmul with and without a bias (cuBLASLt's) in each common type makes
        any that is missing; one that exists costs a launch."""
        with torch.cuda.stream(side):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                a = torch.ones(8, 8, device=idx, dtype=dtype)
                try:
                    torch.mm(a, a)
                    torch.nn.functional.linear(a, a, a[0])
                except RuntimeError:  # (a type this GPU's cuBLAS lacks: its first use
                    pass              # makes the workspace, as before)

    def warmup(self, fn: Callable[[], Any], device: torch.device, on_side: bool = True) -> Any:
        """Run ``fn`` eagerly on the side stream that capture will use.

        Lazy initialisation (cuBLAS handles and workspaces, which are per stream; autotuning)
        then happens on the capture stream, outside the capture. The caller's stream waits for
        the side stream afterwards, so results are ordered as if ``fn`` ran on the caller's stream.

        ``on_side=False`` (a first call's real call: see the class): on the caller's stream,
        as an eager call; still one at a time with this device's captures."""
        with torch.cuda.device(device), self._capturing(device):
            if not on_side:
                return fn()
            cur = torch.cuda.current_stream()
            side = self._side_stream(device)
            side.wait_stream(cur)
            try:
                with torch.cuda.stream(side):
                    return fn()
            finally:
                cur.wait_stream(side)

    can_share = True  # captures can keep their CUgraph for share_graph to read
    # a capture records the device's kernels without running them (host work runs for real)
    capture_runs_kernels = False

    def capture(self, fn: Callable[[], Any], device: torch.device, pool=None,
                keep_graph: bool = False) -> tuple[RawGraph, Any]:
        """Capture ``fn`` into a new graph; returns the graph and ``fn``'s (static) outputs.

        ``keep_graph=True`` keeps the ``CUgraph`` readable (:meth:`RawGraph.cuda_graph`); the
        graph is then instantiated on its first replay.

        Raises :class:`CaptureFailed` when the capture itself fails (an operation that is not
        allowed while capturing, such as a host sync). The stream capture is always ended and
        the caller's stream restored, so later CUDA work runs normally.
        """
        # One capture at a time per device (it begins with a device sync; see the class).
        with torch.cuda.device(device), self._capturing(device):
            cur = torch.cuda.current_stream()
            side = self._side_stream(device)
            self._prime(side, torch.cuda.current_device())
            torch.cuda.synchronize()
            reserved = torch.cuda.memory_reserved()
            graph = torch.cuda.CUDAGraph(keep_graph=True) if keep_graph else torch.cuda.CUDAGraph()
            # An explicit pool id, so that a failed capture's pool can be released by id
            # (``graph.pool()`` is only available after a successful capture).
            if pool is None:
                pool = torch.cuda.graph_pool_handle()
            # Autocast caches casted weights; a cache entry made inside the capture would live in
            # the graph's pool and be reused outside it. Casts are recomputed inside the graph.
            autocast_cache = torch.is_autocast_cache_enabled()
            torch.clear_autocast_cache()
            torch.set_autocast_cache_enabled(False)
            side.wait_stream(cur)
            counted = _alloc_counts()
            t0 = time.perf_counter()
            failure: BaseException | None = None
            began = ended = False
            # A garbage collection inside the capture could destroy other graphs (their
            # destructors make CUDA calls a capturing thread may not make): it invalidates the
            # capture. Collection waits until the capture is over.
            _gc_hold(+1)
            try:
                with torch.cuda.stream(side):
                    try:
                        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                        began = True
                    except RuntimeError as e:  # (see _abandon: it may have begun part way)
                        failure = e
                    if began:
                        try:
                            out = fn()
                        except BaseException as e:  # noqa: BLE001 - re-raised below
                            failure = e
                        try:
                            graph.capture_end()
                            ended = True
                        except RuntimeError as e:
                            failure = failure or e
                            # (torch counts a capture ended, its routing ended and its share
                            # held by the graph, before it instantiates: a failure there)
                            ended = _capture_ended(graph)
            finally:
                # (a capture left open on the side stream: no stream may wait on it, and no
                # graph destructor may run while it is; see _end_dangling)
                dangling = not ended and self._end_dangling(side, device)
                _gc_hold(-1)
                torch.set_autocast_cache_enabled(autocast_cache)
                if not dangling:
                    cur.wait_stream(side)
            if failure is not None:
                if ended:  # the graph holds its share of the pool: reset gives it back
                    graph.reset()
                else:
                    if isinstance(pool, Pool):
                        pool.retired = True
                    _failed_graphs.append(graph)  # (see _failed_graphs)
                    if began:
                        self._recover(pool, side, device)
                    else:
                        self._abandon(pool, device, failure)
                del graph
                _check_healthy(failure)
                if not isinstance(failure, Exception):
                    raise failure  # KeyboardInterrupt, SystemExit: after cleanup, unchanged
                # An autograd graph kept alive from an earlier call holds parameters'
                # AccumulateGrad nodes made on the default stream; the engine then syncs that
                # stream with the capture. Worth retrying once that graph is gone.
                transient = "legacy stream depend on a capturing" in str(failure)
                raise CaptureFailed(_first_line(failure), transient) from failure
            seconds = time.perf_counter() - t0
            after = _alloc_counts()
            counts = None if after is None or counted is None else \
                (after[0] - counted[0], after[1] - counted[1])
            pool_bytes = max(0, torch.cuda.memory_reserved() - reserved)
            return RawGraph(graph, pool, pool_bytes, seconds, counts), out

    def _abandon(self, pool, device: torch.device, failure: BaseException) -> None:
        """Undo what a ``capture_begin`` that raised leaves behind. It puts the CUDA generator
        in capture mode and routes the thread's allocations to the pool before it asks CUDA to
        begin (and the allocator may refuse, "already recording to mempool_id"): left so, every
        later random op outside a graph fails, and every later capture into the pool. The
        routing is ended where it was made and the generator restored (see ``_recover``). The
        share of the pool the failed begin took is given back only where it is known to have
        been taken (the allocators count it before their "already recording" check): one given
        back that was not taken would free memory other graphs of the pool use, or abort in
        torch's own assertion; one kept only keeps the pool's memory reserved."""
        index = torch.cuda.current_device()
        try:
            torch._C._cuda_endAllocateToPool(index, pool)
        except RuntimeError:
            pass  # (not routed: it failed before that)
        if "already recording to mempool_id" in str(failure):
            torch._C._cuda_releasePool(index, pool)
        self._restore_generator(self._side_stream(device), device)

    def _end_dangling(self, side: torch.cuda.Stream, device: torch.device) -> bool:
        """Whether ``side`` was still under the failed capture, now ended: ``capture_end``
        raised before it ended it (``fn`` left another stream current), or ``capture_begin``
        raised after it began it. No stream may wait on a capturing one, and the stream goes
        back to torch's pool of streams: its capture is ended through the driver and the graph
        it made destroyed. False where it was not capturing, or could not be ended (then it is
        left to the caller's wait, which raises: a clear error, not a stream left capturing)."""
        if not self.stream_capturing(device, side.cuda_stream):
            return False
        from ._cugraph import DriverError, _fn
        try:
            end, destroy = _fn("cuStreamEndCapture"), _fn("cuGraphDestroy")
        except DriverError:
            return False
        graph = ctypes.c_void_p(0)
        end(ctypes.c_void_p(side.cuda_stream), ctypes.byref(graph))  # (fails: invalidated)
        if graph.value:
            destroy(graph)
        return not self.stream_capturing(device, side.cuda_stream)

    def _restore_generator(self, side: torch.cuda.Stream, device: torch.device) -> None:
        """A tiny capture that succeeds: it runs the CUDA generator's capture prologue and
        epilogue, which restores a generator a failed capture left in capture mode."""
        scratch = torch.zeros(1, device=device)
        fix = torch.cuda.CUDAGraph()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fix.capture_begin(capture_error_mode="thread_local")
            scratch.add_(1)
            fix.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        fix.reset()

    def _recover(self, pool, side: torch.cuda.Stream, device: torch.device) -> None:
        """Undo what a failed capture leaves behind (what can be undone from Python).

        ``capture_end`` raises before it ends the pool's routing in the host (pinned memory)
        allocator too, which has no Python binding to end it: a later capture into that pool
        fails to begin ("beginAllocateToPool: already recording to mempool_id", seen on the
        H200 with torch 2.11). The caller's :class:`Pool` is retired for that (see
        ``capture``).

        ``capture_end`` raises before it ends the CUDA generator's capture mode, after which every
        random op outside a graph fails ("Offset increment outside graph capture"). A tiny
        capture that succeeds runs the generator's prologue and epilogue and restores it. The
        failed capture's private memory pool is released too (PyTorch releases it only for
        captures that ended; one that ended gives its share back when reset, and releasing it
        again would take another graph's share of a pool they have in common).
        """
        index = torch.cuda.current_device()
        # capture_end raised before it ended the allocator's routing of this thread's
        # allocations to the pool: left registered, every later empty_cache() skips the
        # default pool (free segments stay reserved for the rest of the process).
        try:
            torch._C._cuda_endAllocateToPool(index, pool)
        except RuntimeError:
            pass  # already ended (capture_end failed after ending it)
        torch._C._cuda_releasePool(index, pool)
        self._restore_generator(side, device)

    def new_pool(self, device: torch.device) -> "Pool":
        """A fresh memory pool that several captures can share.

        A pool lives while a graph captured into it does; once its last graph is released its id
        cannot be captured into again (torch 2.11 asserts). So the pool carries a keeper: a
        one-kernel graph captured into it, alive as long as the pool object (and every
        ``RawGraph`` captured into it, which holds the pool object) is.
        """
        with torch.cuda.device(device), self._capturing(device):
            pool = Pool(torch.cuda.graph_pool_handle())
            cur, side = torch.cuda.current_stream(), self._side_stream(device)
            side.wait_stream(cur)
            keeper = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                scratch = torch.empty(1, device=device)
                keeper.capture_begin(pool=pool, capture_error_mode="thread_local")
                scratch.zero_()
                keeper.capture_end()
            cur.wait_stream(side)
            pool.keeper = (keeper, scratch)
            return pool

    def stream_token(self, device: torch.device) -> int:
        return torch._C._cuda_getCurrentRawStream(device.index)

    def clock(self, device: torch.device) -> Callable[[], float]:
        """Seconds, read once ``device`` has done the work queued so far (timing a piece's
        graph against its eager run: see _trial)."""
        def now() -> float:
            with self._capturing(device):  # (not while another thread captures)
                torch.cuda.synchronize(device)
            return time.perf_counter()
        return now

    def stream_getter(self, device: torch.device) -> Callable[[], int]:
        """``stream_token(device)`` as one C call (the replay path's)."""
        return functools.partial(torch._C._cuda_getCurrentRawStream, device.index)

    # The replay path's capture check: graphs exist, so CUDA is up.
    in_capture_now = staticmethod(_stream_capturing)

    def drain(self, device: torch.device, token: int) -> None:
        """Wait (on the host) until the work queued on stream ``token`` is done: memory a
        released graph used (static buffers, its pool) may be handed to another stream at once,
        and the caching allocator only orders reuse on the stream that allocated it."""
        if torch.cuda.is_initialized() and not _stream_capturing():
            torch.cuda.ExternalStream(token, device=device).synchronize()

    def drain_all(self, device: torch.device) -> None:
        """Wait (on the host) until all the work queued on ``device`` is done: a graph that
        several callables replayed (a shared policy's), each on a stream of its own, is
        released."""
        if torch.cuda.is_initialized() and not _stream_capturing():
            torch.cuda.synchronize(device)

    def stream_capturing(self, device: torch.device, token: int) -> bool:
        """Whether stream ``token`` is under a capture (another thread's own
        ``torch.cuda.graph``): no stream may wait on it, nor the host (see _engine). The
        driver's ``cuStreamIsCapturing`` (about 1 µs), else that stream made current a moment."""
        if not token or token == MULTI_STREAM:  # (the legacy default stream never captures)
            return False
        query = _stream_capture_query()
        if query is not None:
            status = ctypes.c_int(0)
            if query(ctypes.c_void_p(token), ctypes.byref(status)) == 0:
                return status.value != 0  # (active, or invalidated and not yet ended)
        with torch.cuda.stream(torch.cuda.ExternalStream(token, device=device)):
            return _stream_capturing()

    def order_after(self, device: torch.device, token: int) -> None:
        """Make the caller's current stream wait for work queued on stream ``token``."""
        torch.cuda.current_stream(device).wait_stream(torch.cuda.ExternalStream(token, device=device))


def _check_healthy(cause: BaseException) -> None:
    try:
        torch.cuda.synchronize()
    except RuntimeError as e:  # a sticky CUDA error: nothing on this process can recover it
        raise CudagraphifyError(
            f"CUDA is unusable after a failed capture ({_first_line(e)}); the capture failed "
            f"with {_first_line(cause)}"
        ) from cause


_backend: Any = CudaBackend()
# the graph objects of the captures that failed part way, kept for the process: the host
# allocator's routing entry such a capture leaves (no Python binding ends it) refers to its
# graph object, which must outlive it (a few bytes each)
_failed_graphs: list = []


def _capture_ended(graph: torch.cuda.CUDAGraph) -> bool:
    """Whether torch counts ``graph``'s capture ended (``pool()`` answers only then) although
    ``capture_end`` raised: it failed after that (instantiating)."""
    try:
        graph.pool()
    except RuntimeError:
        return False
    return True


_query: list = []  # the driver's cuStreamIsCapturing, or None: looked up once


def _stream_capture_query():
    if not _query:
        from ._cugraph import DriverError, _fn
        try:
            f = _fn("cuStreamIsCapturing")
            f.argtypes, f.restype = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)], ctypes.c_int
        except DriverError:
            f = None
        _query.append(f)
    return _query[0]


# a stream token that stands for several streams: a callable's own region used by threads on
# streams of their own (see _region.GraphRegion.enter_run); never a real stream's
MULTI_STREAM = -1


def drain(device: torch.device | None, token: int | None) -> None:
    """Wait until the work queued on stream ``token`` is done, before memory a graph used is
    released (the allocator may hand it to another stream at once); a no-op for a backend
    without streams."""
    if device is None or token is None:
        return
    if token == MULTI_STREAM:
        drain_all(device)
        return
    fn = getattr(_backend, "drain", None)
    if fn is not None:
        fn(device, token)


def drain_all(device: torch.device | None) -> None:
    """Wait until all the work queued on ``device`` is done, before memory a graph that any
    callable may have replayed is released (see :func:`drain`)."""
    fn = getattr(_backend, "drain_all", None)
    if device is not None and fn is not None:
        fn(device)


def default_backend():
    return _backend


def set_backend(backend) -> Any:
    """Swap the backend (tests); returns the previous one."""
    global _backend
    old, _backend = _backend, backend
    return old
