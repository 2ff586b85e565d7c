"""[control] Inference first calls on the caller's stream (99d7faa), where extra warm-ups and
the capture follow on the side stream, and a region chains graphs on the real call's outputs.

- a user stream around the calls (``torch.cuda.stream(s)``), num_warmup_iters 1 and 3: the real
  call on s; the side stream must wait for s before its warm-ups (``warmup``:
  ``side.wait_stream(cur)``) and the capture (device sync): outputs bitwise as eager's, read
  at once on s.
- ``graph_region``: A's first call's outputs (handed out in place) feed B's first call, whose
  extra warm-ups and capture run on the side stream; then replays chain: bitwise as eager's.
- a caller stream that writes the input right before the call (x.add_ on s, no sync): the
  first call must read the written values.
Run from the repository root: python3 .ci/review/node/b_inference_region.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("b_inference_region.py")
import contextlib  # noqa: E402

import torch  # noqa: E402
import cudagraphify as cg  # noqa: E402


def _stream_ctx(user_stream: bool):
    if user_stream and not C.CPU:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(s)
    return contextlib.nullcontext()


def plain(user_stream: bool, warm: int) -> str:
    ref, g = C.pair(C.Net, seed=0, num_warmup_iters=warm)
    with torch.no_grad(), _stream_ctx(user_stream):
        for i in range(5):
            x = C.x_()
            x.add_(1.0)  # a write on the caller's stream right before the call
            got = g(x)
            got2 = got.relu() * 2
            want = ref(x)
            if not torch.equal(got, want) or not torch.equal(got2, want.relu() * 2):
                return f"call {i}: differs from eager's ({C.stats_line(g)})"
    C.sync_all()
    s = cg.stats(g)
    if s.eager or s.replays < 3:
        return f"not graphed as expected: {C.stats_line(g)}"
    cg.ungraphify(g)
    return ""


def region(user_stream: bool, warm: int) -> str:
    ref_a, ga = C.pair(C.Net, seed=0, num_warmup_iters=warm)
    ref_b, gb = C.pair(C.Net, seed=1, num_warmup_iters=warm)
    with torch.no_grad(), _stream_ctx(user_stream):
        with cg.graph_region():
            for i in range(5):
                x = C.x_()
                h = ga(x)
                y = gb(h)
                y2 = y + h  # A's output read again after B
                want_h = ref_a(x)
                want = ref_b(want_h)
                if not torch.equal(y, want) or not torch.equal(y2, want + want_h):
                    return (f"call {i}: differs from eager's (A: {C.stats_line(ga)}; "
                            f"B: {C.stats_line(gb)})")
    C.sync_all()
    if cg.stats(gb).eager or cg.stats(gb).replays < 3:
        return f"B not graphed as expected: {C.stats_line(gb)}"
    cg.ungraphify(ga), cg.ungraphify(gb)
    return ""


for fn, what in ((plain, "inference"), (region, "graph_region A->B")):
    for user_stream in (False, True):
        for warm in (1, 3):
            label = (f"[control] {what}, {'user stream' if user_stream else 'default stream'}, "
                     f"num_warmup_iters={warm}")
            try:
                why = fn(user_stream, warm)
            except Exception as e:  # noqa: BLE001
                why = f"{type(e).__name__}: {str(e)[:200]}"
            C.check(not why, f"{label}: bitwise as eager, graphed", why)
C.finish("b_inference_region")
