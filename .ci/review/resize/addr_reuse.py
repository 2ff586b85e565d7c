"""Resize review, finding F6 (GPU only: the CPU allocator does not hand the freed block back):
a tensor the warm-up's guard does not hold (an attribute of an object a graphed function
closes over: held by identity only; likewise a helper's global) is neither 'kept' (RESIZES) nor,
when its resize lands on a block a temporary of the same call just freed, read 'from outside':
that address is in Probe.produced, so the memory counts as the run's own. The function is then
captured: the capture's run grows the tensor again (into the pool, its bytes not copied), and
replays grow nothing.

Expected on the reviewed code: FAIL where the caching allocator reuses the block (the line says
whether the first resize landed on the freed temporary's address). PASS with 'no reuse' means
the scenario did not arise on this machine. Run on one GPU: ``python addr_reuse.py``.
"""
import sys
import warnings

import torch

if not torch.cuda.is_available():
    print("SKIP addr_reuse: needs a CUDA GPU")
    sys.exit(0)

import cudagraphify as cg

DEV = torch.device("cuda")
warnings.simplefilter("ignore")


class Box:
    pass


def make(box, seen):
    def f(x):
        tmp = x * 3.0
        y = tmp + 1.0
        seen.append(tmp.data_ptr())
        del tmp  # (freed: its address stays in the probe's 'produced')
        n = box.t.numel()
        box.t.resize_(n + x.numel())
        seen.append(box.t.data_ptr())
        box.t[n:].copy_(y)
        return y
    return f


box, twin = Box(), Box()
box.t = torch.zeros(0, device=DEV)
twin.t = torch.zeros(0, device=DEV)
seen, seen_twin = [], []
g = cg.graphify(make(box, seen))
ref = make(twin, seen_twin)
bad = ""
torch.manual_seed(0)
for i in range(5):
    x = torch.randn(64, device=DEV)
    y, want = g(x), ref(x)
    torch.cuda.synchronize()
    if not torch.equal(y, want):
        bad = f"output differs at call {i}"
        break
    if box.t.shape != twin.t.shape:
        bad = f"tensor {tuple(box.t.shape)} vs eager {tuple(twin.t.shape)} after call {i}"
        break
    if not torch.equal(box.t, twin.t):
        bad = f"tensor values differ after call {i}"
        break
reuse = len(seen) >= 2 and seen[0] == seen[1]
s = cg.stats(g)
print(f"{'FAIL' if bad else 'PASS'} resize of an unheld tensor onto a freed temporary's block: "
      f"{bad or 'equal to eager'} | first resize {'reused' if reuse else 'did not reuse (no reuse)'}"
      f" the temporary's address | captures={s.captures} replays={s.replays} "
      f"eager={list(s.eager_calls)[:1]}")
