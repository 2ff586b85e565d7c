"""Fix-7 review on CUDA: findings S1 (rebased family, requires_grad), S2 (an argument's
requires_grad under no_grad), S3 (a registry shared by copy.copy), L1 (first call inside a
named_parameters() loop), L2 (explain before the first call), and controls beside them.
CPU reproductions: tests/test_review_fix7.py."""
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CPU, DEV, check, finish, info, same, skip_without_cuda, stats_line, \
    sync_all  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

skip_without_cuda("a_checks")
import cudagraphify as cg  # noqa: E402


def seq():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).to(DEV)


def x_(n=8, rg=False):
    return torch.randn(n, 64, device=DEV, requires_grad=rg)


def run(g, ref, n=5, pre=None, inp=x_):
    """(ok, why): n no_grad calls, each compared bitwise; ``pre(i)`` before call i."""
    with torch.no_grad():
        for i in range(n):
            if pre is not None:
                pre(i)
            x = inp()
            got, want = g(x), ref(x)
            sync_all()
            ok, why = same(got, want)
            if not ok:
                return False, f"call {i}: {why} ({stats_line(g)})"
    return True, ""


# -- S2: an argument's requires_grad read under no_grad ------------------------------------
class ArgGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(64, 64)

    def forward(self, x):
        return self.l(x) * (2.0 if x.requires_grad else 3.0)


torch.manual_seed(0)
ref = ArgGrad().to(DEV)
g = cg.graphify(copy.deepcopy(ref))
ok, why = run(g, ref, inp=lambda: x_(rg=True))
check(ok, "[finding] S2 argument requiring grad, forward reads x.requires_grad under no_grad",
      why)
torch.manual_seed(0)
ref = ArgGrad().to(DEV)
g = cg.graphify(copy.deepcopy(ref))
ok, why = run(g, ref)
check(ok and cg.stats(g).replays >= 3, "[control] S2 the same with an argument not requiring "
      "grad replays", why or stats_line(g))


# -- F5 control: a parameter's requires_grad flipped --------------------------------------
class ReadsGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)

    def forward(self, x):
        return self.a(x) * (2.0 if self.a.weight.requires_grad else 3.0)


torch.manual_seed(0)
ref = ReadsGrad().to(DEV)
g = cg.graphify(copy.deepcopy(ref))
ok, why = run(g, ref, n=7, pre=lambda i: [m.requires_grad_(False) for m in (ref, g)]
              if i == 3 else None)
s = cg.stats(g)
check(ok and s.captures == 2 and s.replays >= 4, "[control] F5 parameter requires_grad "
      "flipped under no_grad: a second graph", why or stats_line(g))


# -- S3: a registry shared by a shallow copy -----------------------------------------------
def shallow():
    b = seq()[0]
    return b, copy.copy(b)


ref_base, ref = shallow()
base, m = shallow()
g = cg.graphify(m)
new = torch.ones(64, 64, device=DEV)
ok, why = run(g, ref, n=6, pre=lambda i: [setattr(b, "weight", nn.Parameter(new.clone()))
                                          for b in (ref_base, base)] if i == 3 else None)
check(ok, "[finding] S3 copy.copy(module) graphified, base.weight replaced (shared registry)",
      why)


# -- L1: the first call inside a named_parameters() loop -----------------------------------
ref = seq()
g = cg.graphify(copy.deepcopy(ref))
x = x_()
with torch.no_grad():
    for _ in g.named_parameters():
        g(x)
ok, why = run(g, ref)
s = cg.stats(g)
check(ok and s.captures >= 1 and s.replays >= 3, "[finding] L1 first call inside "
      "named_parameters(): graphed after the loop", why or stats_line(g))
ref = seq()
g = cg.graphify(copy.deepcopy(ref))
with torch.no_grad():
    g(x)
    for _ in g.named_parameters():
        g(x)
ok, why = run(g, ref)
check(ok and cg.stats(g).replays >= 8, "[control] L1 the loop after a first call replays",
      why or stats_line(g))


# -- L2: explain before the first call -----------------------------------------------------
ref = seq()
g = cg.graphify(copy.deepcopy(ref))
with torch.no_grad():
    cg.explain(g, x_())
ok, why = run(g, ref)
s = cg.stats(g)
check(ok and s.captures >= 1 and s.replays >= 3, "[finding] L2 explain before the first call: "
      "graphed after", why or stats_line(g))
ref = seq()
g = cg.graphify(copy.deepcopy(ref))
with torch.no_grad():
    g(x_())
    cg.explain(g, x_())
ok, why = run(g, ref)
check(ok and cg.stats(g).replays >= 4, "[control] L2 explain after the first call",
      why or stats_line(g))


# -- S1: a family's rebased graph and requires_grad (a static-state cache argument) --------
class Cache:
    def __init__(self, layers):
        self.layers = layers

    @property
    def is_compileable(self):
        return True


Cache.__module__ = "transformers.cache_utils"


class StaticLayer:
    is_compileable = True

    def __init__(self, max_len=6):
        self.max_len, self.keys, self.is_initialized = max_len, None, False

    def update(self, k, pos):
        if not self.is_initialized:
            self.keys = torch.zeros(k.shape[0], self.max_len, k.shape[-1], dtype=k.dtype,
                                    device=k.device)
            self.is_initialized = True
        self.keys.index_copy_(1, pos, k)
        return self.keys


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.projs = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])

    def forward(self, x, cache, pos):
        for i, proj in enumerate(self.projs):
            x = x + cache.layers[i].update(proj(x), pos).mean(1, keepdim=True)
        return x * (2.0 if self.projs[0].weight.requires_grad else 3.0)


def generate(ref, g, kept):
    rc, c = Cache([StaticLayer(), StaticLayer()]), Cache([StaticLayer(), StaticLayer()])
    kept.append((rc, c))
    with torch.no_grad():
        for t in range(3):
            x = torch.randn(1, 1, 16, device=DEV)
            pos = torch.tensor([t], device=DEV)
            want, got = ref(x, rc, pos), g(x, c, pos)
            sync_all()
            ok, why = same(got, want)
            if not ok:
                return f"step {t}: {why} ({stats_line(g)})"
    return ""


torch.manual_seed(0)
ref = Net().to(DEV)
g = cg.graphify(copy.deepcopy(ref))
kept: list = []
why = "".join(generate(ref, g, kept) for _ in range(4))
r0 = cg.stats(g).retargets
info(f"S1 before the flip: {stats_line(g)} retargets={r0}")
if why or r0 < 1:
    check(not why, "[control] S1 family rebased with the read, no flip",
          why or "no rebased graph here (CPU double: no retargeting)")
else:
    check(True, "[control] S1 family rebased with the read, no flip")
    for mm in (ref, g):
        mm.projs[0].requires_grad_(False)
    why = "".join(generate(ref, g, kept) for _ in range(2))
    check(not why, "[finding] S1 requires_grad flipped, new caches: rebased graph", why)

# -- control: nn.TransformerEncoder under no_grad keeps graphing (reads requires_grad only
# under grad mode)
torch.manual_seed(0)
enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0,
                                                       batch_first=True), 2,
                            enable_nested_tensor=False).to(DEV).eval()
g = cg.graphify(copy.deepcopy(enc))
with torch.no_grad():
    for _ in range(5):
        xx = torch.randn(2, 5, 64, device=DEV)
        got, want = g(xx), enc(xx)
sync_all()
s = cg.stats(g)
check(torch.allclose(got, want, atol=1e-4) and s.replays >= 4 and s.eager == 0,
      "[control] TransformerEncoder under no_grad graphed", stats_line(g))

finish("a_checks")
