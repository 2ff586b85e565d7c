"""Hunt 7 findings on the device: each [finding] line FAILed while its gap was open (a wrong
value, no error, no eager call) and PASSes since its fix; [documented] lines (F4, F6: README)
are expected FAILs. tests/test_review_hunt7.py has the CPU reproductions."""
import copy
import types
import weakref
from collections import OrderedDict

from common import DEV, check, finish, scenario, skip_without_cuda, stats_line, sync_all, same

import torch
from torch import nn

import cudagraphify as cg

skip_without_cuda("a_silent")
H = 64


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(H, H) for _ in range(4)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


torch.manual_seed(5)
EXTRA = nn.Linear(H, H).to(DEV)


def steps(make, plan, n=10):
    torch.manual_seed(0)
    ref = make().to(DEV).eval()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(n):
            for at, f in plan:
                if at == i:
                    if cg.stats(g).replays < 1:
                        return False, "no replay before a change"
                    f(ref)
                    f(g)
            x = torch.randn(8, H, device=DEV)
            ok, why = same(g(x), ref(x))
            if not ok:
                return False, f"call {i}: {why} ({stats_line(g)})"
    return True, ""


# F1: ModuleList / Sequential changed after a del
for then, f in [("append", lambda m: m.layers.append(copy.deepcopy(EXTRA))),
                ("insert", lambda m: m.layers.insert(0, copy.deepcopy(EXTRA))),
                ("setitem", lambda m: m.layers.__setitem__(0, copy.deepcopy(EXTRA)))]:
    ok, why = steps(Stack, [(3, lambda m: m.layers.__delitem__(3)), (6, f)])
    check(ok, f"[finding] F1 ModuleList del then {then}", why)
ok, why = steps(lambda: nn.Sequential(*[nn.Linear(H, H) for _ in range(4)]),
                [(3, lambda m: m.pop(0)), (6, lambda m: m.append(copy.deepcopy(EXTRA)))])
check(ok, "[finding] F1 Sequential pop then append", why)
ok, why = steps(Stack, [(3, lambda m: m.layers.insert(0, copy.deepcopy(EXTRA)))])
check(ok, "[control] F1 ModuleList insert without an earlier del", why)


# F2: OrderedDict registries (a whole model pickled by an older torch)
class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(H, H), nn.Linear(H, H)
        self.scale = 2.0

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) * self.scale


def old_registries():
    m = Plain()
    for mod in m.modules():
        for k in ("_parameters", "_buffers", "_modules"):
            mod.__dict__[k] = OrderedDict(mod.__dict__[k])
    return m


ok, why, _ = scenario(old_registries, lambda m: setattr(m, "scale", 3.0))
check(ok, "[finding] F2 OrderedDict registries: m.scale = 3.0", why)
ok, why, _ = scenario(old_registries, lambda m: setattr(m, "b", copy.deepcopy(m.a)))
check(ok, "[finding] F2 OrderedDict registries: submodule replaced", why)
ok, why, _ = scenario(Plain, lambda m: setattr(m, "scale", 3.0))
check(ok, "[control] F2 plain registries: m.scale = 3.0", why)


# F3: .grad read in forward (an optimizer step as a module)
class Step(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, lr):
        for p in self.model.parameters():
            p.sub_(p.grad * lr)
        return lr


def train(set_to_none):
    torch.manual_seed(0)
    ref = nn.Linear(H, H).to(DEV)
    net = copy.deepcopy(ref)
    ref_step, g_step = Step(ref), cg.graphify(Step(net))
    lr = torch.tensor(0.1, device=DEV)
    kept = []  # the old gradients stay alive (logged): the new ones get new memory
    for i in range(6):
        x = torch.randn(8, H, device=DEV)
        for m, step in ((ref, ref_step), (net, g_step)):
            kept += [p.grad for p in m.parameters() if p.grad is not None]
            m.zero_grad(set_to_none=set_to_none)
            m(x).pow(2).sum().backward()
            with torch.no_grad():
                step(lr)
        sync_all()
        ok, why = same(net.weight.detach(), ref.weight.detach())
        if not ok:
            return False, f"step {i}: {why} ({stats_line(g_step)})"
    # (fixed: a forward reading .grad runs eagerly, with the reason)
    if not any("Tensor.grad [PYTHON_STATE]" in r for r in cg.stats(g_step).eager_calls):
        return False, "not refused with the reason: " + stats_line(g_step)
    return True, ""


ok, why = train(True)
check(ok, "[finding] F3 .grad read in forward, zero_grad(set_to_none=True)", why)
ok, why = train(False)
check(ok, "[control] F3 .grad read in forward, zeroed in place (eager, the reason)", why)


# F4: Python attribute of a parameter
class ParamFlag(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.lin.weight.transposed = False

    def forward(self, x):
        w = self.lin.weight
        if getattr(w, "transposed", False):
            w = w.t()
        return x @ w.t()


ok, why, _ = scenario(ParamFlag, lambda m: setattr(m.lin.weight, "transposed", True), fresh=True)
check(ok, "[documented] F4 (README; expected FAIL) weight.transposed = True", why)


# F5: requires_grad read under no_grad
class RG(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        return self.lin(x) if self.lin.weight.requires_grad else self.lin(x) * 3


ok, why, _ = scenario(RG, lambda m: m.lin.weight.requires_grad_(False))
check(ok, "[finding] F5 weight.requires_grad_(False) under no_grad", why)


# F6: __slots__ attribute / data descriptor with its own store
class Slotted(nn.Module):
    __slots__ = ("scale",)

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.scale = 2.0

    def forward(self, x):
        return self.lin(x) * self.scale


class Store:
    def __init__(self):
        self.values = weakref.WeakKeyDictionary()

    def __get__(self, obj, cls):
        return self if obj is None else self.values.get(obj, 1.0)

    def __set__(self, obj, value):
        self.values[obj] = value


class Described(nn.Module):
    scale = Store()

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.scale = 2.0

    def forward(self, x):
        return self.lin(x) * self.scale


ok, why, _ = scenario(Slotted, lambda m: setattr(m, "scale", 3.0), fresh=True)
check(ok, "[documented] F6 (README; expected FAIL) __slots__ attribute set", why)
ok, why, _ = scenario(Described, lambda m: setattr(m, "scale", 3.0), fresh=True)
check(ok, "[documented] F6 (README; expected FAIL) data descriptor with its own store set", why)


# F7: read-only dict views kept as attributes
class Proxy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)
        self._d = {"s": 2.0}
        self.cfg = types.MappingProxyType(self._d)

    def forward(self, x):
        return self.lin(x) * self.cfg["s"]


class Values(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)
        self._s = {"a": 2.0}
        self.factors = self._s.values()

    def forward(self, x):
        y = self.lin(x)
        for v in self.factors:
            y = y * v
        return y


ok, why, _ = scenario(Proxy, lambda m: m._d.__setitem__("s", 3.0), fresh=True)
check(ok, "[finding] F7 MappingProxyType attribute, its dict changed", why)
ok, why, _ = scenario(Values, lambda m: m._s.__setitem__("b", 3.0), fresh=True)
check(ok, "[finding] F7 dict.values() attribute, its dict grown", why)

finish("a_silent")
