"""Segments' module members on workload A with a sync per block (issue 16): after warm-up calls
(the trial kept, as seg_floor does), how many module calls were answered whole, the plan's
members, divergences, whether the plan's guard holds, and a profile of the replays: why a
member is not answered whole where the timings say so. ``--cpu``: the CPU double."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
import warnings

import torch

sys.path.insert(0, ".")
p = argparse.ArgumentParser()
p.add_argument("--cpu", action="store_true")
p.add_argument("--sync", default="item")
p.add_argument("--calls", type=int, default=30)
opts = p.parse_args()
warnings.simplefilter("ignore")
if opts.cpu:
    sys.path.insert(0, "tests")
    from conftest import SimBackend
    from cudagraphify import _capture
    _capture.set_backend(SimBackend())
DEV = "cpu" if opts.cpu else "cuda"

import cudagraphify as cg  # noqa: E402
from cudagraphify import _segmodes, _trial  # noqa: E402
from cudagraphify.bench.models import GPT, GPTConfig  # noqa: E402

cfg = GPTConfig(dim=768, heads=12, layers=12, batch=1, seq=16, dtype=torch.bfloat16)
torch.manual_seed(0)
model = GPT.from_config(cfg, DEV, sync=opts.sync)
x = torch.randn(cfg.batch, cfg.seq, cfg.dim, device=DEV, dtype=cfg.dtype)
g = GPT.from_config(cfg, DEV, sync=opts.sync)
g.load_state_dict(model.state_dict())
cg.graphify(g, segments=True)
_trial.MARGIN = float("inf")
misses: dict[str, int] = {}
real = _segmodes._Run.whole


def whole(self, member, args, kwargs):
    out = real(self, member, args, kwargs)
    if out is _segmodes._NO:
        seg = member.segment
        why = ("state" if not seg.state.check() else "stream/pending" if
               (self.pending is not seg and member.start != seg.first) else
               "guard" if not self.plan.guard.valid() else "match or copy")
        misses[why] = misses.get(why, 0) + 1
    return out


_segmodes._Run.whole = whole
with torch.no_grad():
    ref = model(x)
    for _ in range(opts.calls):
        g(x)
    (plan,) = g._cudagraphify_state.segments.plans()
    print(f"device {DEV}, sync {opts.sync}: bitwise {torch.equal(g(x), ref)}; members "
          f"{sum(len(v) for v in plan.members.values())}, whole {plan.whole}, replays "
          f"{plan.replays}, divergences {plan.divergences}, misses {misses}, guard "
          f"{'none' if plan.guard is None else plan.guard.valid()}, trial {plan.trial}, "
          f"given back {plan.given_back}")
    for line in plan.describe()[:3] + [ln for ln in plan.describe() if "whole" in ln]:
        print("  " + line[:300])
    _segmodes._Run.whole = real
    before = plan.whole
    for name, fn in (("eager", model), ("segments", g)):
        best = []
        for _ in range(5):
            if DEV == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                fn(x)
            if DEV == "cuda":
                torch.cuda.synchronize()
            best.append((time.perf_counter() - t) / 20 * 1e6)
        print(f"  {name:<10} {min(best):8.0f} µs a forward")
    print(f"  whole answers in those 100 calls: {plan.whole - before}")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        g(x)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)
