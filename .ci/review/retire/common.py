"""Shared bits of helper-39's GPU scripts (commit 9b19651: given-back pieces are retired; its
findings R1-R6 are fixed in a432bc4, where b, c and d should print PASS only). Run them with
``SCRIPTS=.ci/review/retire/run_all.sh bash .ci/gpu`` on the GPU machine."""
import copy
import threading
import warnings

import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _trial, _wrap

warnings.simplefilter("ignore")
DEV = "cuda"
FORCED = "piece given back: forced by the review script"
RESULTS = []


def check(ok, what, detail=""):
    line = f"{'PASS' if ok else 'FAIL'} {what}" + (f" [{detail}]" if detail else "")
    RESULTS.append(ok)
    print(line, flush=True)


def guarded(what, fn):
    """Run one check function; an exception is a FAIL line, not a crash of the script."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        check(False, what, f"raised {type(e).__name__}: {e}")


def force_verdict(give_back: bool):
    """Each piece's own trial decides as told (the real clock still times it); the root's plan
    trial is off (it would decide on the machine's speed)."""
    _trial.PLAN_TRIAL = False
    _trial.Trial.verdict = (lambda self: FORCED) if give_back else (lambda self: None)


class Root(nn.Module):
    """A host sync between two Linear pieces: runs piecewise, a and b graphed."""

    def __init__(self, a=None):
        super().__init__()
        self.a = a if a is not None else nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x):
        y = self.a(x)
        if bool((y > -1e9).all()):  # host sync
            y = y + 1
        return self.b(y)


class Outer(nn.Module):
    """Graphed whole; runs a module that is another root's piece."""

    def __init__(self, shared):
        super().__init__()
        self.shared = shared

    def forward(self, x):
        return self.shared(x) * 3


def pair(cls=Root, *args):
    torch.manual_seed(0)
    ref = cls(*args).to(DEV)
    return ref, cg.graphify(copy.deepcopy(ref))


def same(g, ref, calls=1, rows=8):
    ok = True
    with torch.no_grad():
        for _ in range(calls):
            x = torch.randn(rows, 64, device=DEV)
            ok &= torch.equal(g(x), ref(x))
    return bool(ok)


def counters(m):
    s = cg.stats(m)
    return (f"captures={s.captures} replays={s.replays} graphs={s.graphs} "
            f"timed={s.timed_calls} eager={dict(s.eager_calls)}")


def plain(m):
    """No wrapper of ours: the class's forward, and at most a partial of ``_call_impl`` as the
    call override (what retirement leaves since the R2 fix)."""
    call = m.__dict__.get("_compiled_call_impl")
    return "forward" not in m.__dict__ and (
        call is None or getattr(call, "func", None) is nn.Module._call_impl)


_PAUSE = []


def pause_here():
    """Run the armed callable on another thread, here (a GIL switch can land here)."""
    if _PAUSE:
        t = threading.Thread(target=_PAUSE.pop())
        t.start()
        t.join(30)
