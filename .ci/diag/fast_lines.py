"""Where ``Fast.call``'s µs go on the machine it runs on: the bench's overhead workload
(Linear(64, 64), (4, 64), no_grad), its fast path cut short after each of its lines in turn
(``return`` inserted there), µs per call of what is left; for ``copy_outputs=False`` and for a
call in a ``graph_region``. Also the whole call (``module(x)``) and hand copy-in + replay.
``--cpu``: the CPU double (tests/conftest.py's SimBackend, its replay made a no-op)."""
import copy
import inspect
import sys
import textwrap
import time
import warnings

import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _fast
from cudagraphify.bench._common import hand_capture

DEV = "cuda" if torch.cuda.is_available() and "--cpu" not in sys.argv else "cpu"
if DEV == "cpu":
    sys.path.insert(0, "tests")
    from conftest import SimGraph, SimBackend
    from cudagraphify import _capture
    SimGraph.replay = lambda self: None
    _capture.set_backend(SimBackend())
warnings.simplefilter("ignore")
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)


def per(fn, x, n=20000, rounds=5):
    best = 1e9
    for _ in range(rounds):
        sync()
        t = time.perf_counter()
        for _ in range(n):
            fn(x)
        sync()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


SRC = textwrap.dedent(inspect.getsource(_fast.Fast.call))
LINES = SRC.splitlines()
ORIG = _fast.Fast.call
ROUNDS = 5  # each cut's best of ROUNDS interleaved rounds


def cut_at(i):
    """Fast.call with ``return 1`` put before line ``i`` (None: not valid Python there)."""
    line = LINES[i]
    indent = len(line) - len(line.lstrip())
    ns = dict(vars(_fast))
    try:
        exec("\n".join(LINES[:i] + [" " * indent + "return 1"] + LINES[i:]), ns)
    except SyntaxError:
        return None
    return ns["call"]


def profile(label, g, x):
    for _ in range(3):
        g(x)
    fast = g._cudagraphify_state._fast
    assert isinstance(fast, _fast.Fast), type(fast)
    call = lambda inp: fast.call(None, (inp,), {})  # noqa: E731
    whole = per(call, x)
    print(f"== {label}: module(x) {per(g, x):.2f} µs; Fast.call alone {whole:.2f} µs "
          "(each line: µs with the call cut before it, and the step from the last line reached; "
          "lines not reached left out)", flush=True)
    last = max(i for i, line in enumerate(LINES) if "outer.release()" in line)
    cuts = []
    for i in range(4, len(LINES)):
        stripped = LINES[i].strip()
        if not stripped or stripped.startswith(("#", "else", "elif", "finally", "except",
                                                 "return", ")", "and ", "or ")):
            continue
        fn = cut_at(i)
        if fn is not None:
            cuts.append((i, stripped, fn))
    best = {i: float("inf") for i, _, _ in cuts}
    for _ in range(ROUNDS):  # interleaved: the host's load changes spread over every cut
        for i, _, fn in cuts:
            _fast.Fast.call = fn
            try:
                best[i] = min(best[i], per(call, x, 3000, 1))
            except Exception:  # noqa: BLE001 - a cut that leaves a name unbound
                best[i] = float("nan")
            finally:
                _fast.Fast.call = ORIG
    prev = 0.0
    for i, stripped, _ in cuts:
        us = best[i]
        if us == us and (us < whole - 0.1 or i >= last - 12):
            print(f"{i:3d} {us:6.2f} {us - prev:+6.2f}  {stripped[:80]}", flush=True)
            prev = us
    assert g._cudagraphify_state._fast is fast, "the cut calls dropped the fast path"


torch.manual_seed(0)
lin = nn.Linear(64, 64).to(DEV)
x = torch.randn(4, 64, device=DEV)
with torch.no_grad():
    if DEV == "cuda":
        graph, static_x, static_y = hand_capture(lin, x)  # (the bench's reference row)

        def hand(inp):
            static_x.copy_(inp)
            graph.replay()
            return static_y
        print(f"hand copy-in + replay {per(hand, x):.2f} µs; eager {per(lin, x):.2f} µs")
    profile("copy_outputs=False", cg.graphify(copy.deepcopy(lin), copy_outputs=False), x)
    profile("graphify", cg.graphify(copy.deepcopy(lin)), x)
    with cg.graph_region():
        profile("graph_region", cg.graphify(copy.deepcopy(lin)), x)
