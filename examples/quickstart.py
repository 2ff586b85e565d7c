"""Quickstart: a small GPT, eager vs ``graphify``: same outputs, and the speed-up on a GPU.

    python examples/quickstart.py

On a machine without a GPU it runs everything eagerly (and says so): CUDA graphs need CUDA.
"""

from __future__ import annotations

import copy
import time
import warnings

import torch

import cudagraphify as cg
from gpt import GPT  # examples/gpt.py: a small GPT in plain PyTorch


def us_per_call(fn, x, calls=50, repeats=5):
    best = []
    for _ in range(repeats):
        if x.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(x)
        if x.is_cuda:
            torch.cuda.synchronize()
        best.append((time.perf_counter() - t0) / calls * 1e6)
    return sorted(best)[len(best) // 2]


def main() -> None:
    on_gpu = torch.cuda.is_available()
    # On a GPU, workload A of the design notes (width 768, 12 blocks, bf16, 16 tokens); on a
    # CPU a smaller fp32 model, to stay quick.
    dim, heads, layers, dtype = (768, 12, 12, torch.bfloat16) if on_gpu else \
        (256, 4, 4, torch.float32)
    device = "cuda" if on_gpu else "cpu"
    torch.manual_seed(0)
    eager = GPT(dim, heads, layers).to(device=device, dtype=dtype).eval()
    graphed = cg.graphify(copy.deepcopy(eager))

    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", cg.CudagraphifyWarning)
        for _ in range(5):
            x = torch.randn(1, 16, dim, device=device, dtype=dtype)
            torch.testing.assert_close(graphed(x), eager(x), rtol=0, atol=0)
        print(f"outputs equal eager over 5 calls ({layers} blocks, d={dim}, "
              f"{str(dtype).removeprefix('torch.')}, on {device})")
        s = cg.stats(graphed)
        print(f"captures={s.captures} replays={s.replays} eager calls={s.eager}")
        if not on_gpu:
            reason = next(iter(s.eager_calls), "no reason recorded")
            print(f"no CUDA GPU here: graphify ran eagerly ({reason}); "
                  f"{len(caught)} warning(s) said so")
            return
        t_eager = us_per_call(eager, x)
        t_graph = us_per_call(graphed, x)
    print(f"eager {t_eager:.0f} µs/call, graphify {t_graph:.0f} µs/call, "
          f"speed-up {t_eager / t_graph:.1f}x")


if __name__ == "__main__":
    main()
