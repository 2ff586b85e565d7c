"""1ebb457 with threads and CUDA streams: the recapture rule counts a graph's blocked calls on
one thread; a recapture drains the stream that replayed last and drops the graph.

- [control] two threads, each on a CUDA stream of its own and in a graph_region of its own, run
  the twice-per-step pattern (F, G, F, H; a view of H's output kept until F's first call of the
  next step) on the same graphed callables: every value and every kept view bitwise eager's
  (computed on the same stream), and at most one recapture per region.
- [control] two threads, each on its own stream, call one piecewise root (a host sync between
  its pieces, which chain in the root's implicit region, shared by the threads), keeping every
  output of their last three calls: all bitwise eager's at the end."""
import contextlib
import copy
import threading

import torch
from torch import nn

import cudagraphify as cg
from common import CPU, DEV, VIEW, check, finish, info, sync

W = 64 if CPU else 512


def _stream():
    return contextlib.nullcontext() if CPU else torch.cuda.stream(torch.cuda.Stream())


def own_regions(steps: int = 40):
    torch.manual_seed(0)
    rf, rg, rh = (nn.Linear(W, W).to(DEV) for _ in range(3))  # the eager twins
    gf, gg, gh = (cg.graphify(copy.deepcopy(m)) for m in (rf, rg, rh))
    errors, bads, start = [], [0, 0], threading.Barrier(2)

    def worker(k):
        gen = torch.Generator(device=DEV).manual_seed(k)
        try:
            start.wait(10)
            with _stream(), torch.no_grad(), cg.graph_region():
                v = rv = None
                kept = []
                for t in range(steps):
                    x = torch.randn(8, W, device=DEV, generator=gen)
                    a, ra = gf(x), rf(x)
                    if v is not None:
                        kept.append((v, rv))
                    v = rv = None
                    b, rb = gg(a), rg(ra)
                    c, rc = gf(b), rf(rb)
                    d, rd = gh(c), rh(rc)
                    bads[k] += sum(not torch.equal(p, q) for p, q in
                                   ((a, ra), (b, rb), (c, rc), (d, rd)))
                    v, rv = d[:2], rd[:2]
                    del a, b, c, d
                    kept = kept[-3:]
                    bads[k] += sum(not torch.equal(p, q) for p, q in kept)
                sync()
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    s = cg.stats(gf)
    blocked = sum(n for r, n in s.eager_calls.items() if VIEW in r)
    recaptures = gf._cudagraphify_state._recaptures
    check(not errors and bads == [0, 0] and recaptures <= 2,
          "[control] twice per step from two threads, each on its own stream and region",
          f"errors={errors[:1]} bad={bads} blocked={blocked} recaptures={recaptures} "
          f"replays={s.replays}")


class _Piece(nn.Linear):
    pass


class _Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _Piece(W, W), _Piece(W, W)

    def forward(self, x):
        y = self.a(x)
        if bool((y > -1e9).all()):  # a host sync: the root runs piecewise, a and b graphed
            y = y + 1
        return y, self.b(y)


def shared_implicit_region(calls: int = 40):
    torch.manual_seed(0)
    ref = _Root().to(DEV)
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        x0 = torch.randn(4, W, device=DEV)
        got, want = g(x0), ref(x0)
        first = all(torch.equal(p, q) for p, q in zip(got, want))
    errors, bads, start = [], [0, 0], threading.Barrier(2)

    def worker(k):
        gen = torch.Generator(device=DEV).manual_seed(10 + k)
        try:
            start.wait(10)
            with _stream(), torch.no_grad():
                kept = []
                for _ in range(calls):
                    x = torch.randn(4, W, device=DEV, generator=gen)
                    got, want = g(x), ref(x)
                    bads[k] += sum(not torch.equal(p, q) for p, q in zip(got, want))
                    kept = (kept + [(got, want)])[-3:]
                sync()
                bads[k] += sum(not torch.equal(p, q) for got, want in kept
                               for p, q in zip(got, want))
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    counts = {n: (cg.stats(getattr(g, n)).replays,
                  sum(cg.stats(getattr(g, n)).eager_calls.values())) for n in ("a", "b")}
    check(first and not errors and bads == [0, 0],
          "[control] a piecewise root from two threads on their own streams (its pieces chain "
          "in its implicit region): every output, the last three kept, bitwise eager's",
          f"errors={errors[:1]} bad={bads} pieces (replays, eager)={counts}")


def main():
    info(f"DEV={DEV} W={W}")
    own_regions()
    shared_implicit_region()
    finish()


if __name__ == "__main__":
    main()
