"""Hunt-8d review on CUDA: the per-call cost of ``Fast``'s new distinctness check
(``pairs`` for up to 5 tensors, ``spread`` beyond; None: no check), measured in one process: a graphified small
module (elementwise, its own parameter) called with 1, 2, 3, 6 positional tensors, replaying
through ``Fast``, with the check as made and with ``pairs``/``spread`` cleared (as before
f8c82f7). INFO lines (ns per call, median of 7 timings); one [control] line that every call
replayed. ``labels=input_ids``-style calls (one tensor twice) take the slow path: timed too."""
import os
import statistics
import sys
import timeit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CPU, DEV, check, finish, info, skip_without_cuda, sync_all  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

skip_without_cuda("c_timing")
import cudagraphify as cg  # noqa: E402
from cudagraphify._fast import Fast  # noqa: E402
from cudagraphify._pieces import STATE  # noqa: E402


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64))

    def forward(self, *xs):
        return xs[0] * self.w


NUM = 300 if CPU else 3000
ok = True
with torch.no_grad():
    for n in (1, 2, 3, 6):
        g = cg.graphify(M().to(DEV))
        xs = [torch.randn(8, 64, device=DEV) for _ in range(n)]
        for _ in range(5):
            g(*xs)
        fast = g.__dict__[STATE]._fast
        if type(fast) is not Fast:
            check(False, f"[control] {n} tensors: a Fast", repr(fast))
            continue
        pairs, spread = fast.pairs, fast.spread
        r0 = cg.stats(g).replays
        on, off = [], []
        for _ in range(7):
            fast.pairs, fast.spread = pairs, spread
            sync_all()
            on.append(timeit.timeit(lambda: g(*xs), number=NUM) / NUM * 1e9)
            fast.pairs, fast.spread = None, None  # (no check: as for one tensor)
            sync_all()
            off.append(timeit.timeit(lambda: g(*xs), number=NUM) / NUM * 1e9)
        fast.pairs, fast.spread = pairs, spread
        sync_all()
        ok = ok and cg.stats(g).replays - r0 == 14 * NUM
        a, b = statistics.median(on), statistics.median(off)
        info(f"{n} positional tensors: {a:.0f} ns/call with the check, {b:.0f} without "
             f"(+{a - b:.0f} ns)")
    g = cg.graphify(M().to(DEV))
    x = torch.randn(8, 64, device=DEV)
    y = torch.randn(8, 64, device=DEV)
    for _ in range(5):
        g(x, x)
        g(x, y)
    sync_all()
    t_rep = statistics.median(timeit.timeit(lambda: g(x, x), number=NUM // 3) / (NUM // 3) * 1e9
                              for _ in range(5))
    info(f"f(x, x) (one tensor twice: the slow path every call): {t_rep:.0f} ns/call")
check(ok, "[control] every timed call replayed through Fast")
finish("c_timing")
