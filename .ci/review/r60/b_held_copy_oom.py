"""r60 finding B (crash, aa9f958 + da0d8f1): every capture clones the whole storage of every
tensor the forward reads from outside its arguments, parameters and buffers (a plain tensor
attribute), read-only ones included (cudagraphify/_capturing.py: ``capture``, via
``_writes.undone``). A large table kept as a plain attribute, on a GPU without room for a
second copy of it, makes that clone raise torch.OutOfMemoryError out of ``Capturing.capture``
(outside its try): the user's first call raises although its real call ran.

Expected on the reviewed code: B1 FAIL (the call raises), B2 FAIL (peak memory of the first
call holds a second copy of the table). Run on one GPU: ``python b_held_copy_oom.py``.
"""
import gc

import torch
from torch import nn

import cudagraphify as cg

DEV = torch.device("cuda")


class Table(nn.Module):
    """Reads a slice of a large read-only table kept as a plain attribute (not a buffer)."""

    def __init__(self, numel: int):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.table = torch.ones(numel, device=DEV)  # (plain attribute: a "held" tensor)

    def forward(self, x):
        return self.lin(x) + self.table[:64]


def main():
    torch.manual_seed(0)
    free, _ = torch.cuda.mem_get_info(DEV)
    # B1: the table takes 60% of the free memory: a second copy cannot fit
    numel = int(free * 0.6) // 4
    m = Table(numel).to(DEV)
    xs = [torch.randn(8, 64, device=DEV) for _ in range(3)]
    with torch.no_grad():
        want = [m(x).clone() for x in xs]  # eager (the forward writes nothing)
    cg.graphify(m)
    ok, why = True, ""
    try:
        with torch.no_grad():
            for i, x in enumerate(xs):
                got = m(x)
                if not torch.equal(got, want[i]):
                    ok, why = False, f"call {i} differs from eager"
                    break
    except Exception as e:  # noqa: BLE001
        ok, why = False, f"call raised {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    print(f"{'PASS' if ok else 'FAIL'} B1 large held table, first call: {why or 'equal to eager'}")
    del m, want
    gc.collect()
    torch.cuda.empty_cache()

    # B2: a smaller table (10% of the free memory): the first call's peak holds two copies
    free, _ = torch.cuda.mem_get_info(DEV)
    numel = int(free * 0.1) // 4
    m = Table(numel).to(DEV)
    x = torch.randn(8, 64, device=DEV)
    with torch.no_grad():
        want = m(x).clone()
    cg.graphify(m)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(DEV)
    torch.cuda.reset_peak_memory_stats(DEV)
    with torch.no_grad():
        got = m(x)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated(DEV) - base
    table = numel * 4
    equal = torch.equal(got, want)
    ok = equal and extra < table // 2
    print(f"{'PASS' if ok else 'FAIL'} B2 first call's extra peak {extra / 2**20:.1f} MiB for a "
          f"{table / 2**20:.1f} MiB read-only held table (equal to eager: {equal})")


if __name__ == "__main__":
    main()
