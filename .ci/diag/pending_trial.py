"""#16's differential "grad mode" step on the CPU double: with pieces timed (a clock given to
the simulated backend, its replay a no-op so the graphs win their trials), a piece's training
graph whose kept output holds it pending while its trial is still running gets no second graph
in flight (``_engine._another_in_flight`` wants every busy graph's trial over), so its calls
run eagerly through ``EagerFast.pending`` for as long as the output is kept (2026-12-05: 8
captures, 16 replays, 168 pending eager calls; without a clock: 16 captures, 184 replays, none
eager). On the H100, GPT-2 and Llama's grad mode steps were 1.15x and 1.105x eager this way.
Tried and reverted the same day (a50fefe, 7eab706; 47c18a7): letting the second graph be made
and share the trial removed the pending eager calls here, but on the H100 the grad-mode step
got no faster on GPT-2 (1.159x) and slower on Llama (1.206x): a training graph's replay (no
fast path) costs more than these pieces' eager runs through the pending fast path.
Run: python .ci/diag/pending_trial.py [--no-clock]"""
import copy
import os
import sys
import time
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../tests"))
from conftest import SimBackend, SimGraph  # noqa: E402

import cudagraphify as cg  # noqa: E402
from cudagraphify import _capture  # noqa: E402
from cudagraphify.bench.differential import _ids, apply_step, path_taken, steps  # noqa: E402

warnings.simplefilter("ignore")
backend = SimBackend()
if "--no-clock" not in sys.argv:
    SimGraph.replay = lambda self: None
    backend.clock = lambda device: time.perf_counter
_capture.set_backend(backend)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc, self.fc2 = nn.LayerNorm(32), nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        t = torch.tensor([1.0])  # CROSS_DEVICE: the block runs eagerly, its children are pieces
        return x + self.fc2(self.fc(self.ln(x))) * t


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(500, 32), nn.Linear(32, 500)
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


torch.manual_seed(0)
ref = Model()
graphed, make = cg.graphify(copy.deepcopy(ref)), _ids(500, "cpu")
for step, change, kwargs, ctx in steps("cpu"):
    if step.startswith("autocast"):
        continue
    x = apply_step(step, change, make, kwargs, ref, graphed)
    before = cg.stats(graphed)
    with ctx():
        for _ in range(6):  # as the bench: the last outputs stay referenced while timed
            got, want = graphed(x), ref(x)
        for _ in range(20):
            graphed(x)
    print(f"{step:<28} {path_taken(before, cg.stats(graphed))[:200]}", flush=True)
