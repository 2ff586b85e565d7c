"""Resize review, finding F3 (speed): the RESIZES verdict is kept under the warm-up's guard,
which holds the very tensor forward resizes (its address and shape checked on every call):
the verdict never holds, and the root runs its first call again (an eager run under the
probe, plus the screen) every second call. Before the change the same module's verdict
("forward changes ... a tensor attribute") held: no warm-up after the first call.

Checks (expected on the reviewed code: FAIL): no warm-up seconds accrue over 50 calls after the
first five (stats().warmup_seconds), for a module growing a plain-attribute log and for a
function growing a closure tensor. Also prints µs per call against an eager twin.
Run on one GPU: ``python reprobe_speed.py``.
"""
import copy
import sys
import time
import warnings

import torch
from torch import nn

if not torch.cuda.is_available():
    print("SKIP reprobe_speed: needs a CUDA GPU")
    sys.exit(0)

import cudagraphify as cg

DEV = torch.device("cuda")
warnings.simplefilter("ignore")


class GrowsPlain(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(*[nn.Linear(256, 256, device=DEV) for _ in range(8)])
        self.log = torch.zeros(0, device=DEV)

    def forward(self, x):
        h = self.mlp(x)
        n = self.log.numel()
        self.log.resize_(n + 256)
        self.log[n:].copy_(h[0])
        return h


def timed(fn, calls=50):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t0) / calls


def check(name, g, ref, make_x):
    with torch.no_grad():
        for _ in range(5):
            g(make_x())
        w0 = cg.stats(g).warmup_seconds
        x = make_x()
        t_g = timed(lambda: g(x))
        t_e = timed(lambda: ref(x))
        grew = cg.stats(g).warmup_seconds - w0
    ok = grew == 0.0
    print(f"{'PASS' if ok else 'FAIL'} {name}: warm-up seconds over 50 calls after the first "
          f"five: {grew:.4f} | graphify {t_g:.0f} us/call, eager {t_e:.0f} us/call")


torch.manual_seed(0)
m = GrowsPlain()
check("module growing a plain-attribute log", cg.graphify(copy.deepcopy(m)), m,
      lambda: torch.randn(4, 256, device=DEV))

log = torch.zeros(0, device=DEV)
log_twin = torch.zeros(0, device=DEV)


def make(t):
    def fn(x):
        n = t.numel()
        t.resize_(n + x.numel())
        t[n:].copy_(x)
        return (x * 2).sin()
    return fn


check("function growing a closure tensor", cg.graphify(make(log)), make(log_twin),
      lambda: torch.randn(256, device=DEV))
