"""Shared bits of the launch review's GPU scripts (of 9da4dcf: a segment's graph replays at
``_Segment.launch``, its last call that copies an input, and ``_Run.entered`` keeps the segment
being met after that). CPU reproductions in tests/test_review_launch.py. One line per check:
``PASS ...`` / ``FAIL ...``; ``[finding]`` lines FAIL where the finding holds, ``[control]``
lines should PASS. SKIP (exit 0) without CUDA. DEV=cpu: a smoke test on the CPU double of tests/
(conftest.SimBackend, whose replay computes at once).

Segments are experimental (``_segrun.ENABLED``): turned on here. The timed trial of a plan
(segments against the forward without them, by time) is turned off as tests/conftest.py does,
so that a plan is kept whatever the machine's speed (``CudaBackend.clock = None``)."""
import copy
import os
import sys
import warnings

import torch
from torch import nn

# (normalised: cudagraphify tells its own frames by their file names, which hold no "..")
ROOT = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
sys.path.insert(0, ROOT)
DEV = os.environ.get("DEV", "cuda")
D = 64
FAILS = []
warnings.simplefilter("ignore")


def setup(name):
    from cudagraphify import _capture, _segrun
    if DEV == "cpu":
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from conftest import SimBackend
        _capture.set_backend(SimBackend())
    elif not torch.cuda.is_available():
        print(f"SKIP {name}: no CUDA")
        sys.exit(0)
    else:
        _capture.CudaBackend.clock = None  # (no timed trial: see the module docs)
    _segrun.ENABLED = True
    import cudagraphify
    print(f"# {name}: cudagraphify from {os.path.dirname(cudagraphify.__file__)}, DEV={DEV}")


def check(ok, what, why=""):
    print(("PASS " if ok else "FAIL ") + what + ("" if ok or not why else f": {why}"))
    if not ok:
        FAILS.append(what)


def graphed(m):
    import cudagraphify as cg
    return cg.graphify(copy.deepcopy(m))


def plan_of(g):
    plans = g._cudagraphify_state.segments.plans()
    return plans[0] if len(plans) == 1 else None


def describe(g):
    p = plan_of(g)
    if p is None:
        return "no plan"
    segs = ", ".join(f"{s.first}-{s.last} launch {getattr(s, 'launch', '-')}"
                     + ("" if s.graph is not None else " (eager)") for s in p.segments)
    return (f"segments [{segs}], replays {p.replays}, divergences {p.divergences}, "
            f"answered whole {p.whole}")


def compare(m, g, calls):
    """(ok, why): each of ``calls`` (argument tuples) made on ``g`` then ``m``, every output
    compared bitwise (torch.equal)."""
    bad = []
    with torch.no_grad():
        for n, args in enumerate(calls):
            got, want = g(*args), m(*args)
            if not torch.equal(got, want):
                bad.append(f"call {n}: max |graphed - eager| "
                           f"{(got - want).abs().max().item():.3g}")
    return not bad, "; ".join(bad[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "")


def xy(n=6, rows=4):
    return [(torch.randn(rows, D, device=DEV), torch.randn(rows, D, device=DEV))
            for _ in range(n)]


class Attr(nn.Module):
    """F1: modules answered whole before the launch point (``+ y``), and a plain tensor
    attribute (not a buffer) that the forward reads: the members' guard checks its address
    (``t.data_ptr()``, cudagraphify's own torch call, met by the replay mode)."""

    def __init__(self, t):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)
        self.t = t

    def forward(self, x, y):
        assert self.t is not None  # (only read)
        h = self.fc(self.ln(x))  # members answered whole
        h = h + y  # y copied: the launch point
        h = self.fc(h).relu()
        return h * h.abs().amax().item()
