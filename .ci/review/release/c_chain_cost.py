"""What cd1f035 and 2a3e79c add to every run of a piecewise root (_pieces.PieceRuns._chain_run):
_run_stream (the backend, its stream token), enter_run/exit_run, release_aliases, the region's
lock once more. Measured on the device's backend (CUDA: torch._C._cuda_getCurrentRawStream).

- [control] the added cost per run under 3 us (measured: ~0.7 us on the CPU double's host).
- INFO: each part, and a tight loop of a small piecewise root (time per call)."""
import timeit

import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _capture, _pieces, _region
from common import CPU, DEV, check, finish, info, timed

W, N = (8, 4) if CPU else (64, 8)


class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x):
        y = self.a(x)
        if bool((y > 1e9).any()):
            raise AssertionError
        return self.b(y)


def us(fn, n=100000):
    return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e6


def main():
    info(f"DEV={DEV}")
    dev = torch.device(DEV if DEV != "cuda" else "cuda:0")
    if not CPU:
        torch.cuda.init()
    r = _region.GraphRegion()
    r.implicit = True
    tok = _pieces._run_stream(dev)
    run_stream = us(lambda: _pieces._run_stream(dev))

    def enter_exit():
        with r.lock:
            r.enter_run(tok)
        with r.lock:
            r.release_aliases()
            r.exit_run(tok, _capture.default_backend(), dev)
    ee = us(enter_exit)
    info(f"_run_stream {run_stream:.3f} us; enter_run + lock + release_aliases + exit_run "
         f"{ee:.3f} us")
    check(run_stream + ee < 3.0, "[control] added cost per root run under 3 us",
          f"{run_stream + ee:.2f} us")
    g = cg.graphify(Root().to(DEV))
    x = torch.randn(N, W, device=DEV)
    with torch.no_grad():
        for _ in range(10):
            g(x)
        t = timed(lambda: g(x), 2000)
    info(f"piecewise root, tight loop: {t * 1e6:.1f} us per call")
    finish()


if __name__ == "__main__":
    main()
