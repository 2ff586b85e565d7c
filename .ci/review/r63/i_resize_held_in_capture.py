"""r63 finding I (wrong values on a GPU; the layout restore of b4ea731 (I, J) does not cover it):
around a CUDA capture ``Capturing.capture`` enters ``_writes.kept(..., host_only=True)``
(cudagraphify/_capturing.py:43-48): the bytes of device tensors are not copied (the capture
runs no kernel), only their layouts and versions are put back (_writes.py:88-108). A forward
that grows a plain tensor attribute in place on every call (``self.log.resize_(n + 4)`` then a
write into the new tail: a running log of activations) grows it once more in the capture's run.
On CUDA the larger storage is allocated in the capture's private pool and the copy of the old
bytes into it is only *recorded*, not run. Afterwards ``undone`` finds the layout changed and
calls ``t.set_(st.st, offset, size, stride)`` with the storage object it kept: the same
StorageImpl, which now points at the new (never written) memory. So ``log`` has the real
call's shape again over memory that never received its bytes: the values the real call logged
are lost (and the memory belongs to the graph's pool). With the default ``num_warmup_iters=1``
there is no extra warm-up to grow the capacity first.

Fix: compare storages by identity *and* address; where a held device tensor's storage moved
during a capture that runs no kernel, copy its bytes (or refuse: run the call eagerly and put
the storage back with ``set_`` on a saved copy of the old data), e.g. save a device copy of a
held tensor whose layout may change (resize_/set_ seen by the probe in the real call).

Expected on the reviewed code: I1 FAIL (log differs from eager after the first call), I2 PASS
(control: the same log kept on the host, whose bytes are copied), I3 PASS (control: 3 warm-ups
grow the capacity before the capture, no reallocation in it).
Run on one GPU: ``python i_resize_held_in_capture.py``.
"""
import copy
import warnings

import torch
from torch import nn

import cudagraphify as cg

DEV = torch.device("cuda")
warnings.simplefilter("ignore", cg.CudagraphifyWarning)


class Log(nn.Module):
    def __init__(self, where):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.log = torch.zeros(0, device=where)

    def forward(self, x):
        h = self.lin(x)
        n = self.log.numel()
        self.log.resize_(n + 4)
        self.log[n:].copy_(h[0].to(self.log.device))
        return h


def run(name, where, warmups):
    torch.manual_seed(0)
    ref = Log(where).to(DEV)
    ref.log = ref.log.to(where)
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    ok, why = True, ""
    try:
        with torch.no_grad():
            for i in range(4):
                x = torch.randn(2, 4, device=DEV)
                a, b = g(x), ref(x)
                if not torch.equal(a, b):
                    ok, why = False, f"call {i}: output differs from eager"
                    break
                if g.log.shape != ref.log.shape or not torch.equal(g.log, ref.log):
                    ok, why = False, (f"call {i}: log {g.log.shape} {g.log[:8].tolist()} vs "
                                      f"eager {ref.log.shape} {ref.log[:8].tolist()}")
                    break
    except Exception as e:  # noqa: BLE001
        ok, why = False, f"raised {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    torch.cuda.synchronize()
    print(f"{'PASS' if ok else 'FAIL'} {name}: {why or 'equal to eager'}")


def main():
    run("I1 CUDA log tensor grown by resize_ on every call, 1 warm-up", DEV, 1)
    run("I2 (control) the same log on the host, 1 warm-up", torch.device("cpu"), 1)
    run("I3 (control) CUDA log, 3 warm-ups", DEV, 3)


if __name__ == "__main__":
    main()
