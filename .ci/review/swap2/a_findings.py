"""[finding] lines of the second swap review (tests/test_review_swap2.py F1, F2, F4). PASS means
the finding did not reproduce; on the reviewed code (a95d120) each is expected to FAIL on a GPU.
On a GPU, torch.cuda.is_current_stream_capturing() answers "yes" inside the real capture (and
inside a rehearsal, which the probe makes answer so); under REVIEW_SIM=1 it is patched to the
double's capturing flag."""
from common import DEV, SIM, check, cg, nn, randn, stats, sync, torch, twins

if SIM:
    from cudagraphify import _capture
    _backend = _capture.default_backend()
    torch.cuda.is_current_stream_capturing = lambda: _backend.capturing

_G = {}


# -- F1: a tensor swapped on the captured path only, left aliasing the other ----------------

class CapturedPathSwaps(nn.Module):
    def __init__(self, write):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.write = write
        _G[id(self)] = (torch.zeros(16, device=DEV), torch.ones(16, device=DEV))

    def forward(self, x):
        y = self.lin(x)
        if torch.cuda.is_current_stream_capturing():
            g1, g2 = _G[id(self)]
            torch.utils.swap_tensors(g1, g2)
            if self.write:
                g1.add_(1)
            y = y + g1 * 0
        return y


def f1(write):
    def run():
        m = cg.graphify(CapturedPathSwaps(write).to(DEV))
        g1, g2 = _G[id(m)]
        p1, p2 = g1.data_ptr(), g2.data_ptr()
        with torch.no_grad():
            m(randn(4, 16))
        sync()
        if (g1.data_ptr(), g2.data_ptr()) != (p1, p2):
            return f"g1 now views g2's memory (g1[0]={g1[0].item()}); {stats(m)}"
        if not (torch.equal(g1, torch.zeros_like(g1)) and torch.equal(g2, torch.ones_like(g2))):
            return f"values changed: g1[0]={g1[0].item()} g2[0]={g2[0].item()}; {stats(m)}"
        if (g1._version, g2._version) != (0, 0):
            return f"versions moved: {(g1._version, g2._version)}; {stats(m)}"
        return None
    return run


for w in (False, True):
    check(f"[finding F1] write={w}: globals swapped only on the captured path are left as eager "
          "leaves them (own memory, values, versions)", f1(w))


# -- F2: the rehearsal's versions -----------------------------------------------------------

class PingPong(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.a, self.b = torch.zeros(16, device=DEV), torch.ones(16, device=DEV)

    def forward(self, x):
        y = self.lin(x)
        if not torch.cuda.is_current_stream_capturing():
            if bool((y > -1e9).all()):
                pass
        torch.utils.swap_tensors(self.a, self.b)
        self.a.add_(1)
        return y * self.a


def f2():
    policy = cg.OpPolicy()
    policy.TRUSTED_CAPTURED_PATHS = (__name__,)
    ref, g = twins(PingPong, op_policy=policy)
    ref.a, ref.b = ref.a.to(DEV), ref.b.to(DEV)
    g.a, g.b = g.a.to(DEV), g.b.to(DEV)
    for i in range(3):
        x = randn(4, 16)
        with torch.no_grad():
            want, got = ref(x), g(x)
        sync()
        if not (torch.equal(want, got) and torch.equal(ref.a, g.a)):
            return f"call {i}: values differ; {stats(g)}"
        if (g.a._version, g.b._version) != (ref.a._version, ref.b._version):
            return (f"call {i}: versions {(g.a._version, g.b._version)}, eager "
                    f"{(ref.a._version, ref.b._version)}; {stats(g)}")
    return None


check("[finding F2] ping-pong of plain attributes with a trusted rehearsal: versions as eager's",
      f2)


# -- F4: bucketed's padded runs ---------------------------------------------------------------

class SwapsBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        _G[id(self)] = torch.zeros(1, device=DEV)

    def forward(self, x):
        torch.utils.swap_tensors(_G[id(self)], torch.full((1,), float(x.shape[0]), device=DEV))
        return self.lin(x)


def f4():
    ref, g = twins(SwapsBatch)
    b = cg.bucketed(g, [8])
    with torch.no_grad():
        for i in range(2):
            x = randn(5, 16)
            out, want = b(x), ref(x)
            sync()
            if not torch.allclose(out, want):
                return f"call {i}: outputs differ"
            if _G[id(g)].item() != _G[id(ref)].item():
                return f"call {i}: global holds {_G[id(g)].item()}, eager {_G[id(ref)].item()}"
    return None


check("[finding F4] bucketed: the swaps of the padded check runs are not left behind", f4)
