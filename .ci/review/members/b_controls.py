"""members review controls on CUDA (segments on, trial off): what the guard and checks do see.
Every line should PASS (``whole``: module calls answered whole)."""
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DEV, Elem, Host, check, finish, run, skip_without_cuda, twins, untimed, \
    whole, x_of  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

skip_without_cuda("b_controls")
untimed()


def changed(label, make, change, n=2):
    torch.manual_seed(0)
    g, ref = twins(make())
    x = x_of()
    ok, why = run(g, ref, x, 4)
    before = whole(g)
    if ok:
        for mod in (g, ref):
            change(mod)
        ok, why = run(g, ref, x, n)
    check(ok and before > 0, f"[control] {label} (whole before {before}, after {whole(g)})",
          why or f"whole {before}")


def with_cfg():
    e = Elem(lambda m, h: h * m.cfg.scale * m.opts["k"])
    e.cfg, e.opts = types.SimpleNamespace(scale=2.0), {"k": 1.0}
    return Host(e)


changed("a config object's field changed", with_cfg,
        lambda mod: setattr(mod.inner.cfg, "scale", 5.0))
changed("a dict attribute mutated in place", with_cfg,
        lambda mod: mod.inner.opts.__setitem__("k", 3.0))


def with_scale():
    e = Elem(lambda m, h: h * m.scale)
    e.scale = 2.0
    return Host(e)


changed("an instance attribute changed", with_scale, lambda mod: setattr(mod.inner, "scale", 5.0))
changed("a parameter changed in place", with_scale,
        lambda mod: mod.inner.w.data.mul_(3))


def counter():
    def body(m, h):
        m.n += 1
        return h
    e = Elem(body)
    e.n = 0
    return Host(e)


torch.manual_seed(0)
g, ref = twins(counter())
ok, why = run(g, ref, x_of(), 6)
check(ok and g.inner.n == ref.inner.n, "[control] a counter attribute in the member's forward",
      why or f"n {g.inner.n} vs {ref.inner.n}")


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Elem()
        self.prev = None

    def forward(self, x):
        h = x.relu()
        h = h * 1 if h.sum().item() > -1e9 else h
        a = self.inner(h)
        b = self.inner(a)
        res = a + b + (self.prev if self.prev is not None else 0)
        self.prev = a
        return res


torch.manual_seed(0)
g, ref = twins(Twice())
ok, why = True, ""
for i in range(7):
    ok, why = run(g, ref, torch.randn(8, 64, device=DEV))
    if not ok:
        break
check(ok, f"[control] one member twice a call, its output kept across calls (whole {whole(g)})",
      why)

torch.manual_seed(0)
g, ref = twins(Host(Elem()))
x = x_of()
run(g, ref, x, 4)
seen = []
hk = nn.modules.module.register_module_forward_hook(
    lambda mod, a, out: seen.append(type(mod).__name__) or None)
try:
    ok, why = run(g, ref, x, 1)
finally:
    hk.remove()
check(ok and seen.count("Elem") == 2, "[control] a global forward hook registered later runs",
      why or f"seen {seen}")

finish("b_controls")
