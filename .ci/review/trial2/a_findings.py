"""[finding] lines of the trial2 review (tests/test_review_trial2.py W1, W3). PASS means the
finding did not reproduce on this GPU. W1 here asks whether a real GPU makes the one-pair verdict
differ from the full trial's (the CPU test forces a cold first eager sample); INFO lines give
the samples."""
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


def w1():
    """Full trials (a backward every step, no early verdict), every sample logged: for each
    trial, the verdict on its first pair against the verdict on all of it."""
    logs = []
    init, timed = _trial.Trial.__init__, _trial.Trial.timed

    def init2(self, clock):
        init(self, clock)
        logs.append(self)
    settle = _engine._settle_waiting_trials
    _trial.Trial.__init__ = init2
    _engine._settle_waiting_trials = lambda busy: None
    try:
        ref, g = twins()
        for _ in range(20):
            g(randn(8, W)).mean().backward()
        sync()
    finally:
        _trial.Trial.__init__ = init
        _engine._settle_waiting_trials = settle
    differ = []
    for t in logs:
        if not t.done:
            continue
        one = _trial.Trial.__new__(_trial.Trial)
        one.graph, one.eager = t.graph[:1], t.eager[:1]
        one.graph_host, one.eager_host = t.graph_host[:1], t.eager_host[:1]
        early, full = one.verdict(), t.verdict()
        print(f"INFO W1 graph={[round(v * 1e6, 1) for v in t.graph]} "
              f"eager={[round(v * 1e6, 1) for v in t.eager]} µs: one pair "
              f"{'keep' if early is None else 'give back'}, full "
              f"{'keep' if full is None else 'give back'}")
        if early is None and full is not None:
            differ.append((t.graph, t.eager))
    if not logs:
        return None if SIM else "no trial ran (no clock?)"
    if differ:
        return (f"{len(differ)} of {len(logs)} trials: kept on their first pair, given back on "
                "the full trial (b6cc670 keeps these for good)")
    return None


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
    check("[finding W1] a keep on one pair of samples agrees with the full trial", w1)
    check("[finding W3] a kept output's backward after another signature's capture "
          "(max_graphs=2)", w3)
