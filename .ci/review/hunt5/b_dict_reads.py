"""Attributes a forward reads through ``self.__dict__`` (finding F2 of
tests/test_review_hunt5.py), against an eager twin.

F2: ``self.__dict__.get("scale", 1.0)`` / ``vars(self)["scale"]`` in forward: the read is not
recorded, so ``m.scale = 0.25`` (an ordinary setattr) finds no guard reading ``scale`` and the
graph captured with the old scale (a kernel scalar) replays.
Checks (Linear 256 wide, no_grad, the change after three calls: warm-up, capture, replay):
  [finding] self.__dict__.get("scale");
  [finding] vars(self)["scale"];
  [control] getattr(self, "scale", 1.0).
Run from the repository root: python3 .ci/review/hunt5/b_dict_reads.py
"""
import copy
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("b_dict_reads.py")
import torch  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphify as cg  # noqa: E402

W = 256


class DictRead(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.scale = 1.0
        self.how = how

    def forward(self, x):
        if self.how == "dict_get":
            s = self.__dict__.get("scale", 1.0)
        elif self.how == "vars":
            s = vars(self)["scale"]
        else:
            s = getattr(self, "scale", 1.0)
        return self.lin(x) * s


def case(label, name, how):
    torch.manual_seed(0)
    ref = DictRead(how).to(C.DEV)
    g = cg.graphify(copy.deepcopy(ref))
    ok, why = True, ""
    with torch.no_grad():
        for i in range(6):
            if i == 3:
                g.scale = ref.scale = 0.25
            x = torch.randn(8, W, device=C.DEV)
            got, want = g(x), ref(x)
            C.sync_all()
            ok, why = C.same(got, want)
            if not ok:
                why = f"call {i}: {why}"
                break
    C.check(ok, f"[{label}] {name}", why + " " + C.stats_line(g))
    C.info(f"{name}: {C.stats_line(g)}")


if __name__ == "__main__":
    case("finding", 'forward reads self.__dict__.get("scale"), then m.scale = 0.25', "dict_get")
    case("finding", 'forward reads vars(self)["scale"], then m.scale = 0.25', "vars")
    case("control", 'forward reads getattr(self, "scale", 1.0), then m.scale = 0.25', "getattr")
    C.finish("b_dict_reads.py")
