"""[finding] Thread A warms a graphified callable up on stream s (its graphs replay there: s
is the stream that replayed last) and captures it in a torch.cuda.graph of its own ON s
(``stream=s``, capture_error_mode="thread_local"); meanwhile thread B calls it on its own
stream. B's replay orders after the stream that replayed last (_engine._replay:
``order_after(holder._stream_token)``), A's capturing stream: B's stream joins A's capture,
B's replay is captured instead of run (B's output is not eager's) and A's capture ends
unjoined. For "whole" (one graph) and "pieces" (a root's implicit region).
[control] the same with A capturing on torch.cuda.graph's own stream (not the last one)."""
import threading

import torch

from common import check, finish, info, isolated, pair, rand, run_threads


def scenario(kind, same_stream):
    ref, g, call = pair(kind)
    s, sb = torch.cuda.Stream(), torch.cuda.Stream()
    static_x, xb = rand(), rand()
    inside, done = threading.Event(), threading.Event()
    box = {}
    with torch.no_grad():
        sb.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(sb):  # (B's stream has cached blocks and has replayed once)
            for _ in range(3):
                call(g, rand())
        torch.cuda.synchronize()

    def a():
        with torch.no_grad():
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):  # the user's warm-up: s replays last
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
                box["b"] = call(g, xb)
        finally:
            done.set()

    errors = run_threads(a, b)
    try:
        torch.cuda.synchronize()
    except RuntimeError as e:
        errors["sync"] = str(e).splitlines()[0]
    tag = f"[{'finding' if same_stream else 'control'}] {kind}, A captures on " \
          f"{'the stream that replayed last' if same_stream else 'its own capture stream'}"
    check("A" not in errors, f"{tag}: A's capture succeeds", errors.get("A", ""))
    check("B" not in errors, f"{tag}: B's call returns", errors.get("B", ""))
    with torch.no_grad():
        if "b" in box:
            check(torch.equal(box["b"], call(ref, xb)), f"{tag}: B's output is eager's")
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


isolated({f"{kind}_{'same' if same else 'own'}": (lambda k=kind, s=same: scenario(k, s))
          for kind in ("whole", "pieces") for same in (False, True)})
finish()
