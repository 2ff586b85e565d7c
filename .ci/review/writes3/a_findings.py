"""[finding] lines of the writes3 review (tests/test_review_writes3.py G1-G8). Each compares the
graphed twin with its eager twin bitwise; PASS means the finding did not reproduce (fixed, or a
GPU behaviour other than the CPU double's). Expected on fix-writes3: FAIL for G1-G5, G7, G6
(cost: refused), G8 (unverified: a device global grown by resize_ on a later path). On fix-hooks
(a tensor hook the forward registers refuses the graph on the real call, PYTHON_HOOK): PASS for
G1-G7 (G6: refused for the hook, named, no longer for a misleading write; G4: the probes
patch Tensor.set_, which no torch function mode sees, and note the layout it rebinds)."""
from common import DEV, SIM, bump, check, grads_equal, nn, randn, stats, sync, torch, twins
import cudagraphify as cg

_G = {}


class AuxOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        aux = torch.zeros((), device=x.device)
        if h.requires_grad:
            h.register_hook(lambda g: bump(aux, g.sum()))
        return h * 2, aux


def g1():
    ref, g = twins(AuxOut)
    for call in range(4):
        x = randn(3, 4)
        (a, aa), (b, ab) = ref(x), g(x)
        a.sum().backward()
        b.sum().backward()
        sync()
        if not torch.equal(a, b) or not torch.equal(aa, ab):
            return f"call {call}: aux eager {aa.item()} graphed {ab.item()}; {stats(g)}"
    return grads_equal(ref, g)


class ArgStats(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, st):
        h = self.lin(x)
        if h.requires_grad:
            h.register_hook(lambda g: bump(st, g.pow(2).sum()))
        return h * 2


def g2():
    ref, g = twins(ArgStats)
    sa, sb = torch.zeros((), device=DEV), torch.zeros((), device=DEV)
    for call in range(4):
        x = randn(3, 4)
        ref(x, sa).sum().backward()
        g(x, sb).sum().backward()
        sync()
        if not torch.equal(sa, sb) or sa._version != sb._version:
            return (f"call {call}: stats eager {sa.item()} v{sa._version}, graphed {sb.item()} "
                    f"v{sb._version}; {stats(g)}")
    return None


class InputHook(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.requires_grad:
            x.register_hook(lambda g: g * 3)
        return self.lin(x) * 2


def g3():
    ref, g = twins(InputHook)
    for call in range(4):
        x = randn(3, 4)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref(xa).sum().backward()
        g(xb).sum().backward()
        sync()
        if not torch.equal(xa.grad, xb.grad):
            return f"call {call}: x.grad differs (eager has the hook's *3); {stats(g)}"
    return grads_equal(ref, g)


class LaterSetFirst(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.how, self.ready = how, False

    def setup(self):
        _G[id(self)] = torch.zeros(4, device=DEV)
        _G[id(self), "other"] = torch.ones(4, device=DEV)
        return self

    def forward(self, x):
        h = self.lin(x)
        if self.ready:
            t = _G[id(self)]
            if self.how == "fresh":
                t.set_(torch.cat([h[0], h[1]]).detach())
            else:
                t.set_(_G[id(self), "other"])
        self.ready = True
        return h


def g4(how, grad):
    def go():
        ref, g = twins(lambda: LaterSetFirst(how), num_warmup_iters=2)  # (in place)
        ref.setup(), g.setup()
        x = randn(3, 4)
        with torch.enable_grad() if grad else torch.no_grad():
            ref(x), g(x)
        sync()
        a, b = _G[id(ref)], _G[id(g)]
        if a.shape != b.shape or not torch.equal(a, b) or a._version != b._version:
            return (f"after the first call the global is {tuple(b.shape)} {b.tolist()} v"
                    f"{b._version}, eager's {tuple(a.shape)} {a.tolist()} v{a._version}")
        return None
    return go


class LogHook(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.log = []

    def forward(self, x):
        h = self.lin(x)
        if h.requires_grad:
            h.register_hook(lambda g: self.log.append(g.detach().clone()))
        return h * 2


def g5():
    ref, g = twins(LogHook)
    x = randn(3, 4)
    ref(x).sum().backward()
    g(x).sum().backward()
    sync()
    if len(ref.log) != len(g.log):
        return f"first call: {len(g.log)} log entries, eager {len(ref.log)}; {stats(g)}"
    return None if all(torch.equal(a, b) for a, b in zip(ref.log, g.log)) else "entries differ"


class InplaceGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        h = self.lin(x)
        if h.requires_grad:
            def hook(g):
                g.mul_(3)
            h.register_hook(hook)
        return self.out(torch.relu(h))


def g6():
    ref, g = twins(InplaceGrad)
    for call in range(4):
        x = randn(3, 4)
        a, b = ref(x), g(x)
        a.sum().backward()
        b.sum().backward()
        sync()
        if not torch.equal(a, b):
            return f"call {call}: outputs differ (a silent wrong value, worse than the cost)"
        d = grads_equal(ref, g)
        if d:
            return f"call {call}: {d} (a silent wrong value, worse than the cost)"
    # (fix-hooks: refused on the real call for the hook, named; not for "a tensor that is no
    # parameter or buffer", the write to its own incoming gradient)
    reasons = list(cg.stats(g).eager_calls)
    if not reasons or not all("PYTHON_HOOK" in r and "InplaceGrad.forward.<locals>.hook" in r
                              for r in reasons):
        return f"values equal, but not refused for the hook: {stats(g)}"
    return None


class HookBuf(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        h = self.lin(x)
        if h.requires_grad:
            h.register_hook(lambda g: bump(self.count, g.sum()))
        return h * 2


def g7():
    ref, g = twins(HookBuf, probe=False)
    for call in range(4):
        x = randn(3, 4)
        ref(x).sum().backward()
        g(x).sum().backward()
        sync()
        if not torch.equal(ref.count, g.count) or ref.count._version != g.count._version:
            return (f"call {call}: count eager {ref.count.item()} v{ref.count._version}, graphed "
                    f"{g.count.item()} v{g.count._version}; {stats(g)}")
    return None


class LaterResize(nn.Module):
    """The later calls grow a device global by resize_ and fill the new part (the real call
    does not): a CUDA capture's run reallocates it in the graph's pool without running the copy
    of its old bytes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.ready = False

    def forward(self, x):
        h = self.lin(x)
        if self.ready:
            t = _G[id(self), "r"]
            n = t.numel()
            t.resize_(n + 4)
            t[n:] = h[0].detach()
        self.ready = True
        return h


def g8(grad):
    def go():
        ref, g = twins(LaterResize, num_warmup_iters=2)  # (graphify works in place)
        for m in (ref, g):
            _G[id(m), "r"] = torch.arange(4.0, device=DEV)
        x = randn(3, 4)
        with torch.enable_grad() if grad else torch.no_grad():
            ref(x), g(x)
        sync()
        a, b = _G[id(ref), "r"], _G[id(g), "r"]
        if b.shape != a.shape or not torch.equal(b, a) or b._version != a._version:
            return (f"after the first call the global is {tuple(b.shape)} {b.tolist()} v"
                    f"{b._version}, eager's {tuple(a.shape)} {a.tolist()} v{a._version}; "
                    f"{stats(g)}")
        return None
    return go


check("[finding G1] a backward hook writes a tensor the forward returns: the user's copy", g1)
check("[finding G2] a backward hook writes a tensor argument: value and version", g2)
check("[finding G3] a hook the forward registers on its input: x.grad on replays", g3)
for how in ("fresh", "other"):
    for grad in (False, True):
        check(f"[finding G4] a global's set_ ({how}) before any op takes it, on a later path "
              f"(grad={grad}): after the first call", g4(how, grad))
check("[finding G5] a forward-registered hook's Python in the warm-up's and capture's "
      "backwards: log entries after the first call", g5)
check("[finding G6] (cost) a hook writing its own incoming gradient in place: refused for the "
      "hook (named), values equal", g6)
check("[finding G7] probe=False: a backward hook's buffer write (value, version)", g7)
for grad in (False, True):
    check(f"[finding G8, unverified] a device global grown by resize_ on a later path "
          f"(grad={grad}): its bytes after the first call" + (" [SIM: restores by design]"
                                                              if SIM else ""), g8(grad))
