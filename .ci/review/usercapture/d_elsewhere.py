"""Review of 7ec8df7 + dadf0ac (CAPTURED_ELSEWHERE). CPU side: tests/test_review_elsewhere.py.

Thread A captures a torch.cuda.graph of its own (capture_error_mode="thread_local") while
thread B, on its own stream, calls the same graphified callable:
  newsig_same / newsig_own [finding]: B's call has a shape not seen before: cudagraphify
    captures it, and CudaBackend.capture begins with torch.cuda.synchronize(), a device-wide
    sync during A's capture (CUDA refuses it: B raises, A's capture is invalidated). A on the
    stream that replayed last (stream=s) / on torch.cuda.graph's own stream.
  release_multi [finding]: pieces; B's run during A's capture (eager: CAPTURED_ELSEWHERE)
    leaves the root's region MULTI_STREAM; B then moves a piece's parameters: the release
    drains MULTI_STREAM = torch.cuda.synchronize(device) during A's capture.
  after_capture [control]: B's call during the capture runs eagerly, and B's calls after it
    replay again (bitwise eager, graphs replayed).
Every output is compared bitwise with an eager twin afterwards."""
import threading

import torch

from common import check, finish, info, isolated, pair, rand, run_threads


def scenario(kind, same_stream, between, tag):
    ref, g, call = pair(kind)
    s, sb = torch.cuda.Stream(), torch.cuda.Stream()
    static_x = rand()
    inside, done = threading.Event(), threading.Event()
    box = {}
    with torch.no_grad():
        sb.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(sb):
            for _ in range(3):
                call(g, rand())
        torch.cuda.synchronize()

    def a():
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


def newsig(same_stream):
    def between(g, call):
        out = []
        for _ in range(3):  # (first sight, then a capture of the new shape)
            x = torch.randn(5, 256, device="cuda")
            out.append((x, call(g, x)))
        return out
    where = "the stream that replayed last" if same_stream else "its own capture stream"
    scenario("whole", same_stream, between,
             f"[finding] whole, A captures on {where}, B calls a new shape")


def release_multi():
    def between(g, call):
        out = []
        x = rand()
        out.append((x, call(g, x)))
        for p in g.a.parameters():
            p.data = p.data.clone()  # (new memory: the piece's graphs are released)
        x = rand()
        out.append((x, call(g, x)))
        return out
    scenario("pieces", True, between,
             "[finding] pieces, B's run during A's capture, then a piece's parameters moved")


def after_capture(kind):
    import cudagraphify as cg

    def between(g, call):
        x = rand()
        return [(x, call(g, x))]
    tag = f"[control] {kind}, B's calls after A's capture"
    ref, g, call = scenario(kind, True, between, f"[control] {kind}, B during A's capture")
    stats = g if kind == "whole" else g.a
    before = cg.stats(stats).replays
    sb = torch.cuda.Stream()
    sb.wait_stream(torch.cuda.current_stream())
    pairs = []
    with torch.no_grad(), torch.cuda.stream(sb):
        for _ in range(3):
            x = rand()
            pairs.append((x, call(g, x)))
    torch.cuda.current_stream().wait_stream(sb)
    torch.cuda.synchronize()
    with torch.no_grad():
        check(all(torch.equal(y, call(ref, x)) for x, y in pairs), f"{tag}: eager's bits")
    check(cg.stats(stats).replays > before, f"{tag}: the graphs replay again",
          f"{cg.stats(stats).replays - before} replays")


isolated({"newsig_same": lambda: newsig(True), "newsig_own": lambda: newsig(False),
          "release_multi": release_multi,
          "after_whole": lambda: after_capture("whole"),
          "after_pieces": lambda: after_capture("pieces")}, timeout=10)
finish()
