"""Shared bits of the waits review's GPU scripts (of 3741ed7: ``_segmodes.waits`` places the
device waits and host syncs the record's profile shows between calls; ``SegmentPlan._launch``
moves a segment's replay after them). CPU reproductions in tests/test_review_waits.py. One line
per check: ``PASS ...`` / ``FAIL ...``; ``[finding]`` lines FAIL where the finding holds,
``[control]`` lines should PASS. SKIP (exit 0) without CUDA (the findings need the CUDA
profiler).

Segments are experimental (``_segrun.ENABLED``): turned on here. The timed trial of a plan is
turned off as tests/conftest.py does (``CudaBackend.clock = None``)."""
import copy
import os
import sys
import warnings

import torch

ROOT = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
sys.path.insert(0, ROOT)
D = 256
warnings.simplefilter("ignore")


def setup(name):
    from cudagraphify import _capture, _segrun
    if not torch.cuda.is_available():
        print(f"SKIP {name}: no CUDA")
        sys.exit(0)
    _capture.CudaBackend.clock = None
    _segrun.ENABLED = True
    import cudagraphify
    print(f"# {name}: cudagraphify from {os.path.dirname(cudagraphify.__file__)}, "
          f"torch {torch.__version__}, {torch.cuda.get_device_name()}")


def check(ok, what, why=""):
    print(("PASS " if ok else "FAIL ") + what + ("" if ok or not why else f": {why}"))


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
    segs = ", ".join(f"{s.first}-{s.last} launch {s.launch}"
                     + ("" if s.graph is not None else " (eager)") for s in p.segments)
    return (f"waits {sorted(p.waits) if p.waits is not None else None}, segments [{segs}], "
            f"replays {p.replays}, divergences {p.divergences}, answered whole {p.whole}")


def prefetch_run(cls, calls=6):
    """``cls``'s ``w`` written on a side stream before each call, late (a sleep first); the
    forward waits for it (``self.ready``). (ok, why, graphed module): graphed vs eager, bitwise."""
    torch.manual_seed(0)
    m = cls().cuda().eval()
    g = graphed(m)
    side = torch.cuda.Stream()
    ws = [torch.randn(D, device="cuda") for _ in range(calls)]
    xs = [torch.randn(4, D, device="cuda") for _ in range(calls)]
    outs = {}
    for model, key in ((g, "graphed"), (m, "eager")):
        target = model.inner if hasattr(model, "inner") else model
        target.ready = torch.cuda.Event()
        got = []
        with torch.no_grad():
            for k in range(calls):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    torch.cuda._sleep(100_000_000)  # (~60 ms: the write lands late)
                    target.w.copy_(ws[k])
                    target.ready.record(side)
                got.append(model(xs[k]))
        outs[key] = got
    torch.cuda.synchronize()
    bad = [k for k, (a, b) in enumerate(zip(outs["graphed"], outs["eager"]))
           if not torch.equal(a, b)]
    return not bad, f"calls {bad} differ from eager", g
