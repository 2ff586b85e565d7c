"""[control] lines of the hooks review (tests/test_review_hooks.py): expected PASS on fix-hooks.
Eager twins compared bitwise."""
import threading

import torch.utils.checkpoint as ckpt
from common import DEV, check, cg, grads_equal, nn, randn, stats, sync, torch, twins

_RH = torch.Tensor.register_hook
_RG = torch.Tensor.retain_grad
_MG = torch.autograd.graph.register_multi_grad_hook


def clean():
    if (torch.Tensor.register_hook is not _RH or torch.Tensor.retain_grad is not _RG
            or torch.autograd.graph.register_multi_grad_hook is not _MG
            or "set_" in vars(torch.Tensor)):
        return "a patch is left installed"
    return None


def reasons(g):
    return list(dict(cg.stats(g).eager_calls))


class Child(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x))


class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Child(), Child()
        self.how = ""
        self.log = []

    def forward(self, x):
        if self.how == "checkpoint":
            return ckpt.checkpoint(lambda t: self.b(self.a(t)), x, use_reentrant=False).sum(-1)
        return self.b(self.a(x)).sum(-1)


def _log_out(m):
    return lambda mod, gi, go: m.log.append(go[0].detach().clone())


MODULE_HOOKS = {
    "full backward hook on a child": lambda m: m.a.register_full_backward_hook(_log_out(m)),
    "full backward hook on the root": lambda m: m.register_full_backward_hook(_log_out(m)),
    "full backward pre-hook on a child": lambda m: m.b.register_full_backward_pre_hook(
        lambda mod, go: m.log.append(go[0].detach().clone())),
    "full backward pre-hook on the root": lambda m: m.register_full_backward_pre_hook(
        lambda mod, go: m.log.append(go[0].detach().clone())),
    "checkpoint (non-reentrant)": lambda m: setattr(m, "how", "checkpoint"),
}


def module_hooks(what):
    def go():
        ref, g = twins(Root)
        for m in (ref, g):
            MODULE_HOOKS[what](m)
        for call in range(4):
            x = randn(3, 4)
            a, b = ref(x), g(x)
            a.sum().backward()
            b.sum().backward()
            sync()
            if not torch.equal(a, b):
                return f"call {call}: outputs differ; {stats(g)}"
            d = grads_equal(ref, g)
            if d:
                return f"call {call}: {d}; {stats(g)}"
        if len(ref.log) != len(g.log) or not all(torch.equal(p, q)
                                                 for p, q in zip(ref.log, g.log)):
            return f"hook logs differ: {len(ref.log)} vs {len(g.log)}; {stats(g)}"
        if any("Tensor.register_hook" in r or "register_multi_grad_hook" in r for r in reasons(g)):
            return f"refused for a tensor hook torch registers: {stats(g)}"
        if cg.stats(g).replays < 2:  # (a hooked child graphed on its own: 2 on the H200)
            return f"not graphed: {stats(g)}"
        return clean()
    return go


class Hooked(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.how = how
        self.log = []

    def forward(self, x):
        h = self.lin(x)
        if torch.is_grad_enabled():
            if self.how == "parameter":
                self.lin.weight.register_hook(lambda g: g * 2)
            elif self.how == "intermediate":
                h.register_hook(lambda g: self.log.append(g.detach().clone()))
            elif self.how == "multi":
                torch.autograd.graph.register_multi_grad_hook(
                    (h,), lambda gs: self.log.append(gs[0].detach().clone()))
        return torch.relu(h) * 2


def refused(how):
    def go():
        ref, g = twins(lambda: Hooked(how))
        for call in range(4):
            x = randn(3, 4)
            a, b = ref(x), g(x)
            a.sum().backward()
            b.sum().backward()
            sync()
            if not torch.equal(a, b):
                return f"call {call}: outputs differ; {stats(g)}"
            d = grads_equal(ref, g)
            if d:
                return f"call {call}: {d}; {stats(g)}"
        if len(ref.log) != len(g.log) or not all(torch.equal(p, q)
                                                 for p, q in zip(ref.log, g.log)):
            return f"hook logs differ: {len(ref.log)} vs {len(g.log)}"
        r = reasons(g)
        if not r or not all("PYTHON_HOOK" in s for s in r):
            return f"not refused for the hook: {stats(g)}"
        return clean()
    return go


def inference(how):
    def go():
        ref, g = twins(lambda: Hooked(how))
        with torch.no_grad():
            for call in range(4):
                x = randn(3, 4)
                a, b = ref(x), g(x)
                sync()
                if not torch.equal(a, b):
                    return f"call {call}: outputs differ"
        s = cg.stats(g)
        if s.eager_calls or s.replays != 3:
            return f"not graphed under no_grad: {stats(g)}"
        return clean()
    return go


class Raise(nn.Module):
    def __init__(self, at):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.at, self.runs = at, 0

    def forward(self, x):
        h = self.lin(x)
        run, self.runs = self.runs, self.runs + 1
        if run == self.at:
            raise KeyboardInterrupt("boom")
        return h * 2


def interrupted(at):
    def go():
        g = cg.graphify(Raise(at).to(DEV), num_warmup_iters=2)
        try:
            g(torch.randn(3, 4, device=DEV, requires_grad=True))
        except KeyboardInterrupt:
            return clean()
        return "no KeyboardInterrupt"
    return go


class Paused(nn.Module):
    def __init__(self, at, go, pause):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.at, self.go, self.pause = at, go, pause
        self.log = []

    def forward(self, x):
        h = self.lin(x)
        if self.pause:
            self.pause = False
            self.at.set()
            self.go.wait(30)
        if h.requires_grad:
            h.register_hook(lambda g: self.log.append(g.detach().clone()))
        return h * 2


def threads():
    at, go_ev = threading.Event(), threading.Event()
    torch.manual_seed(0)
    a_mod = cg.graphify(Paused(at, go_ev, True).to(DEV))
    errors = []

    def thread_a():
        try:
            for _ in range(3):
                a_mod(randn(3, 4)).sum().backward()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=thread_a)
    th.start()
    try:
        if not at.wait(60):
            return "thread A never reached its forward"
        try:
            torch.ones(2, device=DEV).register_hook(lambda g: g)
            return "register_hook on a tensor without grad did not raise"
        except RuntimeError:
            pass
        u = torch.ones(2, device=DEV, requires_grad=True)
        v, w = u * 2, u * 3
        fired = []
        v.register_hook(lambda g: fired.append("removed")).remove()
        w.retain_grad()
        torch.autograd.graph.register_multi_grad_hook((v, w), lambda gs: fired.append("multi"))
        (v.sum() + w.sum()).backward()
        sync()
        if fired != ["multi"] or w.grad is None:
            return f"this thread's hooks: {fired}, retained grad {w.grad}"
        torch.manual_seed(0)
        b_mod = cg.graphify(Paused(None, None, False).to(DEV))
        for _ in range(2):
            b_mod(randn(3, 4)).sum().backward()
        if len(b_mod.log) != 2:
            return f"B's hook ran {len(b_mod.log)} times"
    finally:
        go_ev.set()
        th.join(60)
    sync()
    if errors:
        return f"thread A: {errors[0]!r}"
    if len(a_mod.log) != 3:
        return f"A's hook ran {len(a_mod.log)} times, 3 expected"
    if not any("PYTHON_HOOK" in r for r in reasons(a_mod)):
        return f"A not refused for its hook: {stats(a_mod)}"
    return clean()


for what in MODULE_HOOKS:
    check(f"[control] {what}: graphed (or as before), values equal, no tensor-hook refusal",
          module_hooks(what))
for how in ("parameter", "intermediate", "multi"):
    check(f"[control] forward registers a {how} hook: refused (PYTHON_HOOK), equal to eager",
          refused(how))
    check(f"[control] forward registers a {how} hook under grad only: graphed in no_grad",
          inference(how))
for at in (0, 1):
    check(f"[control] KeyboardInterrupt in run {at} of the first call: patches gone",
          interrupted(at))
check("[control] another thread's code and first call while a first call holds the patches",
      threads)
