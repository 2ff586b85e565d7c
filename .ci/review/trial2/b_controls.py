"""[control] lines of the trial2 review: outputs and gradients of fast-grad2's grad-mode paths
against eager's, on the GPU."""
from a_findings import Root, W, twins  # noqa: F401
from common import check, grads_equal, randn, stats, sync, torch, cg


def accumulate(micro):
    def run():
        ref, g = twins()
        og = torch.optim.SGD(g.parameters(), lr=1e-3)
        orf = torch.optim.SGD(ref.parameters(), lr=1e-3)
        for step in range(12):
            lg = lr = 0
            for _ in range(micro):
                x = randn(8, W)
                o, w = g(x), ref(x)
                if not torch.equal(o, w):
                    return f"step {step}: outputs differ ({(o - w).abs().max().item():.3g})"
                lg, lr = lg + o.mean(), lr + w.mean()
            lg.backward(), lr.backward()
            bad = grads_equal(ref, g)
            if bad:
                return f"step {step}: {bad}"
            og.step(), orf.step(), og.zero_grad(), orf.zero_grad()
        sync()
        return None
    return run


def bench_then_backward():
    ref, g = twins()
    kept = []
    for i in range(12):
        x = randn(8, W)
        o, w = g(x), ref(x)
        if not torch.equal(o, w):
            return f"call {i}: outputs differ"
        if i == 4:
            kept = [(o, w)]  # the bench's kept output: its graph waits
    o, w = kept[0]
    o.mean().backward(), w.mean().backward()
    bad = grads_equal(ref, g)
    return bad and f"{bad}; {stats(g)}"


for m in (2, 3, 4):
    check(f"[control] accumulation over {m} forwards: outputs and gradients equal eager's",
          accumulate(m))
check("[control] kept output's backward after the second graph replayed", bench_then_backward)
