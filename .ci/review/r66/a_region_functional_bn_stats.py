"""r66 finding A on a GPU: a chaining graph_region's first call replays a graph that updates
running statistics kept as plain tensor attributes through ``F.batch_norm(training=True)``.

``verify`` replays the new graph right after the real call in a chaining region unless
``_wrote_held()`` (cudagraphify/_first_call.py:404); ``_wrote_held`` asks the warm probe's
``written`` (cudagraphify/_capturing.py:190), which does not hold the statistics a batch norm
kernel updates. The real call and the replay both update them: the stats are one momentum step
ahead of the eager twin after the first region call.

Expected on the reviewed code: A1 FAIL (stats differ), A2 PASS (control: the same calls outside
a region). Run on one GPU: ``python a_region_functional_bn_stats.py``.
"""
import copy
import warnings

import torch
from torch import nn

import cudagraphify as cg

DEV = torch.device("cuda")
warnings.simplefilter("ignore", cg.CudagraphifyWarning)


class FBN(nn.Module):
    def __init__(self, d=256):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.rm = torch.zeros(d, device=DEV)
        self.rv = torch.ones(d, device=DEV)

    def forward(self, x):
        return nn.functional.batch_norm(self.lin(x), self.rm, self.rv, training=True,
                                        momentum=0.1)


def run(region: bool) -> bool:
    torch.manual_seed(0)
    ref = FBN().to(DEV)
    g = cg.graphify(copy.deepcopy(ref))
    ok = True
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(8, 256, device=DEV)
            with cg.graph_region(enabled=region):
                a, b = g(g(x)), ref(ref(x))
                a, b = a.clone(), b.clone()
            torch.cuda.synchronize()
            ok &= torch.equal(g.rm, ref.rm) and torch.equal(g.rv, ref.rv)
            ok &= bool(torch.allclose(a, b, rtol=1e-4, atol=1e-5))
    return ok


print("A1", "PASS" if run(True) else "FAIL", "(graph_region, functional BN stats as attributes)")
print("A2", "PASS" if run(False) else "FAIL", "(control: no region)")
