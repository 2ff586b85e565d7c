"""Shared bits of the sets review's GPU scripts (of c1a47e0, sets-again: a module attribute the
forward sets to a constant is set again by every replay). CPU reproductions in
tests/test_review_sets.py. One line per check: ``PASS ...`` / ``FAIL ...``; ``[finding]`` lines
FAIL where the finding holds, ``[control]`` lines should PASS. SKIP (exit 0) without CUDA.
DEV=cpu: a smoke test on the CPU doubles of tests/ (share_graph's graph-reading double)."""
import copy
import os
import sys
import warnings

import torch
from torch import nn

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
sys.path.insert(0, ROOT)
DEV = os.environ.get("DEV", "cuda")
D = 64
FAILS = []
_KEEP = []
warnings.simplefilter("ignore")


def setup(name):
    if DEV == "cpu":
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from _pytest.monkeypatch import MonkeyPatch
        import test_share_engine as tse
        f = tse.reading
        f = getattr(f, "_get_wrapped_function", None) and f._get_wrapped_function() \
            or f.__pytest_wrapped__.obj
        gen = f(MonkeyPatch())
        next(gen)
        _KEEP.append(gen)  # (closed when collected: the double would go)
        return
    if not torch.cuda.is_available():
        print(f"SKIP {name}: no CUDA")
        sys.exit(0)


def check(ok, what, why=""):
    print(("PASS " if ok else "FAIL ") + what + ("" if ok or not why else f": {why}"))
    if not ok:
        FAILS.append(what)


class Elem(nn.Module):
    """Elementwise (bitwise equal to eager on a GPU): ``x * w + b``."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))
        self.b = nn.Parameter(torch.randn(D))

    def body(self, x):
        return x * self.w + self.b


def layers_of(cls, n=4):
    import cudagraphify as cg
    torch.manual_seed(0)
    layers = nn.ModuleList(cls() for _ in range(n)).to(DEV).eval()
    ref = copy.deepcopy(layers)
    if DEV == "cpu":
        import test_share_engine as tse
        tse._register(layers)
    return layers, ref, cg.share_graph(layers)


def same_layers(layers, ref, x, attr=None):
    """(ok, why) of one call of every layer and its twin."""
    with torch.no_grad():
        for k, (m, r) in enumerate(zip(layers, ref)):
            a, b = m(x), r(x)
            if not torch.equal(a, b):
                return False, f"layer {k}: output differs by {(a - b).abs().max().item():.3g}"
            if attr is not None and getattr(m, attr, None) != getattr(r, attr, None):
                return False, f"layer {k}: {attr} {getattr(m, attr, None)!r} vs eager's " \
                              f"{getattr(r, attr, None)!r}"
    return True, ""


def x_of(n=4):
    return torch.randn(n, D, device=DEV)
