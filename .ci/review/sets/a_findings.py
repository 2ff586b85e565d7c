"""sets review findings on CUDA. [finding] lines FAIL where the finding holds.
F1 share_graph refuses a second signature of ``self.last_n = x.shape[0]`` (and a new signature
   after a flag reset) as a counter: the partner layer's run writes [perf, wrong reason].
F2 _attrs_kept undoes a write another thread made while the group captured [silent output].
F3 a set under an unguarded global is repeated once the global is off [wrong attribute, low]."""
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DEV, Elem, check, layers_of, same_layers, setup, x_of  # noqa: E402

setup("a_findings")
import copy  # noqa: E402
import torch  # noqa: E402
import cudagraphify as cg  # noqa: E402
from cudagraphify import _share  # noqa: E402


class PerSig(Elem):
    def forward(self, x):
        self.last_n = x.shape[0]
        return self.body(x)


class Flag(Elem):
    def __init__(self):
        super().__init__()
        self.used = False

    def forward(self, x):
        self.used = True
        return self.body(x)


# F1
layers, ref, group = layers_of(PerSig)
ok, why = True, ""
for n in [3, 3, 3, 5, 5, 5, 3, 5]:
    x = x_of(n)
    good, w = same_layers(layers, ref, x, "last_n")
    ok, why = ok and good, why or w
check(ok, "[control] F1 per-signature last_n: outputs and last_n as eager's", why)
s = group.stats()
check(s.per_layer == 0 and not s.reasons, "[finding] F1 share_graph shares both signatures of "
      f"self.last_n = x.shape[0] (retargets {s.retargets}, per_layer {s.per_layer})",
      str(s.reasons))

layers, ref, group = layers_of(Flag)
for _ in range(3):
    same_layers(layers, ref, x_of(3))
for m, r in zip(layers, ref):
    m.used = r.used = False
ok, why = True, ""
for _ in range(3):
    good, w = same_layers(layers, ref, x_of(5), "used")
    ok, why = ok and good, why or w
check(ok, "[control] F1b flag reset then a new signature: outputs and flags as eager's", why)
s = group.stats()
check(s.per_layer == 0 and not s.reasons, "[finding] F1b share_graph shares a new signature "
      f"after a flag reset (per_layer {s.per_layer})", str(s.reasons))


# F2
class Scaled(Elem):
    def __init__(self):
        super().__init__()
        self.scale = 1.0

    def forward(self, x):
        self.used = True
        return self.body(x) * self.scale


layers, ref, group = layers_of(Scaled)
real = _share.ShareGroup._new_template


def meanwhile(self, *a, **kw):
    out = real(self, *a, **kw)
    th = threading.Thread(target=lambda: (setattr(layers[3], "scale", 3.0),
                                          setattr(ref[3], "scale", 3.0)))
    th.start()
    th.join()
    return out


_share.ShareGroup._new_template = meanwhile
try:
    x = x_of()
    ok, why = True, ""
    for _ in range(3):
        good, w = same_layers(layers, ref, x)
        ok, why = ok and good, why or w
finally:
    _share.ShareGroup._new_template = real
check(ok and layers[3].scale == 3.0, "[finding] F2 a write another thread made while the group "
      f"captured is kept (layers[3].scale now {layers[3].scale})", why)

# F3
DEBUG = [True]


class UnderGlobal(Elem):
    def __init__(self):
        super().__init__()
        self.seen = False

    def forward(self, x):
        if DEBUG[0]:
            self.seen = True
        return self.body(x)


torch.manual_seed(0)
m = UnderGlobal().to(DEV).eval()
g = cg.graphify(copy.deepcopy(m))
x = x_of()
with torch.no_grad():
    for _ in range(3):
        g(x), m(x)
    DEBUG[0] = False
    g.seen = m.seen = False
    ok = torch.equal(g(x), m(x))
check(ok and g.seen == m.seen, f"[finding] F3 a set under a global turned off is not repeated "
      f"(graphed seen={g.seen}, eager {m.seen}; replays {cg.stats(g).replays})")
