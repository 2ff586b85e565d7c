"""The per-call cost c213750 adds: a region graph's slot is in ``entry.handed``, one more
address compared on every fast-path call (Linear 256 wide, batch 8, no_grad).
  INFO  microseconds per call: a region's single-output graph, a two-graph chain, and the same
        Linear outside a region (its output copied); run it from a checkout of c213750^ too to
        compare;
  [control] the region's fast path takes every call (no miss), its slot in entry.handed.
Run from the repository root: python3 .ci/review/grow/c_cost.py
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("c_cost.py")
import torch  # noqa: E402

import cudagraphify as cg  # noqa: E402
from cudagraphify import _fast  # noqa: E402

W, DEV, B = C.W, C.DEV, 8
N = 300 if C.CPU else 3000


def per_call(fn, x, n=N):
    for _ in range(20):
        fn(x)
    C.sync_all()
    t0 = time.perf_counter()
    for _ in range(n):
        fn(x)
    C.sync_all()
    return (time.perf_counter() - t0) / n * 1e6


def fast_path_taken():
    ra, fa = C.pair(0)
    misses = []
    real = _fast.Fast.call

    def call(self, fn, args, kwargs):
        out = real(self, fn, args, kwargs)
        misses.append(out is _fast.MISS)
        return out

    with torch.no_grad(), cg.graph_region():
        for _ in range(4):
            fa(torch.randn(B, W, device=DEV))
        _fast.Fast.call = call
        try:
            for i in range(6):
                x = torch.randn(B, W, device=DEV)
                ok, why = C.same(fa(x), ra(x))
                if not ok:
                    return False, f"call {i}: {why}"
        finally:
            _fast.Fast.call = real
        state = fa.__dict__["_cudagraphify_state"]
        fast = state._fast
        handed = len(fast.entry.handed) if isinstance(fast, _fast.Fast) else -1
    return bool(misses) and not any(misses) and handed == 1, \
        f"misses={sum(misses)}/{len(misses)}, slots in entry.handed={handed}"


if __name__ == "__main__":
    C.guarded("control", "region single-output graph: fast path every call, slot in handed",
              fast_path_taken)
    x = torch.randn(B, W, device=DEV)
    ra, fa = C.pair(0)
    rb, fb = C.pair(1)
    with torch.no_grad():
        C.info(f"outside a region (copied output): {per_call(fa, x):.1f} us/call")
        with cg.graph_region():
            C.info(f"region, one graph: {per_call(fa, x):.1f} us/call")
            C.info(f"region, chain fa -> fb: {per_call(lambda t: fb(fa(t)), x):.1f} us/call")
        C.info(f"eager Linear: {per_call(ra, x):.1f} us/call")
    C.finish("c_cost.py")
