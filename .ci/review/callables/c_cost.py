"""Per-call cost of d3132f3's per-call checks (INFO only, plus one sanity [control]): a graphed
call of a small module (Linear 256, batch 8, no_grad) whose forward calls a callable attribute:
a torch function (F.relu, by identity), functools.partial(F.leaky_relu, negative_slope=0.2), a
lambda over a dict holding a nested plain object, a bound method of an object holding a
config dict and a tensor, and ``vars(self)["scale"]``; microseconds per call (median of 5
rounds of 300 calls) and, for reference, the module run eagerly; then the per-call checks that
_guards._watch_value builds for each callable, timed alone (d3132f3^ has none: identity).
Compare with the commit before (d3132f3^): run this script from a checkout of it; the script
itself is the same. Run from the repository root: python3 .ci/review/callables/c_cost.py
"""
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("c_cost.py")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphify as cg  # noqa: E402

W = C.W


class Post(nn.Module):
    def __init__(self, post):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.post = post
        self.scale = 1.0

    def forward(self, x):
        if self.post is None:
            return self.lin(x) * vars(self)["scale"]
        return self.post(self.lin(x))


class Cfg:
    def __init__(self):
        self.t = 1.0
        self.d = {"a": 1.0, "b": [1, 2]}


class Trainer:
    def __init__(self):
        self.cfg = {"lr": 1e-3, "betas": (0.9, 0.99), "name": "adam"}  # (flat: see L2)
        self.state = torch.zeros(W, device=C.DEV)
        self.t = 1.0

    def scale(self, x):
        return x / self.t


def lam():
    cfg = {"t": 1.0, "u": [1.0], "v": Cfg()}
    return lambda x: x / cfg["t"]


def per_call_us(m, x, rounds=5, n=300):
    with torch.no_grad():
        for _ in range(5):
            m(x)
        C.sync_all()
        out = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(n):
                m(x)
            C.sync_all()
            out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)


if __name__ == "__main__":
    x = torch.randn(8, W, device=C.DEV)
    all_graphed = True
    for name, post in [("F.relu (torch, identity)", F.relu),
                       ("partial(F.leaky_relu, kw)", functools.partial(F.leaky_relu,
                                                                       negative_slope=0.2)),
                       ("lambda over dict + object", lam()),
                       ("bound method, object holds cfg + tensor", Trainer().scale),
                       ("vars(self)['scale'] read", None)]:
        torch.manual_seed(0)
        m = Post(post).to(C.DEV)
        eager = per_call_us(m, x)
        g = cg.graphify(m)
        us = per_call_us(g, x)
        s = cg.stats(g)
        all_graphed &= s.eager == 0 and s.captures == 1
        C.info(f"{name}: graphed {us:.1f} us/call, eager {eager:.1f} us/call "
               f"({C.stats_line(g)})")
    # the per-call checks d3132f3 adds for each callable, timed alone (before: none, identity)
    import timeit
    from cudagraphify import _guards as G
    for name, v in [("F.relu", F.relu),
                    ("partial(F.leaky_relu, kw)", functools.partial(F.leaky_relu,
                                                                    negative_slope=0.2)),
                    ("lambda over dict + object", lam()),
                    ("bound method, object holds cfg + tensor", Trainer().scale)]:
        checks, tensors = [], []
        G._watch_value(v, checks, tensors, set(), 0)
        us = timeit.timeit(lambda: all(c() for c in checks), number=20000) / 20000 * 1e6
        C.info(f"{name}: {len(checks)} per-call check(s), {len(tensors)} tensor(s) held, "
               f"{us:.2f} us/call for the checks alone")
    C.check(all_graphed, "[control] every timed module graphed once")
    C.finish("c_cost.py")
