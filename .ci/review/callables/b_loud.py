"""Loud regressions of d3132f3 (L1-L5 of tests/test_review_callables.py): models graphed before
the change that now run eagerly on every call, or recapture on every call. A [finding] line
FAILs where the model is not graphed once (captures=1, eager=0) or differs from eager.
  [finding] L1 a weakref.WeakMethod attribute (``self.cb()(t)``): eager every call;
  [finding] L2 functools.partial(f, cfg=<dict nested 4 deep>); a bound method of an object
            holding a nested config; a partial / bound method reaching 300 plain objects:
            Unguardable, eager every call;
  [finding] L3 a bound method whose object holds a tensor it does not read, replaced every
            step: a capture on every call;
  [finding] L4 ``vars(self)["scale"]`` with another attribute (``m.step = i``) set every call:
            a capture on every call;
  [finding] L5 a numpy array in a callable attribute's closure: eager every call;
  [control] the nested dict kept as ``self.cfg`` (graphed once); ``self.scale`` with
            ``m.step = i`` every call (graphed once); weakref.ref to a plain object.
Run from the repository root: python3 .ci/review/callables/b_loud.py
"""
import functools
import os
import sys
import weakref

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("b_loud.py")
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphify as cg  # noqa: E402

W = C.W


class Post(nn.Module):
    def __init__(self, post):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.post = post

    def forward(self, x):
        return self.post(self.lin(x))


class Sched:
    def __init__(self):
        self.temperature = 1.0

    def scale(self, t):
        return t / self.temperature


class WeakMethodPost(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.sched = Sched()
        self.cb = weakref.WeakMethod(self.sched.scale)

    def forward(self, x):
        return self.cb()(self.lin(x))


class WeakRefPost(WeakMethodPost):
    def __init__(self):
        super().__init__()
        self.ref = weakref.ref(self.sched)

    def forward(self, x):
        return self.ref().scale(self.lin(x))


def read_d(t, cfg):
    return t / cfg["a"]["b"]["c"]["d"]


def nested():
    return {"a": {"b": {"c": {"d": 1.0}}}}


class Label:
    def __init__(self, i):
        self.name = f"label{i}"


class DeepOwner(Sched):
    def __init__(self):
        super().__init__()
        self.cfg = {"model": {"head": {"opts": {"x": [1]}}}}


class WideOwner(Sched):
    def __init__(self):
        super().__init__()
        self.samples = [Label(i) for i in range(300)]


class Trainer(Sched):
    def __init__(self):
        super().__init__()
        self.opt_state = {"exp_avg": torch.zeros(W, device=C.DEV)}


def ignore_labels(t, labels):
    return t * 2


class Direct(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.cfg = nested()

    def forward(self, x):
        return read_d(self.lin(x), self.cfg)


class DictRead(nn.Module):
    def __init__(self, plain):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.scale, self.step, self.plain = 1.0, 0, plain

    def forward(self, x):
        return self.lin(x) * (self.scale if self.plain else vars(self)["scale"])


def np_closure():
    mean = np.ones(4, dtype=np.float32)
    return lambda t: t * 2.0 + 0 * len(mean)


def new_state(m, i):
    m.post.__self__.opt_state["exp_avg"] = torch.full((W,), float(i), device=C.DEV)


def step(m, i):
    m.step = i


def case(label, name, make, change=None, every=False, n=6, captures=1):
    ok, why, g = C.twin_run(make, change, n=n, every=every)
    s = cg.stats(g)
    if ok and not (s.eager == 0 and s.captures == captures):
        ok, why = False, f"not graphed once over {n} calls"
    C.check(ok, f"[{label}] {name}", why + " " + C.stats_line(g))
    C.info(f"{name}: {C.stats_line(g)}")


if __name__ == "__main__":
    case("finding", "L1 weakref.WeakMethod attribute", WeakMethodPost)
    case("finding", "L2 partial(f, cfg=<dict nested 4 deep>)",
         lambda: Post(functools.partial(read_d, cfg=nested())))
    case("finding", "L2 bound method of an object holding a nested config",
         lambda: Post(DeepOwner().scale))
    case("documented", "L2 (README; expected FAIL) partial reaching 300 plain objects",
         lambda: Post(functools.partial(ignore_labels, labels=[Label(i) for i in range(300)])))
    case("finding", "L2 bound method of an object holding 300 plain objects",
         lambda: Post(WideOwner().scale))
    case("finding", "L3 bound method's object: unread tensor replaced every step",
         lambda: Post(Trainer().scale), new_state, every=True, n=10)
    case("documented", "L4 (README; expected FAIL) vars(self)['scale'], m.step set every call",
         lambda: DictRead(False), step, every=True, n=10)
    case("finding", "L5 numpy array in a callable attribute's closure", lambda: Post(np_closure()))
    case("control", "nested dict kept as self.cfg", Direct)
    case("control", "self.scale, m.step set every call", lambda: DictRead(True), step,
         every=True, n=10)
    case("control", "weakref.ref to a plain object", WeakRefPost)
    C.finish("b_loud.py")
