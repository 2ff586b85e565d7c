"""Calls on another CUDA stream than the one a graph was captured on, against an eager twin.

Eager PyTorch orders work on the caller's current stream: a result made on stream s, used on s,
needs no synchronisation. A graphed call made under ``torch.cuda.stream(s)`` must give the
same: its copy-in must see inputs queued on s, and its output must be ready for work queued on
s after it (no host sync between). Checks (Linear -> GELU -> Linear, 2048 wide, a long matmul
chain queued before each call so that a missing wait shows):
  [control] graphed on the default stream, then called on a side stream, outputs used there;
  [control] the same inside a graph_region (aliases, chained into a second module);
  [control] copy_outputs=False, called on alternating streams, each result used on its stream;
  [control] outputs kept across calls on two streams, compared at the end.
Run from the repository root: python3 .ci/review/hunt2/a_streams.py
"""
import contextlib
import copy
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("a_streams.py")
import torch  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphify as cg  # noqa: E402

W = 2048


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(W, W), nn.GELU(), nn.Linear(W, W)).to(C.DEV).eval()


def busy(x):
    """A slow chain of work queued on the current stream, ending in x's new values."""
    y = x
    for _ in range(20):
        y = torch.tanh(y @ BIG) * 0.5
    return x.copy_(y)


def streams():
    if C.CPU:
        return [None, None]
    return [torch.cuda.Stream(), torch.cuda.Stream()]


def ctx(s):
    return contextlib.nullcontext() if s is None else torch.cuda.stream(s)


def case(name, copy_outputs=True, region=False, keep=False):
    g = model()
    ref = copy.deepcopy(g)
    g2 = model()
    ref2 = copy.deepcopy(g2)
    cg.graphify(g, copy_outputs=copy_outputs)
    cg.graphify(g2, copy_outputs=copy_outputs)
    torch.manual_seed(1)
    xs = [torch.randn(8, W, device=C.DEV) for _ in range(8)]
    ok, kept, rkept = True, [], []
    with torch.no_grad():
        for x in xs[:2]:  # warm-up and capture on the default stream
            g2(g(x.clone()))
        C.sync_all()
        ss = streams()
        for i, x in enumerate(xs):
            s = ss[i % 2]
            with ctx(s):
                if s is not None:
                    s.wait_stream(torch.cuda.default_stream())
                a = x.clone()
                busy(a)  # a's values are only ready on s
                b = a.clone()
                with cg.graph_region() if region else contextlib.nullcontext():
                    y = g2(g(a)) if region else g(a)
                    out = (y * 1).clone()  # used on s, no sync
                ry = ref2(ref(b)) if region else ref(b)
                rout = (ry * 1).clone()
                if keep:
                    kept.append(out)
                    rkept.append(rout)
            C.sync_all()
            if not torch.equal(out, rout):
                ok = False
                C.check(False, f"{name} call {i}", f"max diff {(out - rout).abs().max().item():.3g}")
                break
        C.sync_all()
        if keep:
            ok = ok and all(torch.equal(k, r) for k, r in zip(kept, rkept))
    C.check(ok, f"[control] {name}", C.stats_line(g))
    C.info(f"{name}: {C.stats_line(g)}")


BIG = None
if __name__ == "__main__":
    torch.manual_seed(2)
    BIG = torch.randn(W, W, device=C.DEV) / W ** 0.5
    case("side stream, copies")
    case("side stream, graph_region chain", region=True)
    case("alternating streams, copy_outputs=False", copy_outputs=False)
    case("alternating streams, outputs kept", keep=True)
    C.finish("a_streams.py")
