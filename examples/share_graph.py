"""share_graph: one capture for a stack of identical blocks, each replayed with its own weights.

    python examples/share_graph.py
"""

from __future__ import annotations

import copy
import time
import warnings

import torch

import cudagraphify as cg
from gpt import GPT  # examples/gpt.py: a small GPT in plain PyTorch


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    eager = GPT(256, 4, 12).to(device).eval()
    model = copy.deepcopy(eager)
    group = cg.share_graph(model.blocks)  # graphifies every block; they share captures
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudagraphifyWarning)
        t0 = time.perf_counter()
        for seq in (8, 16):  # two signatures
            for _ in range(5):
                x = torch.randn(1, seq, 256, device=device)
                torch.testing.assert_close(model(x), eager(x), rtol=0, atol=0)
        seconds = time.perf_counter() - t0
    print("outputs equal eager over 5 forwards of each of 2 shapes")
    if device == "cpu":
        print("no CUDA GPU here: every block ran eagerly")
        return
    s = group.stats()
    print(f"{s.layers} blocks: {s.captures} captures, {s.retargets} block graphs made "
          f"from them, {s.per_layer} captured on their own {s.reasons or ''}; "
          f"graph pool {s.template_pool_bytes / 2**20:.1f} MB; {seconds:.3f} s for the 10 "
          "forwards, warm-ups included")


if __name__ == "__main__":
    main()
