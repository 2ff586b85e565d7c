"""Shared bits of the review scripts of 1d05912 (a StateGuard holds its callable's own module
tree weakly, so that a shared policy's or an open region's cache frees a deleted module) and
1ebb457 (a region graph blocked by a later graph's held output is captured again after three
blocked calls with at most one use of it between).

DEV (env, default "cuda"): the device. DEV=cpu runs the CPU double of tests/conftest.py (the
simulated capture backend, which graphs CPU tensors): a smoke test of the scripts; the GPU is
what they are for (memory actually freed, streams). Every graphed output is compared bitwise
(torch.equal) with an eager twin (a deep copy made before graphify). One line per check: PASS /
FAIL (with numbers), INFO for measurements.

Lines marked [finding] FAIL on the code reviewed (the issue reproduces); [control] lines PASS;
[suspicion] lines: FAIL = reproduced (a question the CPU double cannot answer).

Memory: on a GPU, ``leftover(fn)`` is what torch.cuda.memory_allocated() still counts after the
module ``fn`` built was deleted and collected (the bytes a cache entry keeps); on the CPU double
the simulated graphs hold every storage they captured, so there it reports the Python objects
still alive instead (weak references), in the same units: the bytes of the tensors alive."""
import copy
import gc
import os
import sys
import time
import warnings
import weakref

import torch

import cudagraphify as cg

warnings.simplefilter("ignore")

DEV = os.environ.get("DEV", "cuda")
if DEV.startswith("cuda") and not torch.cuda.is_available():
    print("INFO no CUDA device: DEV=cpu (the CPU double)", flush=True)
    DEV = "cpu"
CPU = DEV == "cpu"
_HERE = os.path.dirname(os.path.abspath(__file__))
_TESTS = os.path.join(_HERE, "..", "..", "..", "tests")
if CPU:
    sys.path.insert(0, _TESTS)
    from conftest import SimBackend
    from cudagraphify import _capture
    _capture.set_backend(SimBackend())

FAILS = []
VIEW = "still referenced through a view"
MIB = 1 << 20


def check(ok, what, detail=""):
    if not ok:
        FAILS.append(what)
    print(f"{'PASS' if ok else 'FAIL'} {what}" + (f": {detail}" if detail else ""), flush=True)


def info(what):
    print(f"INFO {what}", flush=True)


def sync():
    if not CPU:
        torch.cuda.synchronize()


def allocated() -> int:
    sync()
    gc.collect()
    return 0 if CPU else torch.cuda.memory_allocated()


class Tracked:
    """Weak references to tensors (CPU double: which of them are still alive, in bytes)."""

    def __init__(self):
        self.refs = []

    def add(self, *tensors):
        for t in tensors:
            self.refs.append((weakref.ref(t), t.numel() * t.element_size()))

    def alive_bytes(self) -> int:
        gc.collect()
        return sum(n for r, n in self.refs if r() is not None)


def leftover(base: int, tracked: Tracked) -> int:
    """Bytes still held since ``base`` (GPU: allocated; CPU double: tracked tensors alive)."""
    return tracked.alive_bytes() if CPU else allocated() - base


def timed(fn, n=1):
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t) / n


def twin(module, **options):
    """The eager twin (a deep copy made first) and ``module`` graphified in place."""
    ref = copy.deepcopy(module)
    return ref, cg.graphify(module, **options)


def finish():
    print(f"INFO {len(FAILS)} FAIL line(s)", flush=True)
