"""Shared bits of the thrash/kinds review scripts (commits d21c591 and 99043f9).

DEV (env, default "cuda"): the device. DEV=cpu runs the CPU double of tests/conftest.py (the
simulated capture backend, which graphs CPU tensors) and, for HF static caches, the
device-counter stand-in of tests/test_review_hfcache.py: a smoke test of the scripts; the GPU
is what they are for. Every graphed output is compared bitwise (torch.equal) with an eager
twin (a deep copy made before graphify). One line per check: PASS / FAIL (with counters),
INFO for measurements.

Finding lines (marked [finding]) FAIL on the code reviewed (the issue reproduces); control
lines (marked [control]) PASS. "rule off" numbers come from setting _cache.THRASH_EVICTIONS or
(the kind rule was withdrawn) in this process: the behaviour before the commits."""
import copy
import os
import sys
import time
import warnings

import torch

import cudagraphify as cg
from cudagraphify import _cache

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


def check(ok, what, detail=""):
    if not ok:
        FAILS.append(what)
    print(f"{'PASS' if ok else 'FAIL'} {what}" + (f": {detail}" if detail else ""), flush=True)


def info(what):
    print(f"INFO {what}", flush=True)


def sync():
    if not CPU:
        torch.cuda.synchronize()


def counts(g):
    s = cg.stats(g)
    return s.captures, s.replays, sum(s.eager_calls.values())


def delta(g, before):
    return tuple(a - b for a, b in zip(counts(g), before))


class rule_off:
    """The behaviour before the commits, in this process, while the block runs."""

    def __enter__(self):
        self.saved = _cache.THRASH_EVICTIONS
        _cache.THRASH_EVICTIONS = 10 ** 9

    def __exit__(self, *exc):
        _cache.THRASH_EVICTIONS = self.saved


class Stack(torch.nn.Module):
    """Eight small layers: eager pays eight launches and Python, a replay one graph."""

    def __init__(self, width=256, depth=8):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(width, width) for _ in range(depth)])
        self.scale = 1.0

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x * self.scale


def stack(**options):
    torch.manual_seed(0)
    ref = Stack().to(DEV).eval()
    return ref, cg.graphify(copy.deepcopy(ref), **options)


def run(ref, g, sizes, rounds=1, width=256):
    """Calls of g and its eager twin, every output compared bitwise; the number that differ."""
    bad = 0
    for _ in range(rounds):
        for n in sizes:
            x = torch.randn(n, width, device=DEV)
            bad += not torch.equal(g(x), ref(x))
    return bad


def timed(fn):
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t
