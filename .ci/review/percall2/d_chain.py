"""The fast path's inline hand-out and borrowed-slot checks (commits 2656cb9, f227cc4: a region
graph that reads an earlier graph's output slot in place), on a real memory pool where a later
graph's memory may lie on an earlier one's freed temporaries; against eager. All [control]:
  chain a -> b -> c in a graph_region, every output and views of them kept across 8 calls;
  a kept alias (or a view of it) of a's output, then b called with another tensor (its copy-in
  overwrites a's slot);
  a graph returning a view of its borrowed input, and one with two outputs;
  a given back (ungraphify) in the middle of the region, b still graphed;
  a piecewise root (two pieces around a host sync, chained in its own region): outputs held
  across 10 calls, then two threads calling it at once.
INFO: how many borrowing replays took the fast path.
Run from the repository root: python3 .ci/review/percall2/d_chain.py
"""
import copy
import os
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("d_chain.py")
import torch  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphify as cg  # noqa: E402
from cudagraphify import _fast  # noqa: E402

N = 1 << 16
HITS = [0, 0]  # borrowing entries' fast-path calls: hits, all
_call = _fast.Fast.call


def _spy(self, fn, args, kwargs):
    r = _call(self, fn, args, kwargs)
    if self.entry.borrowed:
        HITS[1] += 1
        HITS[0] += r is not _fast.MISS
    return r


_fast.Fast.call = _spy


def ra(x):
    return (x * 2 + 1).exp().log1p() * 0.5  # (temporaries the pool frees and reuses)


def rb(h):
    return h.sin().mul(3).tanh() + h


def rc(h):
    return h.cos().sub(1).abs().sqrt()


def chain():
    return cg.graphify(lambda x: ra(x)), cg.graphify(lambda h: rb(h)), \
        cg.graphify(lambda h: rc(h))


def eq(*pairs):
    for k, (u, v) in enumerate(pairs):
        ok, why = C.same(u, v)
        if not ok:
            return False, f"pair {k}: {why}"
    return True, ""


def kept_across_calls():
    a, b, c = chain()
    held = []
    with torch.no_grad(), cg.graph_region():
        for _ in range(8):
            x = torch.randn(N, device=C.DEV)
            h = a(x)
            k = b(h)
            o = c(k)
            held.append((x, h, k, o, h[1:], k.view(-1, 2)))
        C.sync_all()
        for x, h, k, o, hv, kv in held:
            w = ra(x)
            ok, why = eq((h, w), (k, rb(w)), (o, rc(rb(w))), (hv, w[1:]),
                         (kv, rb(w).view(-1, 2)))
            if not ok:
                return ok, why
    return True, ""


def kept_alias_other_input():
    a, b, _ = chain()
    with torch.no_grad(), cg.graph_region():
        for _ in range(3):
            b(a(torch.randn(N, device=C.DEV)))
        for i in range(10):
            x = torch.randn(N, device=C.DEV)
            h = a(x)
            view = h[:100] if i % 3 == 1 else None
            want = ra(x)
            other = torch.randn(N, device=C.DEV)
            k = b(h if i % 2 else other)
            k2 = b(other)
            C.sync_all()
            ok, why = eq((k2, rb(other)), (h, want), (k, rb(want if i % 2 else other)))
            if ok and view is not None:
                ok, why = eq((view, want[:100]))
            if not ok:
                return False, f"call {i}: {why}"
    return True, ""


def view_and_two_outputs():
    a = cg.graphify(lambda x: ra(x))
    v = cg.graphify(lambda h: h[1:])
    two = cg.graphify(lambda h: (h.sin(), h.cos()))
    held = []
    with torch.no_grad(), cg.graph_region():
        for _ in range(6):
            x = torch.randn(N, device=C.DEV)
            h = a(x)
            s = v(h)
            p, q = two(h)
            held.append((x, h, s, p, q))
        C.sync_all()
        for x, h, s, p, q in held:
            w = ra(x)
            ok, why = eq((h, w), (s, w[1:]), (p, w.sin()), (q, w.cos()))
            if not ok:
                return ok, why
    return True, ""


def given_back():
    a, b, _ = chain()
    with torch.no_grad(), cg.graph_region():
        for _ in range(4):
            b(a(torch.randn(N, device=C.DEV)))
        cg.ungraphify(a)
        for i in range(4):
            x = torch.randn(N, device=C.DEV)
            h = a(x)
            k = b(h)
            b(torch.randn(N, device=C.DEV) if i % 2 else h)
            C.sync_all()
            ok, why = eq((h, ra(x)), (k, rb(ra(x))))
            if not ok:
                return False, f"call {i}: {why}"
    return True, ""


class Synced(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(256)
        self.mlp = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))

    def forward(self, x):
        h = self.norm(x)
        if h.sum().item() > 1e9:  # a host sync: two pieces
            h = h * 0
        return self.mlp(h) + h


def piecewise():
    torch.manual_seed(0)
    ref = Synced().to(C.DEV).eval()
    g = cg.graphify(copy.deepcopy(ref))
    held = []
    with torch.no_grad():
        for _ in range(10):
            x = torch.randn(64, 256, device=C.DEV)
            held.append((x, g(x)))
        for x, y in held:
            ok, why = eq((y, ref(x)))
            if not ok:
                return ok, why
        errs = []

        def work(seed):
            try:
                gen = torch.Generator(device=C.DEV).manual_seed(seed)
                with torch.no_grad():
                    for _ in range(20):
                        x = torch.randn(64, 256, device=C.DEV, generator=gen)
                        ok, why = eq((g(x), ref(x)))
                        if not ok:
                            errs.append(why)
            except Exception as e:  # noqa: BLE001
                errs.append(f"{type(e).__name__}: {e}")

        th = [threading.Thread(target=work, args=(s,)) for s in (1, 2)]
        for t in th:
            t.start()
        for t in th:
            t.join()
    C.info(f"piecewise root: {C.stats_line(g)}")
    return not errs, "; ".join(errs[:2])


if __name__ == "__main__":
    C.guarded("control", "chain a->b->c, outputs and views kept across calls", kept_across_calls)
    C.guarded("control", "kept alias/view of a's output, b called with another tensor",
              kept_alias_other_input)
    C.guarded("control", "graph returning a view of its borrowed input; two outputs",
              view_and_two_outputs)
    C.guarded("control", "first graph given back mid-region", given_back)
    C.guarded("control", "piecewise root: outputs held, then two threads", piecewise)
    C.info(f"borrowing entries on the fast path: {HITS[0]} hits of {HITS[1]} calls")
    C.finish("d_chain.py")
