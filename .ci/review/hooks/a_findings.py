"""[finding] lines of the hooks review (tests/test_review_hooks.py H1, H2). PASS means the finding
did not reproduce. Expected since the H1 fix (REVIEW_SIM=1 too): PASS for H1 (an inference-tensor
global rebound by set_ under inference_mode on a later path; Probe.note_layouts skipped inference
tensors), FAIL for H2 (a global rebound by torch.utils.swap_tensors on a later path: open)."""
from common import DEV, check, nn, randn, stats, sync, torch, twins

_G = {}


class LaterRebind(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.how, self.ready = how, False

    def forward(self, x):
        h = self.lin(x)
        if self.ready:
            t = _G[id(self)]
            if self.how == "inference set_":
                t.set_(_G[id(self), "o"])
            else:
                torch.utils.swap_tensors(t, torch.cat([h[0], h[1]]).detach())
        self.ready = True
        return h


def rebind(how, mode, **kw):
    def go():
        ref, g = twins(lambda: LaterRebind(how), num_warmup_iters=2, **kw)
        for m in (ref, g):
            if how == "inference set_":
                with torch.inference_mode():
                    _G[id(m)] = torch.zeros(4, device=DEV)
                    _G[id(m), "o"] = torch.ones(4, device=DEV)
            else:
                _G[id(m)] = torch.zeros(4, device=DEV)
        x = randn(3, 4)
        ctx = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad,
               "grad": torch.enable_grad}[mode]
        with ctx():
            a, b = ref(x), g(x)
        sync()
        A, B = _G[id(ref)], _G[id(g)]
        if not torch.equal(a, b):
            return f"outputs differ; {stats(g)}"
        if B.shape != A.shape or not torch.equal(B, A):
            return (f"after the first call the global is {tuple(B.shape)} {B.tolist()}, eager's "
                    f"{tuple(A.shape)} {A.tolist()}; {stats(g)}")
        return None
    return go


check("[finding H1] an inference-tensor global rebound by set_ under inference_mode on a later "
      "path: after the first call", rebind("inference set_", "inference_mode"))
for probe in ("auto", False):
    for mode in ("no_grad", "grad"):
        check(f"[finding H2] a global rebound by swap_tensors on a later path (probe={probe}, "
              f"{mode}): after the first call", rebind("swap_tensors", mode, probe=probe))
