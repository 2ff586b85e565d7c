"""Shared bits of the review scripts of 2a3e79c and cd1f035 (Slot.thread, release_aliases at the
end of a root's run, sizes_log; GraphRegion.enter_run/exit_run/order_before_replay and
MULTI_STREAM). CPU findings and controls: tests/test_review_release.py.

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


class Worker:
    """A thread of its own (by name), on a stream of its own for its whole life, that runs what
    it is given (under no_grad), one at a time."""

    def __init__(self, name, stream=None):
        import queue
        self.q = queue.Queue()
        self.stream = stream
        self.t = threading.Thread(target=self._loop, name=name, daemon=True)
        self.t.start()

    def _loop(self):
        with on(self.stream):
            while True:
                fn, box, done = self.q.get()
                if fn is None:
                    return
                try:
                    with torch.no_grad():
                        box["out"] = fn()
                except BaseException as e:  # noqa: BLE001
                    box["err"] = f"{type(e).__name__}: {e}"[:300]
                done.set()

    def submit(self, fn):
        box, done = {}, threading.Event()
        self.q.put((fn, box, done))
        return box, done

    def run(self, fn, timeout=60):
        box, done = self.submit(fn)
        if not done.wait(timeout):
            box["err"] = "timed out"
        return box

    def stop(self):
        self.q.put((None, None, None))
        self.t.join(10)


_PAUSE = {}  # (thread name, stage) -> (event set there, event waited for there); used once


def pause(stage):
    p = _PAUSE.pop((threading.current_thread().name, stage), None)
    if p is not None:
        p[0].set()
        if not p[1].wait(30):
            raise RuntimeError(f"pause {stage}: never released")


def arm(thread, stage):
    """A pause of ``thread`` at ``stage`` (once): (reached, release) events."""
    p = _PAUSE[(thread, stage)] = (threading.Event(), threading.Event())
    return p
