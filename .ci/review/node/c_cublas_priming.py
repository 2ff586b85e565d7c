"""cuBLAS/cuBLASLt workspaces and inference captures, now that the real call no longer runs on
the side stream (99d7faa).

Inference has no extra warm-up by default (num_warmup_iters=1), so the capture is the first
matmul on the thread's side stream. cuBLAS keeps a workspace per (handle, stream), made with the
caching allocator on first use: made inside a capture it comes from the graph's private pool
and stays there (the pool never fully released; graph_pool_bytes grows by the workspace size,
``torch.backends.cuda.cublas_workspace_size()``). ``CudaBackend._side_stream`` primes a new side
stream (mm and linear+bias in fp32/bf16/fp16) to make them before any capture.

Measure: a capture's pool bytes minus those of the next signature's capture on the same thread
(where the workspace surely exists): a difference of half the workspace size or more means the
first capture made a workspace in its pool.

Lines:
- [control] one fresh thread per op/dtype (fp32 mm, fp32/bf16 linear+bias, fp16 linear, fp64
  and complex64 mm, fp16 bmm, int8 _int_mm where supported): no workspace in the capture's
  pool; replays bitwise as eager's.
- [finding?] ``torch._C._cuda_clearCublasWorkspaces()`` (what inductor's cudagraph trees call
  around every warm-up and recording: torch.compile(mode="reduce-overhead") in the same process)
  drops the primed workspaces; the side stream is primed only when made, and the inference real
  call that used to remake it there (before 99d7faa) now runs on the caller's stream: the next
  inference capture on that thread makes it in its pool. FAIL = it does (memory kept in a
  graph pool per thread and device; not a wrong value).
  The same after ``torch.cuda.empty_cache()`` (whether it drops them depends on the torch
  build: PASS there may just mean it does not).
- [baseline] INFO: a raw torch.cuda.graph capture of a matmul on a fresh stream after clearing
  (whether this torch/cuBLAS makes the workspace inside a capture at all: if that is small, the
  lines above cannot fail).
Run from the repository root: python3 .ci/review/node/c_cublas_priming.py
"""
import copy
import os
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("c_cublas_priming.py")
if C.CPU:
    print("SKIP c_cublas_priming.py: cuBLAS workspaces are a GPU matter", flush=True)
    sys.exit(0)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
import cudagraphify as cg  # noqa: E402

_size = getattr(torch.backends.cuda, "cublas_workspace_size", None)
try:
    WS = int(_size()) if _size is not None else 0
except Exception:  # noqa: BLE001
    WS = 0
if WS <= 0:
    WS = 4 << 20  # (torch's default outside Hopper: 4 MiB and a little)
C.info(f"cuBLAS workspace size {WS} bytes; device {torch.cuda.get_device_name()}")
# (a pool's first capture takes a 2 MiB segment for its small blocks, which the next capture
# reuses: seen on the H100 as a 2 MiB difference with no workspace in it; a workspace there is
# 32 MiB, as the line after clearing shows)
LIMIT = max(WS // 2, 8 << 20)


class Op(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        dtype = {"fp32 mm": torch.float32, "fp32 linear+bias": torch.float32,
                 "bf16 linear+bias": torch.bfloat16, "fp16 linear": torch.float16,
                 "fp64 mm": torch.float64, "complex64 mm": torch.complex64,
                 "fp16 bmm": torch.float16, "int8 _int_mm": torch.int8}[kind]
        self.dtype = dtype
        if dtype == torch.int8:
            self.register_buffer("w", torch.randint(-8, 8, (64, 64), device="cuda",
                                                    dtype=torch.int8))
        else:
            self.register_buffer("w", torch.randn(64, 64, device="cuda", dtype=dtype))
        self.register_buffer("b", torch.randn(64, device="cuda").to(dtype)
                             if dtype != torch.int8 else torch.zeros(1, device="cuda"))

    def x(self, rows: int) -> torch.Tensor:
        if self.dtype == torch.int8:
            return torch.randint(-8, 8, (rows, 64), device="cuda", dtype=torch.int8)
        if self.kind == "fp16 bmm":
            return torch.randn(4, rows, 64, device="cuda", dtype=self.dtype)
        return torch.randn(rows, 64, device="cuda", dtype=self.dtype)

    def forward(self, x):
        k = self.kind
        if k == "int8 _int_mm":
            return torch._int_mm(x, self.w)
        if k == "fp16 bmm":
            return torch.bmm(x, self.w.expand(x.shape[0], 64, 64))
        if k.endswith("linear+bias"):
            return F.linear(x, self.w, self.b)
        if k.endswith("linear"):
            return F.linear(x, self.w)
        return x @ self.w


def _pool_of(g, before: int) -> int:
    return cg.stats(g).graph_pool_bytes - before


def in_thread(fn):
    out = {}

    def run():
        try:
            with torch.no_grad():
                out["why"] = fn()
        except Exception as e:  # noqa: BLE001
            out["why"] = f"{type(e).__name__}: {str(e)[:200]}"
    th = threading.Thread(target=run)
    th.start()
    th.join(60)
    return out.get("why", "timed out")


def fresh(kind: str) -> str:
    torch.manual_seed(0)
    m = Op(kind)
    try:
        m(m.x(32))
    except RuntimeError as e:
        return f"SKIP: eager {kind} unsupported here ({str(e).splitlines()[0][:100]})"
    g = cg.graphify(copy.deepcopy(m))
    sizes = []
    for rows in (32, 40):  # two signatures: the second's capture is the reference
        before = cg.stats(g).graph_pool_bytes
        for _ in range(3):
            x = m.x(rows)
            got = g(x)
            want = m.forward(x)
            torch.cuda.synchronize()
            if not torch.equal(got, want):
                return f"rows={rows}: output differs from eager's ({C.stats_line(g)})"
        sizes.append(_pool_of(g, before))
    s = cg.stats(g)
    if s.eager or s.replays < 4:
        return f"not graphed as expected: {C.stats_line(g)}"
    C.info(f"{kind}: pool bytes first capture {sizes[0]}, second {sizes[1]}")
    if sizes[0] - sizes[1] >= LIMIT:
        return (f"the first capture's pool is {sizes[0] - sizes[1]} bytes larger than the "
                f"next one's: a cuBLAS workspace made inside it")
    cg.ungraphify(g)
    return ""


for kind in ("fp32 mm", "fp32 linear+bias", "bf16 linear+bias", "fp16 linear", "fp64 mm",
             "complex64 mm", "fp16 bmm", "int8 _int_mm"):
    why = in_thread(lambda kind=kind: fresh(kind))
    if why.startswith("SKIP"):
        print(f"SKIP [control] {kind}: {why[6:]}", flush=True)
        continue
    C.check(not why, f"[control] {kind} in a fresh thread: no workspace in the inference "
            "capture's pool, replays bitwise", why)


def after_clear(clear, what: str) -> str:
    torch.manual_seed(0)
    m = Op("fp32 linear+bias")
    g = cg.graphify(copy.deepcopy(m))
    g(m.x(32))  # first signature: side stream made and primed, captured
    g(m.x(32))
    torch.cuda.synchronize()
    clear()
    m.forward(m.x(8))  # the caller's own workspace made again, outside any capture
    torch.cuda.synchronize()
    sizes = []
    for rows in (40, 48):
        before = cg.stats(g).graph_pool_bytes
        for _ in range(3):
            x = m.x(rows)
            got, want = g(x), m.forward(x)
            torch.cuda.synchronize()
            if not torch.equal(got, want):
                return f"rows={rows}: output differs from eager's"
        sizes.append(_pool_of(g, before))
    C.info(f"after {what}: pool bytes next capture {sizes[0]}, then {sizes[1]}")
    if sizes[0] - sizes[1] >= LIMIT:
        return (f"the capture after {what} holds {sizes[0] - sizes[1]} more bytes: the side "
                "stream's cuBLAS workspace made inside it (in the graph's pool)")
    cg.ungraphify(g)
    return ""


for clear, what in ((torch._C._cuda_clearCublasWorkspaces,
                     "torch._C._cuda_clearCublasWorkspaces()"),
                    (torch.cuda.empty_cache, "torch.cuda.empty_cache()")):
    C.check(not (w := in_thread(lambda clear=clear, what=what: after_clear(clear, what))),
            f"[finding?] the next inference capture after {what} makes no cuBLAS workspace "
            "in its pool", w)


def baseline() -> str:
    torch._C._cuda_clearCublasWorkspaces()
    a = torch.randn(64, 64, device="cuda")
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    r0 = torch.cuda.memory_reserved()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        y = a @ a
    torch.cuda.synchronize()
    C.info(f"[baseline] raw capture of an unprimed stream's first matmul: pool bytes "
           f"{torch.cuda.memory_reserved() - r0} (workspace {WS})")
    graph.replay()
    torch.cuda.synchronize()
    ok = torch.equal(y, a @ a)
    del graph
    return "" if ok else "replay differs from eager"


C.check(not (w := in_thread(baseline)), "[baseline] raw capture replays bitwise", w)
C.finish("c_cublas_priming")
