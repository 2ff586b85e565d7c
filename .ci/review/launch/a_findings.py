"""launch review findings on CUDA. [finding] lines FAIL where the finding holds.
F1 a guard check's own torch call (t.data_ptr() of a plain tensor attribute) replays the pending
   segment before y is copied in; _Run.entered keeps the segment matched and nothing replays it
   again: outputs from the previous call's y [silent wrong output].
F2 the graph reads a parameter at the launch call, before a wait_event the forward makes (the
   parameter written on another stream): eager waits, the graph does not [silent wrong output].
   DEV=cpu: emulated by a write no mode sees (the double models no streams)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (D, DEV, Attr, check, compare, describe, graphed, setup,  # noqa: E402
                    xy)

setup("a_findings")
import torch  # noqa: E402
from torch import nn  # noqa: E402

# F1
for name, t in [("a 1000-element tensor on the device", torch.zeros(1000, device=DEV)),
                ("a CPU scalar tensor", torch.tensor(0.5))]:
    torch.manual_seed(0)
    m = Attr(t).to(DEV).eval()
    m.t = t  # (.to() leaves a plain attribute where it is)
    g = graphed(m)
    ok, why = compare(m, g, xy(6))
    check(ok, f"[finding] F1 plain tensor attribute ({name}) read by the forward, modules "
          f"answered whole before the launch: outputs as eager's [{describe(g)}]", why)


# F2
PENDING = [None]  # (DEV=cpu: the value the unseen write lands; a global, no guard reads it)


class Prefetch(nn.Module):
    """``w`` is written on another stream before each call (a prefetch); the forward waits for
    that write (``wait_event``: no mode sees it) after the launch call (``x * s``, its only copy)
    and before the member that reads ``w``."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.randn(D))
        self.w = nn.Parameter(torch.randn(D))
        self.ready = None

    def forward(self, x):
        h = (x * self.s).relu()  # launch
        h = h * 2 + 1
        if DEV == "cpu":  # (the double: the write lands here, unseen)
            with torch._C.DisableTorchFunction():
                self.w.copy_(PENDING[0])
        else:
            torch.cuda.current_stream().wait_event(self.ready)
        o = h * self.w  # reads w after the wait
        return o * o.abs().amax().item()


class PrefetchEarly(Prefetch):
    """The control: the same wait before the launch call."""

    def forward(self, x):
        if DEV == "cpu":
            with torch._C.DisableTorchFunction():
                self.w.copy_(PENDING[0])
        else:
            torch.cuda.current_stream().wait_event(self.ready)
        h = (x * self.s).relu()
        h = h * 2 + 1
        o = h * self.w
        return o * o.abs().amax().item()


def prefetch_run(cls, calls=6):
    torch.manual_seed(0)
    m = cls().to(DEV).eval()
    g = graphed(m)
    ws = [torch.randn(D, device=DEV) for _ in range(calls)]
    xs = [torch.randn(4, D, device=DEV) for _ in range(calls)]
    side = torch.cuda.Stream() if DEV != "cpu" else None
    outs = {}
    for model, key in ((g, "graphed"), (m, "eager")):
        if side is not None:
            model.ready = torch.cuda.Event()
        got = []
        with torch.no_grad():
            for k in range(calls):
                if side is not None:
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        torch.cuda._sleep(100_000_000)  # (~60 ms: the write lands late)
                        model.w.copy_(ws[k])
                        model.ready.record(side)
                else:
                    PENDING[0] = ws[k]
                got.append(model(xs[k]))
        outs[key] = got
    bad = [k for k, (a, b) in enumerate(zip(outs["graphed"], outs["eager"]))
           if not torch.equal(a, b)]
    return not bad, f"calls {bad} differ from eager", g


ok, why, g = prefetch_run(Prefetch)
check(ok, "[finding] F2 parameter written on another stream, waited for (wait_event) after "
      f"the launch call and before its reader: outputs as eager's [{describe(g)}]", why)
ok, why, g = prefetch_run(PrefetchEarly)
check(ok, "[control] F2 the same wait before the launch call: outputs as eager's "
      f"[{describe(g)}]", why)
