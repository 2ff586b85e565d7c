"""r62 finding J (crash; 14fd1a7 + 8ca0d6d): around a CUDA capture, ``_writes.kept(self._left(),
..., host_only=True)`` (cudagraphify/_capturing.py:46-47; _writes.py:141-142) leaves the device
tensors the real call bound to module attributes out of ``undone`` altogether, and with them out
of ``versions_kept``; ``versions_kept(held)`` (_capturing.py:48) covers the warm-up guard's
tensors only (what the real call read *first*). The capture's run writes such a tensor in place
(no kernel runs, but the version counter moves: it is host bookkeeping). In training the real
call's autograd graph saved that tensor: the user's ``backward()`` of the first call raises
"one of the variables needed for gradient computation has been modified by an inplace
operation". Eager, and the CPU double (where every bound tensor's version is kept), are fine.

Model: a ring buffer kept as a plain attribute, written in place and rebound to a rolled copy
(r61's finding B), its slice multiplying the output (``mul`` saves it for backward).

Fix: keep the versions (and layouts) of every bound and held tensor around the capture; only
the byte copies are host-only.

Expected on the reviewed code: J1 FAIL (backward raises), J2 PASS (control: the output adds the
slice, nothing saved). Run on one GPU: ``python j_cuda_capture_bound_version.py``.
"""
import copy
import warnings

import torch
from torch import nn

import cudagraphify as cg

DEV = torch.device("cuda")
warnings.simplefilter("ignore", cg.CudagraphifyWarning)


class Ring(nn.Module):
    def __init__(self, saves: bool):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.ring = torch.zeros(8, device=DEV)
        self.saves = saves

    def forward(self, x):
        self.ring[0] += 1
        self.ring = torch.roll(self.ring, 1)
        h = self.lin(x)
        return h * self.ring[:4] if self.saves else h + self.ring[:4]


def run(name, saves):
    torch.manual_seed(0)
    ref = Ring(saves).to(DEV)
    g = cg.graphify(copy.deepcopy(ref))
    ok, why = True, ""
    try:
        for i in range(4):
            x = torch.randn(2, 4, device=DEV)
            a, b = g(x), ref(x)
            if not torch.equal(a, b):
                ok, why = False, f"call {i}: output differs from eager"
                break
            a.sum().backward()
            b.sum().backward()
            if not torch.equal(g.lin.weight.grad, ref.lin.weight.grad):
                ok, why = False, f"call {i}: grad differs from eager"
                break
            if not torch.equal(g.ring, ref.ring):
                ok, why = False, f"call {i}: ring differs from eager"
                break
    except Exception as e:  # noqa: BLE001
        ok, why = False, f"raised {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    torch.cuda.synchronize()
    print(f"{'PASS' if ok else 'FAIL'} {name}: {why or 'equal to eager'}")


def main():
    run("J1 training, ring bound by the real call and saved for backward", True)
    run("J2 (control) training, ring bound by the real call, not saved", False)


if __name__ == "__main__":
    main()
