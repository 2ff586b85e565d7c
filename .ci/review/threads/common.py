"""Shared bits of the review scripts of 8b11f19 (a piece neither moves nor overwrites an output
alias while another thread runs the root of its implicit region: GraphRegion.other_threads_run;
else that call runs eagerly, HELD_BY_ANOTHER_THREAD) and 4a11b5c (capture_sizes' first-sight
captures in a contextvar). CPU findings and controls: tests/test_review_threads.py.

DEV (env, default "cuda"): the device. DEV=cpu runs the CPU double of tests/conftest.py (the
simulated capture backend; no streams): a smoke test of the scripts, where the stream checks
pass by construction (said in an INFO line). Every graphed output is compared bitwise
(torch.equal) with an eager twin. One line per check: PASS / FAIL (with numbers), INFO for
measurements. [finding] lines FAIL on the code reviewed (on a GPU); [control] lines PASS;
[suspicion] lines: FAIL = reproduced."""
import os
import sys
import threading
import time
import warnings

import torch

from cudagraphify import _capture

warnings.simplefilter("ignore")

DEV = os.environ.get("DEV", "cuda")
if DEV.startswith("cuda") and not torch.cuda.is_available():
    print("INFO no CUDA device: DEV=cpu (the CPU double)", flush=True)
    DEV = "cpu"
CPU = DEV == "cpu"
_HERE = os.path.dirname(os.path.abspath(__file__))
if CPU:
    sys.path.insert(0, os.path.join(_HERE, "..", "..", "..", "tests"))
    from conftest import SimBackend
    _capture.set_backend(SimBackend())
    torch.set_num_threads(1)
# no piece or plan trial (they decide on the machine's speed): the pieces stay graphed
_capture.CudaBackend.clock = None

FAILS = []


def check(ok, what, detail=""):
    if not ok:
        FAILS.append(what)
    print(f"{'PASS' if ok else 'FAIL'} {what}" + (f": {detail}" if detail else ""), flush=True)


def info(what):
    print(f"INFO {what}", flush=True)


def sync():
    if not CPU:
        torch.cuda.synchronize()


def new_stream():
    """A stream of this thread's own (None on the CPU double)."""
    return None if CPU else torch.cuda.Stream()


class on:
    """``with on(stream):`` that stream current (nothing on the CPU double)."""

    def __init__(self, stream):
        self.ctx = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def gpu_sleep(ms: float = 200.0):
    """Queue a kernel that spins ~ms on the current stream (widens a race: what is queued
    behind it runs late). Nothing on the CPU double."""
    if not CPU:
        torch.cuda._sleep(int(ms * 1.5e6))  # (~1.5 GHz: an estimate; only the order matters)


def threads(*targets, timeout=120):
    """Run each target on a thread of its own (named A, B, ...); the exceptions they raised."""
    errors = []

    def wrap(fn):
        def run():
            try:
                with torch.no_grad():
                    fn()
            except Exception as e:  # noqa: BLE001
                errors.append(f"{threading.current_thread().name}: {e!r}"[:300])
        return run

    ts = [threading.Thread(target=wrap(fn), name=chr(ord("A") + i))
          for i, fn in enumerate(targets)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout)
    return errors


def timed(fn, n=1):
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t) / n


def finish():
    print(f"INFO {len(FAILS)} FAIL line(s)", flush=True)
