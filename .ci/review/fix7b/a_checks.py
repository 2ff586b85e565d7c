"""Fix-7b review on CUDA: findings SA (an argument's is_leaf / is_inference() read: the static
copy's value baked), LA (an OrderedDict registry iterated at the first call: eager for good),
LB (num_warmup_iters > 1 runs the extra warm-ups on copies that do not require grad), and
controls beside them. CPU reproductions: tests/test_review_fix7b.py."""
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DEV, check, finish, same, skip_without_cuda, stats_line, \
    sync_all  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

skip_without_cuda("a_checks")
import cudagraphify as cg  # noqa: E402


def run(g, ref, make, n=5, ctx=torch.no_grad):
    """(ok, why): n calls under ``ctx``, each on ``make()``, compared bitwise."""
    for i in range(n):
        x = make()
        with ctx():
            got, want = g(x), ref(x)
        sync_all()
        ok, why = same(got, want)
        if not ok:
            return False, f"call {i}: {why} ({stats_line(g)})"
    return True, ""


def rand(n=8, rg=False):
    return torch.randn(n, 64, device=DEV, requires_grad=rg)


class Reads(nn.Module):
    """Branches on an argument's ``what`` (requires_grad, is_leaf, is_inference)."""

    def __init__(self, what="requires_grad"):
        super().__init__()
        self.l = nn.Linear(64, 64)
        self.what = what

    def forward(self, x):
        if self.what == "is_leaf":
            flag = x.is_leaf
        elif self.what == "is_inference":
            flag = x.is_inference()
        else:
            flag = x.requires_grad
        return self.l(x) * (2.0 if flag else 3.0)


def pair(make):
    torch.manual_seed(0)
    ref = make().to(DEV).eval()
    return ref, cg.graphify(copy.deepcopy(ref))


# -- SA: argument metadata the static copy does not keep ------------------------------------
for label, what, ctx, make in [
        ("is_leaf of a non-leaf argument under no_grad", "is_leaf", torch.no_grad,
         lambda: rand(rg=True) * 1.0),
        ("is_leaf of a non-leaf argument under grad mode", "is_leaf", torch.enable_grad,
         lambda: rand(rg=True) * 1.0),
        ("is_inference() of a normal argument under inference_mode", "is_inference",
         torch.inference_mode, rand)]:
    ref, g = pair(lambda: Reads(what))
    ok, why = run(g, ref, make, ctx=ctx)
    # (fixed: the read refuses the module that makes it, PYTHON_STATE; its Linear is graphed)
    ok = ok and cg.stats(g).replays >= 1 and any("[PYTHON_STATE]" in r
                                                 for r in cg.stats(g).eager_calls)
    check(ok, f"[finding] SA {label}", why or stats_line(g))

# control: requires_grad itself (change 3), under no_grad, inference_mode, grad mode in turn
ref, g = pair(Reads)
ok = True
why = ""
for k in range(9):
    ctx = (torch.no_grad, torch.inference_mode, torch.enable_grad)[k % 3]
    ok, why = run(g, ref, lambda: rand(rg=True), n=1, ctx=ctx)
    if not ok:
        break
check(ok and cg.stats(g).replays >= 6, "[control] an argument's requires_grad read under "
      "no_grad / inference_mode / grad mode in turn", why or stats_line(g))


# -- control: the requires-grad copy written in place and returned ---------------------------
class ArgUses(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(64, 64)

    def forward(self, x):
        x.add_(1)
        return self.l(x) * (2.0 if x.requires_grad else 3.0), x[1:], x


ref, g = pair(ArgUses)
ok, why = True, ""
with torch.no_grad():
    for i in range(5):
        x = rand(rg=True)
        x2 = x.detach().clone().requires_grad_(True)
        got, want = g(x), ref(x2)
        sync_all()
        for a, b in zip(got, want):
            ok, why = same(a, b)
            if not ok:
                break
        ok = ok and got[2] is x and torch.equal(x, x2)
        if not ok:
            why = f"call {i}: {why or 'argument'} ({stats_line(g)})"
            break
check(ok and cg.stats(g).replays >= 4, "[control] an argument requiring grad written in place "
      "and returned (and a view) under no_grad", why or stats_line(g))

# -- control: capture_sizes, a graph_region chain, copy_outputs=False ------------------------
ref, g = pair(Reads)
with torch.no_grad():
    cg.capture_sizes(g, lambda n: rand(n, rg=True), [1, 2, 4], progress=False)
ok = all(run(g, ref, lambda n=n: rand(n, rg=True), n=1)[0] for n in (1, 2, 4, 1, 2, 4))
check(ok and cg.stats(g).captures == 3 and cg.stats(g).replays >= 6,
      "[control] capture_sizes with arguments requiring grad", stats_line(g))


class Split(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(64, 64)

    def forward(self, x):
        return self.l(x) * (2.0 if x.requires_grad else 3.0), x[:, :32]


class Join(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(32, 64)

    def forward(self, y, z):
        return self.l(z) * (2.0 if z.requires_grad else 3.0) + y


for mode in ("region", "copy_outputs=False"):
    torch.manual_seed(0)
    ra, rb = Split().to(DEV), Join().to(DEV)
    opts = dict(copy_outputs=False) if mode != "region" else {}
    ga, gb = cg.graphify(copy.deepcopy(ra), **opts), cg.graphify(copy.deepcopy(rb), **opts)
    ok, why = True, ""
    with torch.no_grad():
        for i in range(6):
            x = rand(rg=True)
            if mode == "region":
                with cg.graph_region():
                    got = gb(*ga(x)).clone()
            else:
                got = gb(*ga(x)).clone()
            want = rb(*ra(x))
            sync_all()
            ok, why = same(got, want)
            if not ok:
                why = f"call {i}: {why}"
                break
    check(ok and cg.stats(ga).replays >= 4 and cg.stats(gb).replays >= 4,
          f"[control] a chain with an argument requiring grad ({mode})",
          why or f"{stats_line(ga)} | {stats_line(gb)}")


# -- LA: an OrderedDict registry iterated at the first call ----------------------------------
class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(64, 64) for _ in range(4)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def stack_case(pruned, loop):
    torch.manual_seed(0)
    ref = Stack().to(DEV)
    if pruned:
        del ref.layers[3]  # (ModuleList.__delitem__: an OrderedDict _modules)
    g = cg.graphify(copy.deepcopy(ref))
    x = rand()
    with torch.no_grad():
        if loop == "outside":
            g(x)
        else:
            for _ in (g.named_parameters() if loop == "named_parameters" else g.layers):
                g(x)
    ok, why = run(g, ref, rand)
    s = cg.stats(g)
    return ok and s.captures >= 1 and s.replays >= 3 and not s.eager_calls, \
        why or stats_line(g)


for loop in ("named_parameters", "layers"):
    ok, why = stack_case(True, loop)
    check(ok, f"[finding] LA pruned ModuleList (OrderedDict), first call inside the {loop} "
          "loop: graphed after it", why)
    ok, why = stack_case(False, loop)
    check(ok, f"[control] LA plain registries, first call inside the {loop} loop", why)
ok, why = stack_case(True, "outside")
check(ok, "[control] LA pruned ModuleList, first call outside any loop", why)


# -- LB: extra warm-ups on copies that do not require grad -----------------------------------
class NeedsGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(64, 64)

    def forward(self, x):
        if not x.requires_grad:
            raise ValueError("x must require grad")
        return self.l(x)


for n in (3, 1):
    torch.manual_seed(0)
    ref = NeedsGrad().to(DEV)
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=n)
    ok, why = run(g, ref, lambda: rand(rg=True))
    s = cg.stats(g)
    tag = "[finding] LB" if n > 1 else "[control] LB"
    check(ok and s.replays >= 3 and not s.eager_calls, f"{tag} num_warmup_iters={n}, forward "
          "refuses an argument not requiring grad: root graphed", why or stats_line(g))


# -- controls: common modules keep their graphs ---------------------------------------------
class MHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.m = nn.MultiheadAttention(64, 4, batch_first=True)

    def forward(self, x):
        return self.m(x, x, x, need_weights=False)[0]


class LSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.m = nn.LSTM(64, 64, batch_first=True)

    def forward(self, x):
        return self.m(x)[0]


class Tr(nn.Module):
    def __init__(self):
        super().__init__()
        self.t = nn.Transformer(64, 4, 1, 1, 128, dropout=0.0, batch_first=True)

    def forward(self, x):
        return self.t(x, x)


for make in (MHA, LSTM, Tr):
    ref, g = pair(make)
    ok = True
    with torch.no_grad():
        for _ in range(5):
            xx = torch.randn(2, 5, 64, device=DEV)
            got, want = g(xx), ref(xx)
            sync_all()
            ok = ok and torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    s = cg.stats(g)
    check(ok and s.replays >= 4 and not any("kept elsewhere" in r for r in s.eager_calls),
          f"[control] {make.__name__} under no_grad graphed", stats_line(g))

finish("a_checks")
