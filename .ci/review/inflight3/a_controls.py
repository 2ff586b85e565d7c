"""Controls: expected PASS on 2653ffc."""
from common import _SIDE, DEV, PlainAcc, check, cg, fast_installed, nn, outer_bn, randn, \
    same_acc, same_as_eager, torch, twins


class Side(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(16))

    def forward(self, h):
        self.scale.mul_(0.5)
        return h * self.scale


class OuterMixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("own", torch.ones(16))
        _SIDE[id(self)] = Side().to(DEV)

    def side(self):
        return _SIDE[id(self)]

    def sync_from(self, other):
        self.side().scale.copy_(other.side().scale)

    def forward(self, x):
        self.own.add_(1.0)
        return self.side()(self.lin(x) * self.own)


def side_same(ref, g, s):
    return None if torch.allclose(ref.side().scale, g.side().scale) else \
        f"step {s}: outside buffer differs"


for warmups in (1, 3):
    for shapes in [(8,), (8, 8), (8, 12), (12, 8)]:
        check(f"outside and own buffers written, num_warmup_iters={warmups} {shapes}",
              lambda: same_as_eager(*twins(OuterMixed, warm=(8, 12), num_warmup_iters=warmups),
                                    shapes, extra=side_same))


class TwiceWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("scale", torch.ones(16))

    def forward(self, x):
        self.scale.mul_(0.5)
        self.scale.add_(0.25)
        return self.lin(x) * self.scale


def twice():
    ref, g = twins(TwiceWrite, warm=(8, 12))
    d = same_as_eager(ref, g, (8, 8))
    if d:
        return d
    moves = []
    for m in (ref, g):
        v = m.scale._version
        m(randn(8)).sum().backward()
        m(randn(12)).sum().backward()
        moves.append(m.scale._version - v)
    return None if moves[0] == moves[1] else f"version moves: eager {moves[0]}, graphed {moves[1]}"


check("two writes per forward move the counter as eagerly", twice)


class Clamp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        with torch.no_grad():
            self.b.weight.clamp_(-0.2, 0.2)
        return self.b(torch.relu(self.a(x)))


for shapes in [(8, 8), (8, 12)]:
    check(f"trainable weight written through its stand-in {shapes}",
          lambda: same_as_eager(*twins(Clamp, warm=(8, 12)), shapes))
check("outside BatchNorm in eval mode", outer_bn(False))
for shapes in [(8,), (8, 12)]:
    check(f"plain tensor attribute written and saved, one forward per signature {shapes}",
          lambda: same_as_eager(*twins(PlainAcc, warm=(8, 12)), shapes, extra=same_acc))
check("fast path: graphed function, probe on", fast_installed(True, "auto"))
check("fast path: module, probe=False", fast_installed(False, False))
_ = cg
