"""[finding] Two threads' side streams are one stream again: torch's pool hands out its 32
streams per priority in turn, and ``CudaBackend._side_stream`` takes a new one (``torch.cuda
.Stream()``) for every thread that makes a first call. Short-lived threads (ThreadPoolExecutor
churn, ``asyncio.to_thread``, a server's 33rd worker) reach a stream a live thread already uses
as its side stream; then that live thread's first-call backward meets the other thread's
capture on it exactly as before 6c0e2ee (the README's "so it never meets another thread's
capture" holds only while fewer than 32 pool streams were taken since).

Made deterministic: the main thread makes a first call (its forward on its side stream S) and
keeps the output; short-lived threads then each make a first call of a small graphed function
of their own (each takes the pool's next stream) until one's side stream is S (at most 32);
that thread then makes a first call of a gated module, which captures on S and waits; the main
thread runs its output's backward meanwhile.

Lines:
- [control] the same, with the first thread whose side stream is NOT S: gradients as eager's.
- [finding] the thread whose side stream is S: the backward fails or is swallowed (``.grad``
  zeroed first: an accumulation that never ran shows).
Run from the repository root: python3 .ci/review/threads3/b_pool_collision.py
"""
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("b_pool_collision.py")
import torch  # noqa: E402
import cudagraphify as cg  # noqa: E402

MAX_THREADS = 40  # the pool has 32 streams per priority: a collision within 32 new threads


def scenario(collide: bool) -> str:
    ref_a, ga = C.pair(C.Net, seed=0)
    ref_b, gb = C.pair(C.Gated, seed=1)
    C.zero_grads(ref_a, ga)
    x, xb = C.x_(), C.x_()
    out = ga(x)  # the main thread's first call: its forward on the main thread's side stream
    want = ref_a(x)
    if not torch.equal(out, want):
        return "ga's first call differs from eager"
    mine = C.side_token()
    reached, release = C.arm(gb)
    state: dict = {}
    errors = []

    def short_lived(k: int) -> None:
        try:
            @cg.graphify
            def tiny(t):  # a first call of its own (a new graphed function): takes a stream
                return t * 2 + 1

            with torch.no_grad():
                t = C.x_(4, 8)
                if not torch.equal(tiny(t), t * 2 + 1):
                    errors.append((f"thread {k}", AssertionError("tiny differs from eager")))
            tok = C.side_token()
            if (tok == mine) != collide:
                return
            state["thread"], state["token"] = k, tok
            with torch.no_grad():
                state["b"] = gb(xb)  # warm-up, then a capture on this thread's side stream
        except Exception as e:  # noqa: BLE001 - reported
            errors.append((f"thread {k}", e))
        finally:
            if "thread" in state and state["thread"] == k:
                reached.set()  # (also when its capture never came: the main thread goes on)

    th = None
    try:
        for k in range(MAX_THREADS):
            th = threading.Thread(target=short_lived, args=(k,))
            th.start()
            while th.is_alive() and not reached.is_set():
                reached.wait(0.005)
            if reached.is_set() or errors:
                break
            th.join()
        if errors:
            return C.first_error(errors)
        if not reached.is_set():
            return f"no thread's side stream was {'' if collide else 'not '}the main one's " \
                   f"in {MAX_THREADS} threads"
        C.info(f"thread {state['thread']} (after {state['thread']} short-lived threads): side "
               f"stream {state['token']:#x}, the main thread's {mine:#x}")
        time.sleep(0.05)  # (the main thread's forward done on the GPU)
        try:
            out.sum().backward()  # its ops on the main thread's side stream
            want.sum().backward()
            C.sync()
        except Exception as e:  # noqa: BLE001 - reported
            errors.append(("main thread's backward", e))
    finally:
        release.set()
        if th is not None:
            th.join(30)
    C.disarm(gb)
    C.sync_all()
    if errors:
        return C.first_error(errors)
    why = C.grads_close(list(ga.parameters()), list(ref_a.parameters()))
    if why:
        return f"ga's gradients: {why} (its backward went into the other thread's capture?)"
    if "b" not in state:
        return "gb's first call returned nothing"
    with torch.no_grad():
        if not torch.equal(state["b"], ref_b(xb)):
            return "gb's first call differs from eager"
    why = C.calls_match(ref_b, gb, 3) or C.calls_match(ref_a, ga, 2, grad=True)
    if why:
        return f"later calls: {why}"
    cg.ungraphify(ga), cg.ungraphify(gb)
    return ""


for label, collide in (("[control] a short-lived thread with another side stream", False),
                       ("[finding] a short-lived thread whose pool stream is the main thread's "
                        "side stream", True)):
    try:
        why = scenario(collide)
    except Exception as e:  # noqa: BLE001
        why = f"{type(e).__name__}: {str(e)[:200]}"
    C.check(not why, f"{label} captures while the main thread runs its first call's backward: "
            "runs, gradients as eager's", why)
C.finish("b_pool_collision")
