"""The bench's region row (Linear(64, 64), (4, 64), in a graph_region) against
copy_outputs=False: which path each call takes, and µs of each path's parts, on this machine.

Run 4 (H100, e63fdf7): region - copy_outputs=False was 1.5 µs there against 0.4-0.55 on
the CPU double, whose Fast path does the same work. Prints, after warm-up, per 1000 calls:
slow-path calls, Fast.make calls, protect_before calls; the slot's baseline and use count
with no alias held; whether Fast takes the slot branch; then interleaved µs per call."""
import contextvars
import copy
import sys
import time
import warnings

import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _engine, _fast, _region

DEV = "cuda" if torch.cuda.is_available() and "--cpu" not in sys.argv else "cpu"
if DEV == "cpu":  # the CPU double (tests/conftest.py's SimBackend)
    sys.path.insert(0, "tests")
    from conftest import SimBackend
    from cudagraphify import _capture
    _capture.set_backend(SimBackend())
warnings.simplefilter("ignore")
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
count = {"slow": 0, "make": 0, "protect_before": 0}


def counted(cls, name, key, static=False):
    orig = getattr(cls, name)

    def wrapper(*a, **k):
        count[key] += 1
        return orig(*a, **k)
    setattr(cls, name, staticmethod(wrapper) if static else wrapper)


counted(_engine.GraphedState, "slow", "slow")
counted(_fast.Fast, "make", "make", static=True)
counted(_region.GraphRegion, "protect_before", "protect_before")


def per_call(fn, x, n=1000):
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn(x)
    sync()
    return (time.perf_counter() - t) / n * 1e6


def paths(g, x, label):
    for k in count:
        count[k] = 0
    for _ in range(1000):
        g(x)
    st = g._cudagraphify_state
    fast = st._fast
    line = f"{label}: per 1000 calls {dict(count)}; fast={type(fast).__name__}"
    if isinstance(fast, _fast.Fast):
        line += f" slot_branch={fast.slot}"
        act = fast.entry._actions[0] if fast.entry._actions else None
        slot = getattr(act, "__self__", None)
        if isinstance(slot, _region.Slot):
            line += f" baseline={slot.baseline} users(no alias held)={slot.users()}"
    print(line, flush=True)


torch.manual_seed(0)
lin = nn.Linear(64, 64).to(DEV)
x = torch.randn(4, 64, device=DEV)
outside = contextvars.copy_context()  # (no region entered: copy_outputs=False's rounds run here)
with torch.no_grad():
    nc = cg.graphify(copy.deepcopy(lin), copy_outputs=False)
    for _ in range(3):
        nc(x)
    paths(nc, x, "copy_outputs=False")
    static_x, static_y, hand = x.clone(), None, None
    if DEV == "cuda":  # hand copy-in + replay (the bench's reference row)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            lin(static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = lin(static_x)

        def hand(inp):
            static_x.copy_(inp)
            graph.replay()
            return static_y
    r = cg.graphify(copy.deepcopy(lin))
    with cg.graph_region():
        for _ in range(3):
            r(x)
        paths(r, x, "region")
        rows = {"region": lambda: per_call(r, x),
                "copy_outputs=False": lambda: outside.run(per_call, nc, x)}
        if hand is not None:
            rows["hand copy-in + replay"] = lambda: per_call(hand, x)
        best = {k: 1e9 for k in rows}
        for _ in range(31):  # interleaved rounds, each row's best
            for k, fn in rows.items():
                best[k] = min(best[k], fn())
    print("best µs per call:", {k: round(v, 2) for k, v in best.items()})
    if hand is not None:
        h = best["hand copy-in + replay"]
        print(f"over hand copy-in + replay: region +{best['region'] - h:.2f}, "
              f"copy_outputs=False +{best['copy_outputs=False'] - h:.2f}")

# the region path's own steps, each alone (µs per step, best of 7 loops of 20000)
import threading  # noqa: E402
import timeit  # noqa: E402
import weakref  # noqa: E402

from cudagraphify import _region as _r  # noqa: E402

t = torch.randn(4, 64, device=DEV)
lock, live, stack_get = threading.Lock(), {}, _r.stack_var().get
use_count, cdata = torch._C._storage_Use_Count, t.untyped_storage()._cdata
steps = {"t.data": "t.data", "t.detach()": "t.detach()", "weakref.ref(t)": "weakref.ref(t)",
         "threading.get_ident()": "threading.get_ident()",
         "lock acquire+release": "lock.acquire(); lock.release()",
         "use_count(cdata)": "use_count(cdata)", "dict set": "live[1] = None",
         "stack_get()": "stack_get()", "x.copy_(t)": "x.copy_(t)",
         "x.data_ptr()": "x.data_ptr()"}
ns = dict(globals())
print("steps, µs each:", {k: round(min(timeit.repeat(v, globals=ns, number=20000, repeat=7))
                                   / 20000 * 1e6, 3) for k, v in steps.items()})
