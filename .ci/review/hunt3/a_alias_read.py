"""An argument that shares memory with a parameter or buffer the forward reads, written in place
by the forward (finding F1 of tests/test_review_hunt3.py), against an eager twin.

Eager: ``x.mul_(2)`` writes the parameter's memory, which the forward reads next. A replay writes
the argument's static copy, reads the parameter as it was and copies the argument back after.
Checks (Linear 256 wide, no_grad, three plain calls first: warm-up, capture, replay):
  [finding] the argument is a row of ``lin.weight.detach()``: output as eager's;
  [finding] the argument is a buffer the forward reads (``model(model.state)``);
  [control] the weight row passed but not written (the forward only reads it).
Run from the repository root: python3 .ci/review/hunt3/a_alias_read.py
"""
import copy
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("a_alias_read.py")
import torch  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphify as cg  # noqa: E402

W = 256


class WritesInput(nn.Module):
    def __init__(self, write=True):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.register_buffer("state", torch.randn(W))
        self.write = write

    def forward(self, x):
        if self.write:
            x.mul_(2)
        return self.lin(self.state) + x.sum()


def case(label, name, alias, write=True):
    torch.manual_seed(0)
    ref = WritesInput(write).to(C.DEV).eval()
    g = cg.graphify(copy.deepcopy(ref))
    ok, why = True, ""
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(W, device=C.DEV)
            ok, why = C.same(g(x.clone()), ref(x.clone()))
            if not ok:
                why = "plain call: " + why
                break
        for i in range(3):
            if not ok:
                break
            got, want = g(alias(g)), ref(alias(ref))
            C.sync_all()
            ok, why = C.same(got, want)
            if ok and not (torch.equal(g.lin.weight, ref.lin.weight)
                           and torch.equal(g.state, ref.state)):
                ok, why = False, "parameters/buffers differ from eager's"
            if not ok:
                why = f"aliased call {i}: {why}"
    C.check(ok, f"[{label}] {name}", why + " " + C.stats_line(g))
    C.info(f"{name}: {C.stats_line(g)}")


if __name__ == "__main__":
    case("finding", "argument = a row of lin.weight.detach(), written by forward",
         lambda m: m.lin.weight.detach()[0])
    case("finding", "argument = the buffer forward reads, written by forward",
         lambda m: m.state)
    case("control", "argument = a row of lin.weight.detach(), only read",
         lambda m: m.lin.weight.detach()[0], write=False)
    C.finish("a_alias_read.py")
