"""waits review findings on CUDA. [finding] lines FAIL where the finding holds.
W1 waits() counts every event named _RANGE; Kineto reports each record_function range again on
   the GPU timeline (gpu_user_annotation, device_type CUDA, same name, GPU time stamps). The
   record syncs inside each member's range, so a wait between calls j-1 and j lands near 2j:
   past the segment's last call it is dropped, and the segment replays before the wait
   [silent wrong output].
W2 a wait inside a module answered whole is not made on replay (its Python does not run)
   [silent wrong output]."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import D, check, describe, prefetch_run, setup  # noqa: E402

setup("a_findings")
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402

from cudagraphify._segmodes import _RANGE, canary, waits  # noqa: E402

# W1, the profile itself: ranges as the record makes them (a kernel, then a sync inside), and
# a wait between ranges 3 and 4
x = torch.randn(1024, device="cuda")
ev = torch.cuda.Event()
ev.record()
prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                          torch.profiler.ProfilerActivity.CUDA])
with prof:
    canary(x.device)
    for i in range(7):
        if i == 4:
            torch.cuda.current_stream().wait_event(ev)
        with torch.profiler.record_function(_RANGE):
            y = x * 2
            bool((y == y).all())  # (the record's check of what a call wrote: a sync)
events = prof.events()
kinds = {}
for e in events:
    if e.name == _RANGE:
        kinds[str(e.device_type)] = kinds.get(str(e.device_type), 0) + 1
# (the profiler's own sync when it stops comes after the last range: index 7, which no segment's
# launch reads, _segrun.SegmentPlan._launch; seen on an H100: {4, 7})
got = {j for j in waits(events) or () if j < 7} if waits(events) is not None else None
check(got == {4}, f"[finding] W1 a wait between ranges 3 and 4 is placed before call 4 "
      f"(_RANGE events by device type: {kinds})", f"waits() gave {got}")




cpu = [e for e in events if not (e.name == _RANGE and e.device_type != DeviceType.CPU)]
got = {j for j in waits(cpu) or () if j < 7} if waits(cpu) is not None else None
check(got == {4}, "[control] W1 the same profile, the ranges' GPU twins left out: before call 4",
      f"waits() gave {got}")


class Late(nn.Module):
    """One segment of 7 calls (x its only copy: the launch without waits at call 0); the wait
    for ``w``'s write between calls 3 and 4 (call 4 reads w)."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.randn(D))
        self.w = nn.Parameter(torch.randn(D))
        self.ready = None

    def forward(self, x):
        h = (x * self.s).relu()  # 0, 1
        h = h * 2 + 1  # 2, 3
        torch.cuda.current_stream().wait_event(self.ready)
        o = h * self.w  # 4
        return o * o.abs().amax().item()  # 5, 6, 7 (item)


ok, why, g = prefetch_run(Late)
check(ok, f"[finding] W1 a wait between calls 3 and 4 of a 7-call segment: outputs as eager's "
      f"[{describe(g)}]", why)


class Early(Late):
    """The control: the wait between calls 1 and 2 (its twin-shifted place stays in the
    segment: a later launch, still after the wait)."""

    def forward(self, x):
        h = (x * self.s).relu()  # 0, 1
        torch.cuda.current_stream().wait_event(self.ready)
        h = h * self.w  # 2
        h = h * 2 + 1  # 3, 4
        return h * h.abs().amax().item()  # 5, 6, 7


ok, why, g = prefetch_run(Early)
check(ok, f"[control] W1 a wait between calls 1 and 2: outputs as eager's [{describe(g)}]", why)


# W2
class Waiting(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))
        self.ready = None

    def forward(self, h):
        a = h * 3
        torch.cuda.current_stream().wait_event(self.ready)
        return a * self.w


class Outer(nn.Module):
    outside = False

    def __init__(self):
        super().__init__()
        self.inner = Waiting()

    def forward(self, x):
        h = x * 2  # 0
        if self.outside:
            torch.cuda.current_stream().wait_event(self.inner.ready)
        h = self.inner(h)  # 1, 2: answered whole
        h = h + 1  # 3
        return h * h.sum().item()


class OuterWaits(Outer):
    outside = True


ok, why, g = prefetch_run(Outer)
check(ok, f"[finding] W2 a wait inside a module answered whole: outputs as eager's "
      f"[{describe(g)}]", why)
ok, why, g = prefetch_run(OuterWaits)
check(ok, f"[control] W2 the wait in the outer forward as well: outputs as eager's "
      f"[{describe(g)}]", why)
