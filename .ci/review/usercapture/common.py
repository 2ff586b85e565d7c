"""Shared bits of the review scripts of edbdfad (a root's run inside a capture of the user's
own runs plain and is no stream of its implicit region). CPU findings and controls:
tests/test_review_usercapture.py. GPU only: without CUDA each script prints one SKIP line.

One line per check: PASS / FAIL (with the exception or numbers), INFO for the rest. Every
output is compared bitwise (torch.equal) with an eager twin computed afterwards on the main
stream. [finding] lines FAIL on the code reviewed; [control] lines PASS."""
import copy
import sys
import threading
import traceback
import warnings

import torch
from torch import nn

warnings.simplefilter("ignore")

if not torch.cuda.is_available():
    print("SKIP no CUDA device", flush=True)
    sys.exit(0)

import cudagraphify as cg  # noqa: E402
from cudagraphify import _capture  # noqa: E402

# no piece or plan trial (they decide on the machine's speed): the pieces stay graphed
_capture.CudaBackend.clock = None

DIM = 256
FAILS = []


def check(ok, what, detail=""):
    if not ok:
        FAILS.append(what)
    print(f"{'PASS' if ok else 'FAIL'} {what}" + (f": {detail}" if detail else ""), flush=True)


def info(what):
    print(f"INFO {what}", flush=True)


def short(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"


class Ctx:
    """An argument no signature can hold (as an HF DynamicCache): the root plans around it."""

    def __init__(self, scale):
        self.scale = scale


class AroundCtx(nn.Module):
    """Capturable whole; piecewise only because of its opaque argument (pieces a and b)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x, ctx):
        return self.b(self.a(x) * ctx.scale)


def pair(kind):
    """(eager model, graphified copy, call(model, x)) for kind "whole" (one Linear: one graph)
    or "pieces" (AroundCtx: pieces chained in the root's implicit region)."""
    torch.manual_seed(0)
    if kind == "whole":
        ref = nn.Linear(DIM, DIM).cuda()
        return ref, cg.graphify(copy.deepcopy(ref)), (lambda m, x: m(x))
    ref = AroundCtx().cuda()
    ctx = Ctx(0.5)
    return ref, cg.graphify(copy.deepcopy(ref)), (lambda m, x: m(x, ctx))


_GEN = []


def rand(rows=8):
    """Inputs from a CUDA generator of their own: thread B draws them during A's capture,
    which holds the default generator (a draw from it there raises "Offset increment outside
    graph capture", the script's error, not cudagraphify's)."""
    if not _GEN:
        _GEN.append(torch.Generator(device="cuda").manual_seed(0))
    return torch.randn(rows, DIM, device="cuda", generator=_GEN[0])


def run_threads(a, b, timeout=8):
    """Run a() on thread "A" and b() on thread "B"; exceptions are returned by name."""
    errors = {}

    def wrap(name, fn):
        def go():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported as a FAIL line
                errors[name] = short(e)
                traceback.print_exc(file=sys.stderr)
        return go

    ts = [threading.Thread(target=wrap("A", a), name="A"),
          threading.Thread(target=wrap("B", b), name="B")]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    if any(t.is_alive() for t in ts):
        errors["hung"] = "a thread did not finish in time"
    return errors


def finish():
    print(f"INFO {len(FAILS)} FAIL line(s)", flush=True)


def isolated(scenarios, timeout=10):
    """Run each of ``scenarios`` ({name: fn}) in a process of its own (a capture that failed
    may leave CUDA or the allocator unusable for the next one): ``python script.py NAME``
    runs one; no argument runs them all, one after the other, each under ``timeout``."""
    import subprocess

    if len(sys.argv) > 1:
        try:
            scenarios[sys.argv[1]]()
        except Exception as e:  # noqa: BLE001 - one FAIL line
            check(False, f"{sys.argv[1]} ran", short(e))
        return
    for name in scenarios:
        try:
            r = subprocess.run([sys.executable, sys.argv[0], name], capture_output=True,
                               text=True, timeout=timeout)
            sys.stdout.write(r.stdout)
            sys.stderr.write(r.stderr)
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("PASS", "FAIL"))]
            if r.returncode != 0 or not lines:
                tail = (r.stderr.strip().splitlines() or [""])[-1]
                check(False, f"{name} exited rc={r.returncode}", tail[:200])
        except subprocess.TimeoutExpired:
            check(False, f"{name} timed out after {timeout} s")
        sys.stdout.flush()


def capture_race(kind, same_stream, between, tag):
    """Thread A warms ``pair(kind)``'s graphified model up on stream s (s replays last) and
    captures it in a torch.cuda.graph of its own (thread_local mode), on s itself
    (``same_stream``) or on the capture's own stream; meanwhile thread B, on its own stream,
    runs ``between(g, call)`` -> [(x, y)]. Checks: A's capture and B's calls succeed, B's
    outputs and the user's graph replays are eager's bits. Returns (ref, g, call)."""
    ref, g, call = pair(kind)
    s, sb = torch.cuda.Stream(), torch.cuda.Stream()
    static_x = rand()
    inside, done, ready = threading.Event(), threading.Event(), threading.Event()
    box = {"keep": [p.data for p in g.parameters()]}  # (A's graph reads these)
    with torch.no_grad():
        sb.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(sb):
            for _ in range(3):
                call(g, rand())
        torch.cuda.synchronize()

    def a():
        assert ready.wait(5), "B did not warm up"
        with torch.no_grad():
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):  # (the user's warm-up: s replays last)
                for _ in range(3):
                    call(g, static_x)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            try:
                kw = {"stream": s} if same_stream else {}
                with torch.cuda.graph(graph, capture_error_mode="thread_local", **kw):
                    box["y"] = call(g, static_x)
                    inside.set()
                    assert done.wait(5), "B did not finish"
            finally:
                inside.set()
            box["graph"] = graph

    def b():
        # (a thread's first cuBLAS call creates its handle: during A's capture CUDA refuses
        # that, and A's capture is invalidated whatever runs it, eager torch included)
        with torch.no_grad(), torch.cuda.stream(sb):
            call(ref, rand())
        torch.cuda.synchronize()
        ready.set()
        assert inside.wait(5)
        try:
            with torch.no_grad(), torch.cuda.stream(sb):
                box["b"] = between(g, call)
        finally:
            done.set()

    errors = run_threads(a, b, timeout=8)
    try:
        torch.cuda.synchronize()
    except RuntimeError as e:
        errors["sync"] = str(e).splitlines()[0]
    check("A" not in errors, f"{tag}: A's capture succeeds", errors.get("A", ""))
    check("B" not in errors, f"{tag}: B's calls return", errors.get("B", ""))
    with torch.no_grad():
        if "b" in box:
            ok = all(torch.equal(y, call(ref, x)) for x, y in box["b"])
            check(ok, f"{tag}: B's outputs are eager's")
        if "graph" in box and "A" not in errors:
            ok = True
            for _ in range(3):
                static_x.copy_(rand())
                box["graph"].replay()
                torch.cuda.synchronize()
                ok = ok and torch.equal(box["y"], call(ref, static_x))
            check(ok, f"{tag}: the user's graph replays eager's bits")
    if errors:
        info(f"{tag}: {errors}")
    return ref, g, call
