"""Shared bits of the review scripts of 2a3e79c and cd1f035 (Slot.thread, release_aliases at the
end of a root's run, sizes_log; GraphRegion.enter_run/exit_run/order_before_replay and
MULTI_STREAM). CPU findings and controls: tests/test_review_release.py."""

import importlib.util
import os
import threading

import torch

# the helpers of .ci/review/threads/common.py (device, checks, streams, timing), not copied
_spec = importlib.util.spec_from_file_location(
    "_threads_common", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "threads",
                                    "common.py"))
_threads = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_threads)
globals().update({k: v for k, v in vars(_threads).items() if not k.startswith("__")})


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
