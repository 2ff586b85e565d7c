"""r63 finding F (speed / graph memory; introduced by b4ea731 (H)): ``Capturing._wrote_held``
(cudagraphify/_capturing.py:177-185) now runs over the tensors the real call bound to module
attributes too, and asks ``warm_probe.written``, which holds every storage written in place,
memory the call itself made included. A layer that makes its activation in place
(``torch.relu_(self.lin(x))``) and keeps the first one (``self.sample = h``, a calibration
sample) is taken to "write a tensor it reads from outside": ``_shared`` (_capturing.py:288-295)
refuses the share_graph group, and every layer captures a graph of its own.

Fix: for the bound tensors ask ``warm_probe.written_before_made`` (memory from before the call),
or leave the bound tensors the call made itself out of ``_wrote_held``.

Expected on the reviewed code: F1 FAIL (per-layer graphs, reason "forward writes a tensor it
reads from outside"), F2 PASS (control: the same layers without the kept sample share).
Run on one GPU: ``python f_share_bound_activation.py``.
"""
import copy
import warnings

import torch
from torch import nn

import cudagraphify as cg

DEV = torch.device("cuda")
warnings.simplefilter("ignore", cg.CudagraphifyWarning)


class Layer(nn.Module):
    def __init__(self, keep):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.keep = keep
        self.seen = False
        self.sample = None

    def forward(self, x):
        h = torch.relu_(self.lin(x))
        if self.keep and not self.seen:
            self.sample = h
            self.seen = True
        return h


def run(name, keep):
    torch.manual_seed(0)
    refs = nn.ModuleList([Layer(keep) for _ in range(4)]).to(DEV)
    layers = copy.deepcopy(refs)
    group = cg.share_graph(layers)
    ok, why = True, ""
    try:
        with torch.no_grad():
            for i in range(4):
                x = y = torch.randn(8, 64, device=DEV)
                for layer, r in zip(layers, refs):
                    x, y = layer(x), r(y)
                if not torch.equal(x, y):
                    ok, why = False, f"call {i}: output differs from eager"
                    break
        s = group.stats()
        if ok and (s.per_layer or any("reads from outside" in r for r in s.reasons)):
            ok, why = False, f"per_layer={s.per_layer} reasons={dict(s.reasons)}"
        elif ok:
            why = f"shared: retargets={s.retargets} per_layer={s.per_layer}"
    except Exception as e:  # noqa: BLE001
        ok, why = False, f"raised {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    torch.cuda.synchronize()
    print(f"{'PASS' if ok else 'FAIL'} {name}: {why}")


def main():
    run("F1 layers keeping their first (in-place made) activation share one graph", True)
    run("F2 (control) the same layers keeping nothing share one graph", False)


if __name__ == "__main__":
    main()
