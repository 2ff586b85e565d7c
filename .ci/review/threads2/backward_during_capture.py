"""Hypothesis for the intermittent hooks control "another thread's code and first call while a
first call holds the patches" ("CUDA error: dependency created on uncaptured work in another
stream", raised in thread A): not yet run on a GPU.

A first call's real call runs its forward on the device's side stream (``CudaBackend.warmup``),
the stream captures use, one per device for all threads. Autograd runs each backward op on the
stream its forward op ran on, so the *backward* of that real call, which the user runs later,
enqueues on the side stream too, and no lock is held then. If another thread is capturing on
the side stream at that moment, that backward work either makes the capturing stream wait on
uncaptured work (the error above, raised in the backward's thread) or, without such a wait, is
recorded into the other thread's graph instead of running: thread A's gradients would be
missing (silent) and thread B's graph would replay A's backward kernels.

Made deterministic: thread B's forward, while captured, waits until thread A ran the backward of
its first call's output. Lines: PASS/FAIL per check; ``FAIL`` on the first is the hypothesis
confirmed. Run from the repository root: ``python3 .ci/review/threads2/backward_during_capture.py``.
"""
import copy
import os
import sys
import threading
import time
import warnings

import torch
from torch import nn

if not torch.cuda.is_available():
    print("SKIP backward_during_capture.py: needs a CUDA GPU")
    sys.exit(0)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
import cudagraphify as cg  # noqa: E402

warnings.simplefilter("ignore")
DEV = "cuda"


class Waits(nn.Module):
    """While captured (only then), lets thread A go and waits until A's backward is done."""

    def __init__(self, captured: threading.Event, done: threading.Event):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.captured, self.done = captured, done

    def forward(self, x):
        h = self.lin(x)
        if torch.cuda.is_current_stream_capturing() and not self.captured.is_set():
            self.captured.set()
            self.done.wait(20)
        return torch.relu(h)


def scenario(sync_before_backward: bool) -> str | None:
    torch.manual_seed(0)
    ref_a = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).to(DEV)
    a = cg.graphify(copy.deepcopy(ref_a))
    captured, done = threading.Event(), threading.Event()
    b = cg.graphify(Waits(captured, done).to(DEV))
    x = torch.randn(8, 64, device=DEV)
    out = a(x)  # A's first call: its real call's forward ran on the side stream
    want = ref_a(x)
    errors = []

    def thread_b():
        try:
            with torch.no_grad():
                for _ in range(2):
                    b(torch.randn(8, 64, device=DEV))
        except BaseException as e:  # noqa: BLE001
            errors.append(("B", e))
        finally:
            captured.set()

    th = threading.Thread(target=thread_b)
    th.start()
    try:
        if not captured.wait(20):
            return "thread B never reached its capture"
        if sync_before_backward:
            # (A's forward done on the GPU, so its backward has no cross-stream wait left to
            # fail: a silent recording into B's graph is what would remain. Not a device sync:
            # that is refused while any stream captures, whatever cudagraphify does)
            time.sleep(0.05)
        try:
            out.sum().backward()
            want.sum().backward()
            torch.cuda.current_stream().synchronize()
        except BaseException as e:  # noqa: BLE001
            errors.append(("A", e))
    finally:
        done.set()
        th.join(30)
    torch.cuda.synchronize()
    if errors:
        who, e = errors[0]
        return f"thread {who}: {type(e).__name__}: {str(e)[:160]}"
    for p, q in zip(a.parameters(), ref_a.parameters()):
        if p.grad is None or not torch.allclose(p.grad, q.grad, rtol=2e-5, atol=2e-6):
            return (f"thread A's gradients are not eager's (missing: {p.grad is None}): its "
                    "backward went into thread B's capture?")
    return None


for sync in (False, True):
    try:
        why = scenario(sync)
    except Exception as e:  # noqa: BLE001
        why = f"{type(e).__name__}: {str(e)[:200]}"
    what = (f"[hypothesis] a first call's backward while another thread captures (idle "
            f"before: {sync}): runs, gradients as eager's")
    print(f"PASS {what}" if why is None else f"FAIL {what}: {why}", flush=True)
