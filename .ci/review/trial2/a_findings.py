"""[finding] lines of the trial2 review (tests/test_review_trial2.py W3: a training graph waiting
for its backward evicted by a later capture). PASS means the finding did not reproduce on this
GPU. (Its W1 scenario, about the early keep verdict withdrawn after the GPU run, went with it.)"""
from common import DEV, SIM, check, cg, nn, randn, sync, torch
from cudagraphify import _engine, _trial

W = 512


class Root(nn.Module):
    """A host sync between pieces: piecewise; its Linear / LayerNorm / GELU are pieces."""

    def __init__(self, n=6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(W), nn.Linear(W, W), nn.GELU())
                                    for _ in range(n))

    def forward(self, x):
        for m in self.layers:
            x = x + m(x)
            if bool((x > -1e9).all()):  # a host sync
                x = x * 1.0
        return x


def twins(**kw):
    torch.manual_seed(0)
    ref = Root().to(DEV)
    torch.manual_seed(0)
    return ref, cg.graphify(Root().to(DEV), **kw)


def w3():
    ref, g = twins(max_graphs=2)
    kept, want = [], []

    def call(rows, keep=False, back=False):
        x = randn(rows, W)
        o, w = g(x), ref(x)
        if keep:
            kept.append(o), want.append(w)
        if back:
            o.sum().backward(), w.sum().backward()
    for _ in range(4):
        call(8)
    call(8, keep=True), call(8, keep=True), call(4, keep=True), call(4, keep=True)
    sum(o.sum() for o in kept).backward()  # raises where a pending graph was evicted
    return None


if __name__ == "__main__":
    check("[finding W3] a kept output's backward after another signature's capture "
          "(max_graphs=2)", w3)
