"""r62 finding I (wrong values; 14fd1a7 + 8ca0d6d): around a CUDA capture ``Capturing.capture``
passes ``_really_written(held)`` to ``_writes.kept`` (cudagraphify/_capturing.py:46-47, :116-127):
on the CUDA backend (``capture_runs_kernels = False``) only the host's (CPU) held tensors. But
``_writes.undone`` now also puts back the *layout* of those tensors (8ca0d6d, _writes.py:87-99),
and a layout change (``self.m.t_()``, ``unsqueeze_``, ``resize_``, ``set_``) is host work: it runs
for real during a CUDA capture. So r61's finding D (a forward's ``self.m.t_()`` on a plain tensor
attribute) is fixed on the CPU double only: on a GPU the capture's run transposes ``m`` once more,
nothing puts it back, the guard then sends the call eagerly, and every later call computes on a
matrix transposed one time too many (or too few) against eager.

Same for the tensors the real call bound to module attributes (``kept(..., host_only=True)``: the
device ones are dropped from ``undone`` entirely, layouts included).

Fix: keep the byte copies host-only, but put back the layouts (and versions) of every held and
bound tensor, whatever its device: ``undone(tensors, copy=...)`` taking the set to copy apart from
the set whose layouts and versions are kept.

Expected on the reviewed code: I1/I2 FAIL (CUDA held tensor), I3 PASS (control: the same with the
tensor on the host). Run on one GPU: ``python i_cuda_capture_held_layout.py``.
"""
import copy
import warnings

import torch
from torch import nn

import cudagraphify as cg

DEV = torch.device("cuda")
warnings.simplefilter("ignore", cg.CudagraphifyWarning)


class Transposer(nn.Module):
    """Transposes a plain tensor attribute in place on every call (``t_()``: metadata only)."""

    def __init__(self, where):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.m = torch.randn(10, 10, device=where)

    def forward(self, x):
        m = self.m.t_()
        return self.lin(x).repeat(1, 3)[:, :10] @ m.to(x.device)


def run(name, where, warmups):
    torch.manual_seed(0)
    ref = Transposer(where).to(DEV)
    ref.m = ref.m.to(where)
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    ok, why = True, ""
    try:
        with torch.no_grad():
            for i in range(5):
                x = torch.randn(2, 4, device=DEV)
                a, b = g(x), ref(x)
                if not torch.equal(a, b):
                    ok, why = False, f"call {i}: output differs from eager"
                    break
                if not (torch.equal(g.m, ref.m) and g.m.stride() == ref.m.stride()):
                    ok, why = False, f"call {i}: m's layout {g.m.stride()} vs eager {ref.m.stride()}"
                    break
    except Exception as e:  # noqa: BLE001
        ok, why = False, f"raised {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    torch.cuda.synchronize()
    print(f"{'PASS' if ok else 'FAIL'} {name}: {why or 'equal to eager'}")


def main():
    run("I1 CUDA held tensor t_() per call, 1 warm-up", DEV, 1)
    run("I2 CUDA held tensor t_() per call, 3 warm-ups", DEV, 3)
    run("I3 (control) CPU held tensor t_() per call, 1 warm-up", torch.device("cpu"), 1)


if __name__ == "__main__":
    main()
