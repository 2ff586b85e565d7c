"""Resize review, findings F1/F2 on a GPU: a kept tensor (plain attribute or buffer) grown in
place by a spelling the probe does not name as a resize.

F1 (plain attribute): ``torch.ops.aten.resize_`` (op_name 'torch.resize_', not in _RESIZES), an
``out=`` that grows it (``torch.cat(..., out=self.log)``), a resize through a view of it, and
``untyped_storage().resize_``: no RESIZES finding, so the capture's run grows the log again,
moving its storage into the graph's pool with the copy of the old bytes only recorded;
``_writes.kept`` puts the layout back (same storage, now in the pool) but not the device bytes.
Expected on the reviewed code: FAIL (log values differ from eager after call 0).
F2 (buffer): the same spellings on a registered buffer, and set_ / .data = / unsqueeze_ (older):
the capture's run changes it a second time and nothing puts a buffer's layout back.
Expected: FAIL (the log's shape is two calls ahead).
Controls (expected PASS): Tensor.resize_ on both (the change's RESIZES finding).
Each line: PASS/FAIL, the case, and how the graphified module ran (captures, replays, eager
reasons). Run on one GPU: ``python kept_paths.py``.
"""
import copy
import sys
import warnings

import torch
from torch import nn

if not torch.cuda.is_available():
    print("SKIP kept_paths: needs a CUDA GPU")
    sys.exit(0)

import cudagraphify as cg

DEV = torch.device("cuda")
D = 64
warnings.simplefilter("ignore")  # (CudagraphifyWarning, and cat out='s resize deprecation)


class Grows(nn.Module):
    def __init__(self, how, as_buffer):
        super().__init__()
        self.lin = nn.Linear(D, D, device=DEV)
        self.how = how
        if as_buffer:
            self.register_buffer("log", torch.zeros(0, device=DEV))
        else:
            self.log = torch.zeros(0, device=DEV)

    def forward(self, x):
        h = self.lin(x)
        n = self.log.numel()
        how = self.how
        if how == "Tensor.resize_":
            self.log.resize_(n + D)
        elif how == "aten.resize_":
            torch.ops.aten.resize_(self.log, [n + D])
        elif how == "cat out=":
            torch.cat([self.log.clone(), h[0]], out=self.log)
            return h
        elif how == "view alias resize_":
            flat = self.log.view(-1)
            flat.resize_(n + D)
            self.log.set_(flat)
        elif how == "untyped_storage().resize_":
            st = self.log.untyped_storage()
            st.resize_((n + D) * self.log.element_size())
            self.log.set_(st, 0, (n + D,), (1,))
        elif how == "set_":
            self.log.set_(torch.cat([self.log, h[0]]))
            return h
        elif how == ".data =":
            self.log.data = torch.cat([self.log, h[0]])
            return h
        self.log[n:].copy_(h[0])
        return h


def check(how, as_buffer, calls=5):
    torch.manual_seed(0)
    ref = Grows(how, as_buffer)
    g = cg.graphify(copy.deepcopy(ref))
    bad = ""
    try:
        with torch.no_grad():
            for i in range(calls):
                x = torch.randn(4, D, device=DEV)
                y, want = g(x), ref(x)
                torch.cuda.synchronize()
                if not torch.equal(y, want):
                    bad = f"output differs at call {i}"
                    break
                if g.log.shape != ref.log.shape:
                    bad = f"log {tuple(g.log.shape)} vs eager {tuple(ref.log.shape)} after call {i}"
                    break
                if not torch.equal(g.log, ref.log):
                    wrong = (g.log != ref.log).nonzero().flatten()
                    bad = (f"log values differ after call {i} ({wrong.numel()} of "
                           f"{ref.log.numel()}, first at {wrong[0].item()})")
                    break
    except Exception as e:  # noqa: BLE001
        bad = f"raised {type(e).__name__}: {str(e)[:160]}"
    s = cg.stats(g)
    how_ran = f"captures={s.captures} replays={s.replays} eager={list(s.eager_calls)[:1]}"
    kind = "buffer" if as_buffer else "plain attribute"
    print(f"{'FAIL' if bad else 'PASS'} {how} on a {kind}: {bad or 'equal to eager'} | {how_ran}")


for how in ["Tensor.resize_", "aten.resize_", "cat out=", "view alias resize_",
            "untyped_storage().resize_"]:
    check(how, as_buffer=False)
for how in ["Tensor.resize_", "aten.resize_", "cat out=", "set_", ".data ="]:
    check(how, as_buffer=True)
