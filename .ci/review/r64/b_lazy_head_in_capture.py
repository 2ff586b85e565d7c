"""r64 finding B on a GPU (introduced by 27cfff6 (H)): a lazy head first reached by the
capture's run, not by the real call.

With lazy modules watched (GraphedState._watch_lazy, cudagraphify/_engine.py:756-774) instead
of every call running eagerly while any parameter is lazy, a FirstCall runs while the head is
still lazy. Its real call binds ``prev`` and does not run the head (``initialized`` False,
_first_call.py:150); the capture's run sees ``prev`` set and runs the head, whose initializer
materializes the weights inside the CUDA capture (memory of the graph's pool) and records its
``uniform_`` kernels without running them: the head keeps uninitialized memory as weights
(and the capture's attribute writes, ``in_features``, are undone). The simulated backend
cannot show it (its capture fails on the uninitialized parameter); a CUDA capture does not.

Expected on the reviewed code: B1 FAIL (outputs and head weights differ from the eager twin,
which initializes the head on its second call with the same seed), B2 PASS (control: the same
model with the head initialized before graphify).
Run on one GPU: ``python b_lazy_head_in_capture.py``.
"""
import copy
import warnings

import torch
from torch import nn

import cudagraphify as cg

DEV = torch.device("cuda")
warnings.simplefilter("ignore", cg.CudagraphifyWarning)


class Prev(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.head = nn.LazyLinear(32)
        self.prev = None

    def forward(self, x):
        h = self.lin(x)
        if self.prev is None:
            self.prev = h.detach().clone()
            return h[:, :32]
        return self.head(h + self.prev)


def run(name, init_first):
    torch.manual_seed(0)
    ref = Prev().to(DEV)
    if init_first:
        with torch.no_grad():
            ref.prev = torch.zeros(8, 64, device=DEV)
            ref(torch.randn(8, 64, device=DEV))
            ref.prev = None
    g = cg.graphify(copy.deepcopy(ref))
    ok = True
    with torch.no_grad():
        for i in range(6):
            if i < 2:
                g.prev = ref.prev = None  # a new sequence
            x = torch.randn(8, 64, device=DEV)
            torch.manual_seed(100 + i)
            a = g(x)
            torch.manual_seed(100 + i)
            b = ref(x)
            torch.cuda.synchronize()
            if not torch.equal(a, b):
                ok = False
                print(f"{name}: call {i} output differs (max {float((a - b).abs().max()):.3g})")
    for (n, p), q in zip(g.named_parameters(), ref.parameters()):
        if not torch.equal(p, q):
            ok = False
            print(f"{name}: parameter {n} differs")
    if g.head.in_features != ref.head.in_features:
        ok = False
        print(f"{name}: head.in_features {g.head.in_features} != {ref.head.in_features}")
    print(f"{'PASS' if ok else 'FAIL'} {name}  stats: {cg.stats(g)}")


run("B1 lazy head first reached in the capture", init_first=False)
run("B2 control: head initialized before graphify", init_first=True)
