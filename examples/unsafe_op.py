"""A model with an op a graph cannot hold (``.item()`` in every block), and its explain() tree.

    python examples/unsafe_op.py

cudagraphify finds the ``.item()`` while it warms up, runs each block's own code eagerly and
keeps its attention and MLP graphed. ``explain`` shows the plan (on a CPU too, before any run).
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
    eager = GPT(256, 4, 2, sync=True).to(device).eval()
    x = torch.randn(1, 8, 256, device=device)
    print(cg.explain(eager, x))  # the plan, from a probe run; the model is left as it was

    graphed = cg.graphify(copy.deepcopy(eager))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudagraphifyWarning)
        for _ in range(4):
            x = torch.randn(1, 8, 256, device=device)
            torch.testing.assert_close(graphed(x), eager(x), rtol=0, atol=0)
    print("outputs equal eager over 4 calls")
    if device == "cuda":
        print(cg.explain(graphed))  # the same tree, with captures and replays per piece
    else:
        print("no CUDA GPU here: everything ran eagerly")


if __name__ == "__main__":
    main()
