"""[finding] a backward hook writing a host (CPU) tensor and a CUDA global during the capture's
backward: not put back (value of the CPU one, version of the CUDA one). [control] forward-time
writes of the same tensors. Prints PASS/FAIL lines. (Unverified on GPU by the reviewer.)"""
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


check("[finding] backward hook writes during the capture's run, after the first forward", True)
check("[control] no hook", False)
