"""share_graph and the random stream: the template's RNG probe replay is not put back.

``ShareGroup._check_no_rng`` (cudagraphify/_share.py) replays the template layer's graph once to
see whether it draws; where it does (dropout in train mode, MC dropout under no_grad) sharing is
refused, but that replay has moved the CUDA generator's offset by what the graph draws, and
nothing puts it back (``_writes.rng_kept`` is not around it). The user's random stream is then
ahead of eager's from the first call on: every later dropout mask differs from an eager twin
seeded alike.
Checks (4 layers of Linear -> Dropout(0.5) in train mode, called under no_grad, seeded once,
inputs from a CPU generator; an eager twin seeded alike):
  [control] each layer graphify'd on its own (num_warmup_iters=3): outputs and CUDA RNG state
            as eager's after every call;
  [finding] share_graph(layers): outputs and CUDA RNG state as eager's after every call.
DEV=cpu: a smoke test only (the probe replay runs on CUDA devices only: both lines PASS there).
Run from the repository root: python3 .ci/review/hf/a_share_rng.py
"""
import copy
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("a_share_rng.py")
import torch  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphify as cg  # noqa: E402

W = 256


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.lin(x))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def sequence(model, calls=5):
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(8, W, generator=gen).to(C.DEV) for _ in range(calls)]
    torch.manual_seed(7)
    out = []
    for x in xs:
        with torch.no_grad():
            y = model(x)
        C.sync_all()
        out.append((y.clone(), C.rng_state().clone()))
    return out


def compare(name, ref, mine, stats):
    bad = ""
    for i, ((a, ra), (b, rb)) in enumerate(zip(sequence(ref), sequence(mine))):
        if not torch.equal(ra, rb):
            bad = f"call {i}: the RNG state after it differs from eager's"
            break
        if not torch.equal(a, b):
            bad = f"call {i}: output differs from eager's"
            break
    C.check(not bad, name, f"{bad} ({stats()})")


def main():
    torch.manual_seed(0)
    ref = Stack().to(C.DEV)

    mine = copy.deepcopy(ref)
    for k, layer in enumerate(mine.layers):
        mine.layers[k] = cg.graphify(layer, num_warmup_iters=3)
    compare("[control] layers graphified one by one: outputs and RNG as eager's", ref, mine,
            lambda: C.stats_line(mine.layers[0]))

    mine = copy.deepcopy(ref)
    group = cg.share_graph(mine.layers)
    compare("[finding] share_graph(layers) with dropout: outputs and RNG as eager's", ref, mine,
            lambda: f"{C.stats_line(mine.layers[0])} group reasons="
                    f"{[r[:80] for r in cg.stats(group).reasons]}")
    C.finish("a_share_rng.py")


if __name__ == "__main__":
    main()
