"""GPU checks for 5b4917c + f3353d1 (an object the forward read as an attribute of a module of
the graphed tree and set as it was, ``self.keep = self.value``, is set again after each replay
from that attribute: ``_watch.From``).

Each case states what eager does and prints PASS when the graphed module does the same, FAIL
with the detail otherwise. Outputs are compared with an eager twin (torch.equal) and replay
counters are checked before the attribute is. Expected on f3353d1: fr1_buffer_source and
fr1_class_attribute_source FAIL (FR-1 of tests/test_review_from.py), the controls PASS.
FR-2/FR-3 need share_graph over a cache (see the CPU tests). A few seconds on an H100.
Run: PYTHONPATH=. python3 .ci/review/from/gpu_from.py
(REVIEW_DEV=cpu with the tests' simulated backend installed is a dry run of the script only.)
"""
from __future__ import annotations

import copy
import os
import sys
import traceback
import warnings

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphify as cg  # noqa: E402
from cudagraphify import _watch  # noqa: E402

warnings.simplefilter("ignore")
dev = torch.device(os.environ.get("REVIEW_DEV", "cuda"))
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
RESULTS = []


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()


def case(fn):
    def run():
        try:
            msg = fn()
            ok, why = (True, "") if msg is None else (False, msg)
        except Exception as e:  # noqa: BLE001
            ok, why = False, "raised " + "".join(traceback.format_exception_only(e)).strip()
        sync()
        RESULTS.append(ok)
        print(f"{'PASS' if ok else 'FAIL'} {fn.__name__}" + (f": {why}" if why else ""),
              flush=True)
    run.__name__ = fn.__name__
    return run


class Keeps(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.value = [1]
        self.keep = None

    def forward(self, x):
        self.keep = self.value
        return self.lin(x)


class KeepsBuffer(Keeps):
    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.ones(64))

    def forward(self, x):
        self.keep = self.buf
        return self.lin(x) + self.buf


class KeepsClassAttr(Keeps):
    DEFAULTS = [1, 2]

    def forward(self, x):
        self.keep = self.DEFAULTS
        return self.lin(x)


class KeepsChild(Keeps):
    def __init__(self):
        super().__init__()
        self.child = nn.Module()
        self.child.value = [3]

    def forward(self, x):
        self.keep = self.child.value
        return self.lin(x)


def twins(cls):
    torch.manual_seed(0)
    m = cls().to(dev).eval()
    return m, cg.graphify(copy.deepcopy(m))


def reset_then_compare(cls, source, rebind=None):
    m, g = twins(cls)
    x = torch.randn(8, 64, device=dev)
    with torch.no_grad():
        for _ in range(3):
            if not torch.equal(g(x), m(x)):
                return "outputs differ while warming"
        r = cg.stats(g).replays
        for i in range(3):
            if rebind is not None and i == 1:
                rebind(m), rebind(g)
            g.keep = m.keep = None
            if not torch.equal(g(x), m(x)):
                return "outputs differ"
            want, got = source(m), source(g)
            if m.keep is not want:
                return "eager twin did not keep its source (script error)"
            if g.keep is not got:
                return f"call {i}: graphed keep {g.keep!r}, eager keeps its {cls.__name__} source"
    if cg.stats(g).replays < r + 2:
        return f"not exercised: replays {cg.stats(g).replays - r}"
    return None


@case
def fr1_buffer_source():
    return reset_then_compare(KeepsBuffer, lambda mod: mod.buf)


@case
def fr1_class_attribute_source():
    return reset_then_compare(KeepsClassAttr, lambda mod: mod.DEFAULTS)


@case
def control_own_attribute_source():
    return reset_then_compare(Keeps, lambda mod: mod.value)


@case
def control_own_attribute_rebound():
    return reset_then_compare(Keeps, lambda mod: mod.value,
                              rebind=lambda mod: setattr(mod, "value", [9]))


@case
def control_submodule_attribute_source():
    return reset_then_compare(KeepsChild, lambda mod: mod.child.value)


@case
def control_no_epoch_move_when_nothing_changes():
    m, g = twins(Keeps)
    x = torch.randn(8, 64, device=dev)
    with torch.no_grad():
        for _ in range(4):
            g(x)
        before, r = _watch.epoch, cg.stats(g).replays
        for _ in range(5):
            if not torch.equal(g(x), m(x)):
                return "outputs differ"
    if cg.stats(g).replays != r + 5:
        return f"not exercised: replays {cg.stats(g).replays - r}"
    return None if _watch.epoch == before else "the epoch moved on replays that set nothing"


if __name__ == "__main__":
    for run in (fr1_buffer_source, fr1_class_attribute_source, control_own_attribute_source,
                control_own_attribute_rebound, control_submodule_attribute_source,
                control_no_epoch_move_when_nothing_changes):
        run()
    print(f"{sum(RESULTS)}/{len(RESULTS)} PASS")
