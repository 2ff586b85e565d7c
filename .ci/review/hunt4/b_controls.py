"""Training-loop controls on a real GPU (all should PASS): an eager twin (copy.deepcopy before
graphify), 6 steps, loss, parameters, ``.grad``, buffers and what each step returns compared
bitwise (each step seeded alike, so dropout draws the same masks).
Checks (MLP 64 wide unless said):
  [control] SGD(momentum), Adam(foreach=False), AdamW(foreach=True), AdamW(fused=True on CUDA),
            each with zero_grad(set_to_none=True) and (False);
  [control] accumulation over two micro-batches, clip_grad_norm_ + clip_grad_value_, SGD;
  [control] two micro-batches whose backwards run in reverse order (a second graph);
  [control] torch.autograd.grad of one weight, updated by hand; backward(inputs=subset);
  [control] an input requiring grad, retain_grad() and a hook on the output after the call;
  [control] a layer frozen then unfrozen between steps;
  [control] BatchNorm + Dropout(0.3): train()/eval() switches and a no_grad eval every step;
  [control] tied weights; ReLU(inplace=True); a weight renormed in place in forward;
  [control] torch.utils.checkpoint (non-reentrant, reentrant; preserve_rng_state True, False)
            around Linear+Dropout+GELU, and the random stream after each step:
            GPU-only question (the CPU double cannot answer it: checkpoint's RNG stash and
            restore are host calls a replay does not repeat), a FAIL here is a new finding.
Run from the repository root: python3 .ci/review/hunt4/b_controls.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../.."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

C.skip_without_cuda("b_controls.py")
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

W = 64
STEPS = 6


def mlp():
    return nn.Sequential(nn.Linear(W, 128), nn.ReLU(inplace=True), nn.Linear(128, W))


OPTS = {
    "SGD(momentum)": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "Adam(foreach=False)": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False),
    "AdamW(foreach=True)": lambda ps: torch.optim.AdamW(ps, lr=0.01, foreach=True),
}
if not C.CPU:
    OPTS["AdamW(fused=True)"] = lambda ps: torch.optim.AdamW(ps, lr=0.01, fused=True)


def opt_of(m, st, make=OPTS["SGD(momentum)"]):
    if "opt" not in st:
        st["opt"] = make(list(m.parameters()))
    return st["opt"]


def opt_state(st):
    return {f"state {i}.{k}": v.clone() for i, s in enumerate(st["opt"].state.values())
            for k, v in s.items() if isinstance(v, torch.Tensor)}


def std_step(make_opt, set_to_none=True):
    def step(m, x, st, i):
        opt = opt_of(m, st, make_opt)
        opt.zero_grad(set_to_none=set_to_none)
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        return {"loss": loss.detach(), **opt_state(st)}
    return step


def accum_step(m, x, st, i):
    opt = opt_of(m, st)
    if i % 2 == 0:
        opt.zero_grad()
    loss = m(x).square().mean() / 2
    loss.backward()
    if i % 2 == 1:
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
        torch.nn.utils.clip_grad_value_(m.parameters(), 0.001)
        opt.step()
    return {"loss": loss.detach()}


def reverse_step(m, x, st, i):
    opt = opt_of(m, st)
    opt.zero_grad()
    l1 = m(x).square().mean()
    l2 = m(x * 2).pow(3).mean()
    l2.backward()
    l1.backward()
    opt.step()
    return {"l1": l1.detach(), "l2": l2.detach()}


def grad_subset_step(m, x, st, i):
    loss = m(x).square().mean()
    (gw,) = torch.autograd.grad(loss, [m[0].weight])
    with torch.no_grad():
        m[0].weight.sub_(0.1 * gw)
    loss = m(x * 0.5).square().mean()
    loss.backward(inputs=[m[2].weight, m[0].bias])
    got = {"loss": loss.detach(), "gw": gw, "w2.grad": m[2].weight.grad.clone()}
    m.zero_grad()
    return got


def input_grad_step(m, x, st, i):
    x = x.clone().requires_grad_(True)
    out = m(x)
    out.retain_grad()
    seen = []
    out.register_hook(lambda grad: seen.append(grad.clone()))
    (out * torch.arange(W, device=x.device, dtype=x.dtype)).sum().backward()
    got = {"x.grad": x.grad, "out.grad": out.grad, "hook": seen[0]}
    m.zero_grad()
    return got


def freeze_step(m, x, st, i):
    opt = opt_of(m, st)
    opt.zero_grad()
    m[0].requires_grad_(i % 3 != 1)
    loss = m(x).square().mean()
    loss.backward()
    opt.step()
    return {"loss": loss.detach()}


class BNDrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, 128)
        self.bn = nn.BatchNorm1d(128)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(128, W)

    def forward(self, x):
        return self.out(self.drop(torch.relu(self.bn(self.lin(x)))))


def train_eval_step(m, x, st, i):
    opt = opt_of(m, st, OPTS["Adam(foreach=False)"])
    opt.zero_grad()
    m.train(i % 3 != 2)
    loss = m(x).square().mean()
    loss.backward()
    opt.step()
    m.eval()
    with torch.no_grad():
        ev = m(x)
    m.train()
    return {"loss": loss.detach(), "eval": ev}


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(W, W)
        self.b = nn.Linear(W, W)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Renorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.out = nn.Linear(W, W)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.renorm_(2, 0, 0.5)
        return self.out(torch.relu(self.lin(x)))


class Ckpt(nn.Module):
    def __init__(self, reentrant, preserve=True):
        super().__init__()
        self.reentrant, self.preserve = reentrant, preserve
        self.block = nn.Sequential(nn.Linear(W, 128), nn.Dropout(0.3), nn.GELU())
        self.out = nn.Linear(128, W)

    def forward(self, x):
        return self.out(checkpoint(self.block, x, use_reentrant=self.reentrant,
                                   preserve_rng_state=self.preserve))


def clip_step(m, x, st, i):
    opt = opt_of(m, st)
    opt.zero_grad()
    loss = m(x).square().mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
    opt.step()
    return {"loss": loss.detach()}


def clip_rng_step(m, x, st, i):
    got = clip_step(m, x, st, i)
    got["random stream after the step"] = torch.rand(4, device=x.device)
    return got


def case(what, make, step, steps=STEPS):
    try:
        bad, g = C.train_twins(make, step, steps)
    except Exception as e:  # noqa: BLE001 - a loud failure is reported as such
        C.check(False, f"[control] {what}", f"raised {type(e).__name__}: {str(e)[:160]}")
        return
    C.check(bad is None, f"[control] {what}: {steps} steps equal eager's", str(bad))
    C.info(f"{what}: {C.stats_line(g)}")


for name, make_opt in OPTS.items():
    for stn in (True, False):
        case(f"{name}, zero_grad(set_to_none={stn})", mlp, std_step(make_opt, stn))
case("accumulation x2 + clip_grad_norm_ + clip_grad_value_", mlp, accum_step, 8)
case("two micro-batches, backwards in reverse order", mlp, reverse_step)
case("autograd.grad of one weight; backward(inputs=subset)", mlp, grad_subset_step)
case("input grad, retain_grad, output hook", mlp, input_grad_step)
case("layer frozen/unfrozen between steps", mlp, freeze_step, 7)
case("BatchNorm + Dropout, train/eval switches, no_grad eval", BNDrop, train_eval_step, 7)
case("tied weights + clip_grad_norm_", Tied, clip_step)
case("weight renormed in place in forward", Renorm, clip_step)
if C.CPU:
    C.info("checkpoint cases: GPU only (the CPU double replays checkpoint's recompute with "
           "fresh random numbers)")
else:
    for reentrant in (False, True):
        for preserve in (True, False):
            case(f"checkpoint(use_reentrant={reentrant}, preserve_rng_state={preserve}) around "
                 "Linear+Dropout+GELU", lambda: Ckpt(reentrant, preserve), clip_rng_step)
C.finish("b_controls")
