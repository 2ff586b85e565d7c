"""[finding] A first call's backward run on ANOTHER thread than its forward, while the forward's
thread captures (6c0e2ee keys the side stream on the thread, not on the call).

The real call of a first call runs its forward on the calling thread's side stream
(``CudaBackend.warmup``); autograd runs each backward op on its forward op's stream, so that
call's backward enqueues on THAT thread's side stream, whoever calls ``.backward()`` and when.
An executor does exactly this: worker W runs ``model(x)`` (a first call), the caller gets the
output and runs the backward, while W already runs the next task, a first call of another
signature or module, which captures on W's side stream. Then the backward either fails
("dependency created on uncaptured work in another stream", or the legacy stream joining a
capture) or is recorded into W's graph instead of running (gradients stay as they were: the
``.grad`` are zeroed first, so an accumulation that never ran shows).

Lines:
- [control] the backward after W's capture ended: gradients as eager's.
- [finding] the backward while W captures (idle before: False / True; True waits 50 ms so the
  forward is done on the GPU, as tests/test_gpu_faults.py's new test does).
Run from the repository root: python3 .ci/review/threads3/a_backward_other_thread.py
"""
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("a_backward_other_thread.py")
import torch  # noqa: E402
import cudagraphify as cg  # noqa: E402


def scenario(overlap: bool, idle: bool) -> str:
    ref_a, ga = C.pair(C.Net, seed=0)
    ref_b, gb = C.pair(C.Gated, seed=1)
    C.zero_grads(ref_a, ga)
    x, xb = C.x_(), C.x_()
    errors = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        # the worker's first call of ga (grad mode): its forward on the worker's side stream
        out = pool.submit(lambda: ga(x)).result(30)
        want = ref_a(x)
        if not torch.equal(out, want):
            return "ga's first call (on the worker) differs from eager"
        w_side = pool.submit(C.side_token).result(30)
        reached, release = C.arm(gb)

        def b_first_call():
            with torch.no_grad():
                return gb(xb)  # warm-up, then a capture on the worker's side stream (gated)

        if not overlap:
            release.set()
        fut = pool.submit(b_first_call)
        try:
            if overlap:
                if not reached.wait(20):
                    return "the worker never reached its capture"
                if idle:
                    time.sleep(0.05)
            else:
                fut.result(30)  # the worker's capture is over
            try:
                out.sum().backward()  # on the caller's thread: ops on the worker's side stream
                want.sum().backward()
                C.sync()
            except Exception as e:  # noqa: BLE001 - reported
                errors.append(("caller's backward", e))
        finally:
            release.set()
        try:
            out_b = fut.result(30)
        except Exception as e:  # noqa: BLE001 - reported
            errors.append(("worker's first call of gb", e))
            out_b = None
    C.disarm(gb)
    C.sync_all()
    if errors:
        return C.first_error(errors)
    why = C.grads_close(list(ga.parameters()), list(ref_a.parameters()))
    if why:
        return f"ga's gradients: {why} (its backward went into the worker's capture?)"
    with torch.no_grad():
        if not torch.equal(out_b, ref_b(xb)):
            return "gb's first call differs from eager"
    why = C.calls_match(ref_b, gb, 3) or C.calls_match(ref_a, ga, 2, grad=True)
    if why:
        return f"later calls: {why}"
    C.info(f"worker side stream {w_side:#x}; gb stats: captures={cg.stats(gb).captures}, "
           f"eager={cg.stats(gb).eager}")
    cg.ungraphify(ga), cg.ungraphify(gb)
    return ""


for label, overlap, idle in (("[control] backward after the worker's capture", False, False),
                             ("[finding] backward while the worker captures (idle before: "
                              "False)", True, False),
                             ("[finding] backward while the worker captures (idle before: "
                              "True)", True, True)):
    try:
        why = scenario(overlap, idle)
    except Exception as e:  # noqa: BLE001
        why = f"{type(e).__name__}: {str(e)[:200]}"
    C.check(not why, f"{label}: a first call's forward on an executor worker, its backward on "
            "the caller: runs, gradients as eager's", why)
C.finish("a_backward_other_thread")
