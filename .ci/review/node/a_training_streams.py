"""[control] Training first calls with the real call on the caller's stream (99d7faa).

The real call's autograd graph is alive while the same first call captures (the caller holds
its output until its backward): its parameters' AccumulateGrad nodes now live on the caller's
stream (the legacy default stream here), where before they lived on the side stream. The
capture's backward must still be captured (stand-in aliases, see _training.capture_training)
and not fail with "legacy stream depend on a capturing blocking stream" (CaptureFailed, then
eager for good). Checked: on the default stream and inside a user stream, with the default
num_warmup_iters and with 3 (extra warm-ups on the side stream after the real call), an
input that requires grad or not: every output bitwise as eager's (the first call's real call
included, consumed at once on the caller's stream without a sync), gradients close, the
signature graphed (no eager call) and replayed.
Run from the repository root: python3 .ci/review/node/a_training_streams.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("a_training_streams.py")
import contextlib  # noqa: E402

import torch  # noqa: E402
import cudagraphify as cg  # noqa: E402


def scenario(user_stream: bool, warm: int, xgrad: bool) -> str:
    ref, g = C.pair(C.Net, seed=0, num_warmup_iters=warm)
    if user_stream and not C.CPU:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        ctx = torch.cuda.stream(s)
    else:
        ctx = contextlib.nullcontext()
    with ctx:
        for i in range(5):
            for m in (ref, g):
                m.zero_grad(set_to_none=False)
            x = C.x_(requires_grad=xgrad)
            got = g(x)
            got2 = got * 3 + 1  # consumed at once on the caller's stream
            want = ref(x)
            want2 = want * 3 + 1
            if not torch.equal(got, want) or not torch.equal(got2, want2):
                return f"call {i}: output differs from eager's ({C.stats_line(g)})"
            got.square().sum().backward()
            want.square().sum().backward()
            why = C.grads_close(g, ref)
            if why:
                return f"call {i}: {why} ({C.stats_line(g)})"
    C.sync_all()
    s = cg.stats(g)
    if s.eager or s.captures < 1 or s.replays < 3:
        return f"not graphed as expected: {C.stats_line(g)}"
    cg.ungraphify(g)
    return ""


for user_stream in (False, True):
    for warm in (1, 3):
        for xgrad in (False, True):
            label = (f"[control] training, {'user stream' if user_stream else 'default stream'},"
                     f" num_warmup_iters={warm}, input requires grad={xgrad}")
            try:
                why = scenario(user_stream, warm, xgrad)
            except Exception as e:  # noqa: BLE001
                why = f"{type(e).__name__}: {str(e)[:200]}"
            C.check(not why, f"{label}: outputs bitwise, gradients close, graphed", why)
C.finish("a_training_streams")
