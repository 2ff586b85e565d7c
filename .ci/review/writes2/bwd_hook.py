"""[finding] a backward hook writing a host (CPU) tensor and a CUDA global during the capture's
backward: not put back (value of the CPU one, version of the CUDA one). [control] forward-time
writes of the same tensors. Prints PASS/FAIL lines. (Unverified on GPU by the reviewer.)

Fixed on fix-writes3 (Capturing._watch_backward): put back, and the signature's graph refused
(a replay of the backward graph runs no Python: the host tensor's write would be lost); every
line should PASS, [replays] too: later calls with their backwards equal to eager's."""
import warnings
import torch
from torch import nn
import cudagraphify as cg

warnings.simplefilter("ignore")
dev = "cuda"


class M(nn.Module):
    def __init__(self, in_backward):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.host = torch.zeros(())          # a host tensor
        self.dglob = torch.zeros((), device=dev)  # a device tensor outside the state
        self.in_backward = in_backward

    def forward(self, x):
        h = self.lin(x)
        if self.in_backward and h.requires_grad:
            def hook(g):
                with torch.no_grad():
                    self.host.add_(1)
                    self.dglob.add_(1)
            h.register_hook(hook)
        return h * 2


def check(tag, in_backward):
    torch.manual_seed(0); ref = M(in_backward).to(dev)
    torch.manual_seed(0); g = cg.graphify(M(in_backward).to(dev))
    x = torch.randn(3, 4, device=dev)
    ref(x); g(x)
    torch.cuda.synchronize()
    ok = torch.equal(ref.host, g.host) and ref.dglob._version == g.dglob._version \
        and torch.equal(ref.dglob, g.dglob)
    print(f"{'PASS' if ok else 'FAIL'} {tag} host {ref.host.item()} vs {g.host.item()}, "
          f"dglob version {ref.dglob._version} vs {g.dglob._version} captures={cg.stats(g).captures}")


def replays(tag, in_backward):
    torch.manual_seed(0); ref = M(in_backward).to(dev)
    torch.manual_seed(0); g = cg.graphify(M(in_backward).to(dev))
    ok = True
    for _ in range(4):
        x = torch.randn(3, 4, device=dev)
        a, b = ref(x), g(x)
        a.sum().backward(); b.sum().backward()
        torch.cuda.synchronize()
        ok &= torch.equal(a, b) and torch.equal(ref.host, g.host) \
            and torch.equal(ref.dglob, g.dglob) and ref.dglob._version == g.dglob._version \
            and ref.host._version == g.host._version \
            and all(torch.equal(p.grad, q.grad) for p, q in zip(ref.parameters(), g.parameters()))
    print(f"{'PASS' if ok else 'FAIL'} {tag} host {ref.host.item()} vs {g.host.item()}, "
          f"dglob {ref.dglob.item()} vs {g.dglob.item()}, eager={dict(cg.stats(g).eager_calls)}")


check("[finding] backward hook writes during the capture's run, after the first forward", True)
check("[control] no hook", False)
replays("[replays] four calls with backward (the hook's)", True)
