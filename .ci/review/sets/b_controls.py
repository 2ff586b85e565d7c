"""sets review controls on CUDA: every line should PASS."""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DEV, Elem, check, layers_of, same_layers, setup, x_of  # noqa: E402

setup("b_controls")
import copy  # noqa: E402
import torch  # noqa: E402
import cudagraphify as cg  # noqa: E402


class Flag(Elem):
    def __init__(self):
        super().__init__()
        self.used = False

    def forward(self, x):
        self.used = True
        return self.body(x)


class Values(Elem):
    def forward(self, x):
        n = x.shape[0]
        self.sign = -0.0 if n == 3 else 0.0
        self.nan = float("nan") if n == 3 else math.inf
        self.flag = True if n == 3 else 1
        return self.body(x)


def exact(v):
    return repr(v), type(v), math.copysign(1, v) if isinstance(v, float) else None


def twins(cls):
    torch.manual_seed(0)
    m = cls().to(DEV).eval()
    return m, cg.graphify(copy.deepcopy(m))


# a reset flag, one module
m, g = twins(Flag)
x = x_of()
ok, why = True, ""
with torch.no_grad():
    for i in range(6):
        if i >= 3:
            g.used = m.used = False
        if not torch.equal(g(x), m(x)) or g.used != m.used:
            ok, why = False, f"call {i}: used {g.used} vs {m.used}"
check(ok and cg.stats(g).replays >= 4, f"[control] a reset flag is set again by replays "
      f"(replays {cg.stats(g).replays})", why)

# per-signature -0.0 / NaN / bool-vs-int
m, g = twins(Values)
ok, why = True, ""
with torch.no_grad():
    for n in [3, 5, 3, 5, 3, 5]:
        x = x_of(n)
        if not torch.equal(g(x), m(x)):
            ok, why = False, f"n={n}: output"
        for a in ("sign", "nan", "flag"):
            if exact(getattr(g, a)) != exact(getattr(m, a)):
                ok, why = False, f"n={n}: {a} {getattr(g, a)!r} vs {getattr(m, a)!r}"
check(ok, "[control] per-signature -0.0, NaN, True vs 1 set exactly as eager's", why)

# share_graph: one layer's flag reset at a time
layers, ref, group = layers_of(Flag)
x = x_of()
ok, why = True, ""
for _ in range(3):
    same_layers(layers, ref, x)
for k in range(4):
    for j, (a, b) in enumerate(zip(layers, ref)):
        a.used = b.used = j != k
    good, w = same_layers(layers, ref, x, "used")
    ok, why = ok and good, why or w
s = group.stats()
check(ok and s.per_layer == 0, f"[control] share_graph layers set their own flag again "
      f"(retargets {s.retargets}, per_layer {s.per_layer})", why or str(s.reasons))
print(f"# device {torch.cuda.get_device_name() if DEV == 'cuda' else 'cpu double'}")
