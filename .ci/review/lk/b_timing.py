"""Leaf-kind review on CUDA, C1: a tensor argument carrying attributes a library set
(``nn.Buffer``: persistent / _is_buffer; ``torch._dynamo.mark_dynamic``;
``mark_static_address``) never gets the fast path (``Fast.make`` refuses it): us per replayed
call beside a plain argument's [INFO], and whether ``Fast`` was made [finding]."""
import copy
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CPU, DEV, D, check, finish, info, rand, same, skip_without_cuda, \
    stats_line, sync_all  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

skip_without_cuda("b_timing")
import cudagraphify as cg  # noqa: E402
from cudagraphify._fast import Fast  # noqa: E402


class Add(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x, b):
        return x * self.w + b


def buffer():
    m = nn.Module()
    m.b = nn.Buffer(rand())
    return m.b


def dynamic():
    t = rand()
    torch._dynamo.mark_dynamic(t, 0)
    return t


def static_address():
    t = rand()
    torch._dynamo.mark_static_address(t)
    return t


ITERS = 200 if CPU else 2000
for label, make in (("plain", rand), ("nn.Buffer", buffer), ("mark_dynamic", dynamic),
                    ("mark_static_address", static_address)):
    torch.manual_seed(0)
    ref = Add().to(DEV)
    g = cg.graphify(copy.deepcopy(ref))
    b = make()
    ok = True
    with torch.no_grad():
        for _ in range(5):
            x = rand()
            ok = ok and same(g(x, b), ref(x, b))[0]
        x = rand()
        sync_all()
        t0 = time.perf_counter()
        for _ in range(ITERS):
            g(x, b)
        sync_all()
        us = (time.perf_counter() - t0) / ITERS * 1e6
    fast = g._cudagraphify_state._fast
    info(f"{label}: {us:.1f} us/call, fast path {type(fast).__name__}, {stats_line(g)}")
    tag = "[control]" if label == "plain" else "[finding] C1"
    check(ok and type(fast) is Fast and cg.stats(g).replays >= 4,
          f"{tag} {label} argument: replayed through Fast",
          f"equal={ok} fast={type(fast).__name__} ({stats_line(g)})")

finish("b_timing")
