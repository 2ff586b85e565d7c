"""FINDING F1 on a GPU with the default factory rule: a module whose path while captured adds 1
to row 1 of its buffer ``table`` at sizes up to 2 (a scratch tensor's at the others), through
``torch.as_tensor`` of an object exposing that row's ``__cuda_array_interface__`` (torch calls
only; the alias has a storage and version counter of its own). Without lending, sizes 2 and 1
are rehearsed, the buffer write is seen by value, they run piecewise: eager results. Lent, their
captures confirm the rehearsal, their graphs are kept and every replay writes table[1].
(DEV=cpu: the DLPack twin with the CROSS_DEVICE tag of that one call dropped, as
tests/test_review_sizes_rehearse.py does.)"""
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CPU, DEV, check, info, lending, trusting  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphify as cg  # noqa: E402

SIZES = [4, 3, 2, 1]


class Iface:
    def __init__(self, t):
        if CPU:
            self.capsule = torch.utils.dlpack.to_dlpack(t)
        else:
            self.__cuda_array_interface__ = t.__cuda_array_interface__

    def __dlpack__(self, **kw):
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)


class CpuTwin(cg.OpPolicy):
    TRUSTED_CAPTURED_PATHS = ("__main__",)

    def tags(self, func, args=(), kwargs=None, **kw):
        tags = super().tags(func, args, kwargs, **kw)
        if func is torch.as_tensor and args and isinstance(args[0], Iface):
            tags = frozenset(tags) - {"CROSS_DEVICE"}
        return tags


class AliasWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("table", torch.full((2, 4), 3.0))

    def forward(self, x):
        y = self.lin(x)
        if not torch.cuda.is_current_stream_capturing() and bool((y > -1e9).all()):
            return y
        scratch = torch.zeros(2, 4, device=x.device)
        src = self.table if x.shape[0] <= 2 else scratch
        torch.as_tensor(Iface(src[1])).add_(1)
        return torch.where(y > -1e9, y, torch.zeros_like(y))


def one(on):
    torch.manual_seed(0)
    model = AliasWrite().to(DEV)
    ref = copy.deepcopy(model)
    g = cg.graphify(model, max_graphs=16,
                    op_policy=CpuTwin() if CPU else trusting("__main__"))
    made = []

    def inputs(b):
        made.append(torch.randn(b, 4, device=DEV))
        return (made[-1].clone(),)

    with torch.no_grad(), lending(on) as n:
        done = cg.capture_sizes(g, inputs, SIZES, progress=False)
        for x in made:
            ref(x.clone())
        same = True
        for b in [1, 2, 3, 4] * 2:
            x = torch.randn(b, 4, device=DEV)
            same &= bool(torch.equal(g(x.clone()), ref(x.clone())))
    if not CPU:
        torch.cuda.synchronize()
    return done, len(n), same, model.table[1].tolist(), ref.table[1].tolist()


if __name__ == "__main__":
    for on, tag in ((False, "[control]"), (True, "[finding] F1")):
        label = "lending on" if on else "lending off"
        try:
            done, reh, same, got, want = one(on)
        except Exception as e:  # noqa: BLE001
            check(False, f"{tag} alias write, {label}", f"{type(e).__name__}: {str(e)[:300]}")
            continue
        info(f"alias write {label}: graphed {done.graphed}, eager {sorted(done.eager)}, "
             f"rehearsals {reh}")
        check(same and got == want, f"{tag} alias write, {label}: outputs and table[1] as eager",
              f"table[1] {got} vs eager {want}")
