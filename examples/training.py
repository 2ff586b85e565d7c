"""A training loop through graphs: forward and backward replayed, AdamW, same weights as eager.

    python examples/training.py
"""

from __future__ import annotations

import copy
import warnings

import torch

import cudagraphify as cg
from gpt import GPT  # examples/gpt.py: a small GPT in plain PyTorch


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    eager = GPT(256, 4, 4, dropout=0.0).to(device).train()
    graphed = cg.graphify(copy.deepcopy(eager))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, graphed)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudagraphifyWarning)
        for step in range(10):
            x = torch.randn(4, 16, 256, device=device)
            for model, opt in zip((eager, graphed), opts):
                opt.zero_grad(set_to_none=True)
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
    for p, q in zip(eager.parameters(), graphed.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)
    s = cg.stats(graphed)
    print(f"weights after 10 AdamW steps equal eager; captures={s.captures} "
          f"replays={s.replays} eager calls={s.eager}")
    if device == "cpu":
        print("no CUDA GPU here: every step ran eagerly")


if __name__ == "__main__":
    main()
