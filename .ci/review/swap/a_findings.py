"""[finding] lines of the swap review (tests/test_review_swap.py S1, S2, S2b). PASS means the
finding did not reproduce; on the reviewed code (74edaf2) each is expected to FAIL on a GPU.
S1 needs share_graph's driver-level graph reading (CUDA 12.4+): under REVIEW_SIM=1 sharing is
refused (the double cannot read graphs) and S1 PASSes there, which says nothing."""
import copy

from common import DEV, SIM, check, cg, nn, randn, stats, sync, torch, twins


# -- S1: share_graph layers that swap a tensor on every call ---------------------------------

class Layer(nn.Module):
    """Keeps its latest output in ``box["t"]`` (one dict for the whole stack) by swapping."""

    def __init__(self, box):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.box = box

    def forward(self, x):
        h = self.lin(x)
        torch.utils.swap_tensors(self.box["t"], h.detach().clone())
        return torch.relu(h)


def s1():
    torch.manual_seed(0)
    box_r = {"t": torch.zeros(4, 16, device=DEV)}
    ref = nn.ModuleList([Layer(box_r) for _ in range(4)]).to(DEV)
    g = copy.deepcopy(ref)
    box_g = {"t": torch.zeros(4, 16, device=DEV)}
    for m in g:
        m.box = box_g
    group = cg.share_graph(g)
    with torch.no_grad():
        for i in range(5):
            x = randn(4, 16)
            a = b = x
            for m in ref:
                a = m(a)
            for m in g:
                b = m(b)
            sync()
            if not torch.equal(a, b):
                return f"call {i}: outputs differ; {stats(g[0])}"
            if not torch.equal(box_r["t"], box_g["t"]):
                s = group.stats()
                return (f"call {i}: the swapped tensor is not eager's (max diff "
                        f"{(box_r['t'] - box_g['t']).abs().max().item():.3g}); share captures="
                        f"{s.captures} per_layer={s.per_layer} reasons={dict(s.reasons)}; "
                        f"{stats(g[0])}")
    s = group.stats()  # (a PASS where sharing was refused says nothing: see these)
    print(f"INFO S1 share_graph: captures={s.captures} per_layer={s.per_layer} "
          f"reasons={dict(s.reasons)}; layer 0: {stats(g[0])}", flush=True)
    return None


check("[finding S1] share_graph layers that swap a tensor (box['t']) on every call: the "
      "swapped tensor after each call is eager's", s1)


# -- S2: a later run writes a tensor in place, then swaps it ---------------------------------

class BumpSwapSave(nn.Module):
    def __init__(self, buf=True):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        if buf:
            self.register_buffer("count", torch.zeros(16))
        else:
            self.count = torch.zeros(16)

    def forward(self, x):
        h = self.lin(x)
        self.count.add_(1)
        torch.utils.swap_tensors(self.count, self.count.clone())
        return h * self.count.detach()


def s2(buf, probe):
    def go():
        ref, g = twins(lambda: BumpSwapSave(buf), probe=probe)
        if not buf:
            ref.count, g.count = ref.count.to(DEV), g.count.to(DEV)
        for i in range(3):
            x = randn(4, 16)
            a = ref(x)
            a.sum().backward()
            b = g(x)
            try:
                b.sum().backward()
            except RuntimeError as e:
                return f"call {i}: the user's backward raised {str(e)[:160]!r}; {stats(g)}"
            sync()
            if not torch.equal(a, b) or not torch.equal(ref.count, g.count):
                return f"call {i}: values differ; {stats(g)}"
        return None
    return go


for buf, probe in ((True, "auto"), (True, False), (False, False)):
    what = "buffer" if buf else "plain attribute"
    check(f"[finding S2] training: a {what} written in place then swapped on every call, its "
          f"value saved through detach() (probe={probe}): the user's backward runs", s2(buf, probe))


def s2b(probe):
    def go():
        ref, g = twins(BumpSwapSave, probe=probe, num_warmup_iters=2)
        x = randn(4, 16)
        with torch.no_grad():
            a, b = ref(x), g(x)
        sync()
        if not torch.equal(a, b) or not torch.equal(ref.count, g.count):
            return f"values differ; {stats(g)}"
        if g.count._version != ref.count._version:
            return f"buffer version {g.count._version}, eager's {ref.count._version}; {stats(g)}"
        return None
    return go


for probe in ("auto", False):
    check(f"[finding S2b] inference, num_warmup_iters=2: a buffer written in place then swapped "
          f"(probe={probe}): its version after the first call is eager's", s2b(probe))
