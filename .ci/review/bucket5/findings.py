"""bucket5 review (of dfd80f2: bucketed's host reads of weights alone) on a GPU. One line per
check: ``PASS ...`` / ``FAIL ...``; ``[finding]`` lines FAIL where the finding holds, ``[control]``
lines should PASS. CPU reproductions in tests/test_review_bucket5.py. DEV=cpu: a smoke test on
the CPU (bucketed needs no graph backend here: the target is a plain module).

B5-1 weights with a tensor made from nothing (arange, zeros) read as data.
B5-2 weights written in place (copy_) into a tensor made from the arguments read as data.
B5-3 weights alone computed into a freed data tensor's memory read as data: the caching
     allocator hands a freed block back at once, so a small temporary shows it on a GPU."""
import copy
import os
import sys
import warnings

import torch
from torch import nn

ROOT = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
sys.path.insert(0, ROOT)
DEV = os.environ.get("DEV", "cuda")
warnings.simplefilter("ignore")
if DEV != "cpu" and not torch.cuda.is_available():
    print("SKIP bucket5: no CUDA")
    sys.exit(0)
import cudagraphify as cg  # noqa: E402

REUSED = []


class Gated(nn.Module):
    def __init__(self, gate):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.p = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.register_buffer("flag", torch.zeros(1))
        self.gate = gate

    def forward(self, x):
        h = torch.tanh(x * self.w)
        return h - h.mean(0, keepdim=True) if self.gate(self, x) else h


def _copied(self, x):
    h = x[:1, 0].clone()
    h.copy_(self.p)
    return bool(h.any())


def _reused(self, x):
    t = x[0, :1] * 2  # (data, freed at once)
    at = t.untyped_storage().data_ptr()
    del t
    f = self.p * 1  # (weights alone)
    REUSED.append(f.untyped_storage().data_ptr() == at)
    return bool(f.any())


GATES = {
    "[finding] B5-1 arange < a count in a frozen parameter":
        lambda self, x: bool((torch.arange(4, device=x.device) < self.p).any()),
    "[finding] B5-2 a frozen flag copied into a tensor made from x": _copied,
    "[finding] B5-3 a frozen flag computed into a freed temporary's block": _reused,
    "[control] a frozen flag alone": lambda self, x: bool(self.p.any()),
    "[control] arange < a count in a buffer":
        lambda self, x: bool((torch.arange(4, device=x.device) < self.flag).any()),
}

for what, gate in GATES.items():
    torch.manual_seed(0)
    REUSED.clear()
    ref = Gated(gate).to(DEV).eval()
    b = cg.bucketed(copy.deepcopy(ref), [4, 8])
    ok, why = True, ""
    with torch.no_grad():
        for i in range(5):
            if i == 3:  # (after the check: the flag set in place, no attribute written)
                for m in (ref, b._target):
                    m.p.fill_(4.0)
                    m.flag.fill_(4.0)
            x = torch.randn(3, 4, device=DEV)
            if not torch.equal(b(x.clone()), ref(x.clone())):
                ok, why = False, f"call {i}: padded rows joined the batch"
                break
    note = f" (reused in the check: {REUSED[0]})" if REUSED else ""
    print(("PASS " if ok else "FAIL ") + what + note + ("" if ok else f": {why}"))
