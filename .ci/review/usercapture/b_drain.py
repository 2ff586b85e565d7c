"""[finding] Thread A warms up on stream s and captures on s (as a_same_stream); meanwhile
thread B moves the graphified module's weight (``.data = clone``: new memory) and calls it:
B's call releases the graphs (invalidate -> release) after draining the stream that
replayed last, A's capturing s (CudaBackend.drain checks only B's own stream):
cudaStreamSynchronize on a capturing stream fails (B's call raises) and invalidates A's
capture. [control] the same with A capturing on torch.cuda.graph's own stream."""
import threading

import torch

from common import check, finish, info, isolated, pair, rand, run_threads


def scenario(same_stream):
    ref, g, call = pair("whole")
    s, sb = torch.cuda.Stream(), torch.cuda.Stream()
    static_x, xb = rand(), rand()
    inside, done = threading.Event(), threading.Event()
    box = {"keep": g.weight.data}  # (A's capture reads this memory: kept alive)

    def a():
        with torch.no_grad():
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
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
                g.weight.data = g.weight.data.clone()
                box["b"] = call(g, xb)
        finally:
            done.set()

    errors = run_threads(a, b)
    try:
        torch.cuda.synchronize()
    except RuntimeError as e:
        errors["sync"] = str(e).splitlines()[0]
    tag = f"[{'finding' if same_stream else 'control'}] B releases while A captures on " \
          f"{'the stream that replayed last' if same_stream else 'its own capture stream'}"
    check("A" not in errors, f"{tag}: A's capture succeeds", errors.get("A", ""))
    check("B" not in errors, f"{tag}: B's call returns", errors.get("B", ""))
    with torch.no_grad():
        if "b" in box:
            check(torch.equal(box["b"], call(ref, xb)), f"{tag}: B's output is eager's")
        if "graph" in box and "A" not in errors:
            static_x.copy_(rand())
            box["graph"].replay()
            torch.cuda.synchronize()
            check(torch.equal(box["y"], call(ref, static_x)),
                  f"{tag}: the user's graph replays eager's bits")
    if errors:
        info(f"{tag}: {errors}")


isolated({"own": lambda: scenario(False), "same": lambda: scenario(True)})
finish()
