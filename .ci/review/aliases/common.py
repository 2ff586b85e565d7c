"""Shared bits of the review18 GPU scripts (3abfc0c .data aliases, a432bc4 retired pieces).

REVIEW18_CPU_SIM=1 runs them on the CPU with tests/conftest.py's simulated backend (a check of
the scripts themselves, not of a GPU)."""
import copy
import os
import sys
import warnings

import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _capture

warnings.simplefilter("ignore")
SIM = os.environ.get("REVIEW18_CPU_SIM") == "1"
if SIM:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))
    from conftest import SimBackend  # noqa: E402
    _capture.set_backend(SimBackend())
    DEV = "cpu"
else:
    DEV = "cuda"
# no piece trial (it would decide on the machine's speed): pieces stay live unless forced
_capture.CudaBackend.clock = None
RESULTS = []


def check(ok, what, detail=""):
    RESULTS.append(bool(ok))
    print(f"{'PASS' if ok else 'FAIL'} {what}" + (f" [{detail}]" if detail else ""), flush=True)


def guarded(what, fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        check(False, what, f"raised {type(e).__name__}: {str(e)[:200]}")


def counters(m):
    s = cg.stats(m)
    return (f"captures={s.captures} replays={s.replays} graphs={s.graphs} "
            f"moved={s.moved_outputs} segments={s.segments} seg_replays={s.segment_replays} "
            f"eager={dict(s.eager_calls)}")


def randn(*shape):
    return torch.randn(*shape, device=DEV)


def backward_outcome(loss):
    try:
        loss.backward()
        return "ran"
    except RuntimeError as e:
        return "raised" if "modified by an inplace operation" in str(e) else repr(e)[:80]


class Root(nn.Module):
    """A host sync between two Linear pieces: runs piecewise, a and b graphed."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        y = self.a(x)
        if bool((y > -1e9).all()):
            y = y + 1
        return self.b(y)


class Outer(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.shared = shared

    def forward(self, x):
        return self.shared(x) * 3


def root_pair():
    torch.manual_seed(0)
    ref = Root().to(DEV)
    g = cg.graphify(copy.deepcopy(ref))
    ok = True
    with torch.no_grad():
        for _ in range(6):
            x = randn(8, 64)
            ok &= torch.equal(g(x), ref(x))
    return ref, g, bool(ok)


def give_back(piece, why="piece given back: forced by review18"):
    st = piece._cudagraphify_state
    with st.lock:
        st.give_back(why)
