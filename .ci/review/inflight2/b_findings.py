"""Findings of the second in-flight review: each line FAILs on 2661480 (R1 is a regression of
2661480: PASSes on 380d851; R2-R5 FAIL there too)."""
from common import FirstCallWrites, Scaled, check, cg, nn, outcome, randn, same_as_eager, \
    torch, twins, DEV

# R1: raise where eager succeeds
check("R1 a write only the first call made is not replayed as a version move",
      lambda: same_as_eager(*twins(lambda: FirstCallWrites("scale"), warm=(8, 12),
                                   warm_backward=False), (12, 8)))
# R2: silent where eager raises
check("R2 a write later calls make moves the version on replay",
      lambda: same_as_eager(*twins(lambda: FirstCallWrites("tmp"), warm=(8, 12),
                                   warm_backward=False), (12, 8)))

# R3: wrong values, a module outside the tree
_SIDE = {}


class Side(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(16))

    def forward(self, h):
        self.scale.mul_(0.5)
        return h * self.scale


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        _SIDE[id(self)] = Side().to(DEV)

    def forward(self, x):
        return _SIDE[id(self)](self.lin(x))


def r3_values():
    torch.manual_seed(0)
    ref = Outer().to(DEV)
    g = Outer().to(DEV)
    g.load_state_dict(ref.state_dict())
    g = cg.graphify(g)
    for s in range(3):
        x = randn(8)
        w, o = ref(x), g(x)
        if not torch.equal(_SIDE[id(ref)].scale, _SIDE[id(g)].scale):
            return f"call {s}: outside buffer {_SIDE[id(g)].scale[0].item()} " \
                   f"(eager {_SIDE[id(ref)].scale[0].item()})"
        if not torch.allclose(w, o, rtol=2e-5, atol=2e-6):
            return f"call {s}: outputs differ"
    return None


def r3_backward():
    torch.manual_seed(0)
    ref = Outer().to(DEV)
    g = Outer().to(DEV)
    g.load_state_dict(ref.state_dict())
    g = cg.graphify(g)
    x = randn(8)
    a, b = outcome(lambda: ref(x).sum().backward()), outcome(lambda: g(x).sum().backward())
    return None if a == b else f"first call's backward: eager {a}, graphed {b}"


check("R3 an outside module's buffer is written once by the first call", r3_values)
check("R3 the first call's backward with an outside module's buffer", r3_backward)


# R4: silent where eager raises
def _rebind(m):
    m.scale = m.scale.data


check("R4 a buffer rebound on its own memory (m.scale = m.scale.data), twins",
      lambda: same_as_eager(*twins(Scaled, prep=_rebind), (8, 8)))


# R5: version counter moved twice
class ViewBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("base", torch.ones(32))
        self.register_buffer("lo", self.base[:16])

    def forward(self, x):
        self.lo.mul_(0.5)
        return self.lin(x) * self.base[16:]


def r5():
    ref, g = twins(ViewBuffer)
    moves = []
    for m in (ref, g):
        m(randn(8)).sum().backward()  # (a replay for g)
        v = m.base._version
        m(randn(8)).sum().backward()
        moves.append(m.base._version - v)
    return None if moves[0] == moves[1] else f"version moves per call: eager {moves[0]}, " \
        f"graphed {moves[1]}"


check("R5 a buffer and its view: one version move per call", r5)
