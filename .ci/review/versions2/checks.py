"""Review of fix-versions (cudagraphify/_versions.py) on CUDA, against eager twins (see
tests/test_review_versions2.py for the CPU tests of the same cases). [finding] lines FAIL on the
reviewed code, [control] lines PASS."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../inflight2"))
from common import DEV, cg, check, nn, outcome, randn, torch, twins  # noqa: E402


def _get(m, path):
    for part in path.split("."):
        m = getattr(m, part)
    return m


def _align(ref, g, *names):
    for n in names:
        torch._C._autograd._unsafe_set_version_counter((_get(g, n),), (_get(ref, n)._version,))


def _between(ref, g, write, steps=3):
    """Forward, ``write(m)``, backward: None, or where eager's and the graph's outcomes differ."""
    for s in range(steps):
        x = randn(8)
        seen = []
        for m in (ref, g):
            def go(m=m):
                out = m(x).sum()
                write(m)
                out.backward()
            seen.append(outcome(go))
            m.zero_grad()
        if seen[0] != seen[1]:
            return f"step {s}: eager {seen[0]}, graphed {seen[1]}"
    if cg.stats(g).replays < 2:
        return f"only {cg.stats(g).replays} replays"
    return None


class SharedView(nn.Module):
    """Forward reads ``b`` (saved); ``v`` is a buffer registered as a view of ``b``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("b", torch.ones(16, device=DEV))  # (on the device: a real view)
        self.register_buffer("v", self.b[:])

    def forward(self, x):
        return self.lin(x) * self.b


def _unshare(m):
    m.v = m.b.data


def _write_v(m):
    with torch.no_grad():
        m.v.add_(1)


class Twin(nn.Module):
    """``a`` and ``c = a.data``: one memory and layout, two counters; forward writes and saves a."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("a", torch.ones(16, device=DEV))
        self.register_buffer("c", self.a.data)

    def forward(self, x):
        self.a.mul_(0.5)
        return self.lin(x) * self.a


def _reregister(m):
    t = m.a
    del m.a
    m.register_buffer("a", t)


def _write_a(m):
    with torch.no_grad():
        m.a.add_(1)


def finding_rebound_view():
    ref, g = twins(SharedView, prep=_unshare)
    # (the rebinding drops the graph: one eager call, one capture, then replays)
    return _between(ref, g, _write_v, steps=5)


def control_view():
    ref, g = twins(SharedView)
    return _between(ref, g, _write_v)


def finding_reordered_raise():
    ref, g = twins(Twin, warm=(8, 8), prep=_reregister)
    return _between(ref, g, _write_a)


def finding_reordered_versions():
    ref, g = twins(Twin, warm=())
    _align(ref, g, "a", "c")
    for s in range(6):
        if s == 3:
            _reregister(ref), _reregister(g)
        x = randn(8)
        with torch.no_grad():
            if not torch.equal(ref(x), g(x)):
                return f"step {s}: outputs differ"
        e, v = (ref.a._version, ref.c._version), (g.a._version, g.c._version)
        if e != v:
            return f"step {s}: versions (a, c) eager {e}, graphed {v}"
    return None


def control_twin():
    ref, g = twins(Twin, warm=(8, 8))
    return _between(ref, g, _write_a)


class WriteAfter(nn.Module):
    """Writes the buffer after autograd saved it: eager's backward always raises."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("s", torch.ones(16))

    def forward(self, x):
        y = self.lin(x) * self.s
        self.s.mul_(0.5)
        return y


def control_write_after_save():
    ref, g = twins(WriteAfter, warm=())
    for s in range(4):
        x = randn(8)
        seen = [outcome(lambda m=m: m(x).sum().backward()) for m in (ref, g)]
        if seen[0] != seen[1]:
            return f"step {s}: eager {seen[0]}, graphed {seen[1]}"
    return None


check("[finding] a view buffer rebound to .data (own counter), then written between forward "
      "and backward: no raise, as eager", finding_rebound_view)
check("[control] the view buffer not rebound, written between forward and backward: raises "
      "as eager", control_view)
check("[finding] alias buffers reordered (del + register_buffer), the saved one written between "
      "forward and backward: raises as eager", finding_reordered_raise)
check("[finding] alias buffers reordered: no_grad replays move a's counter as eager (not c's)",
      finding_reordered_versions)
check("[control] alias buffers not reordered: a write between forward and backward raises",
      control_twin)
check("[control] a buffer written after autograd saved it: every backward raises as eager",
      control_write_after_save)
