"""Controls: expected PASS on 2661480 (several FAIL on 380d851: F4/F4b of the first review)."""
from common import DEV, Scaled, check, cg, nn, same_as_eager, torch, twins


class DataWrite(Scaled):
    def forward(self, x):
        self.scale.data.mul_(0.5)
        return self.lin(x) * self.scale


class DetachWrite(Scaled):
    def forward(self, x):
        self.scale.detach().mul_(0.5)
        return self.lin(x) * self.scale


class FrozenWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.fz = nn.Parameter(torch.ones(16), requires_grad=False)

    def forward(self, x):
        with torch.no_grad():
            self.fz.mul_(0.5)
        return self.lin(x) * self.fz


class Clamp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        with torch.no_grad():
            self.b.weight.clamp_(-0.2, 0.2)
        return self.b(torch.relu(self.a(x)))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Scaled(), Scaled()
        self.b.scale = self.a.scale

    def forward(self, x):
        return self.b(self.a(x))


def bn(train):
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(),
                             nn.Linear(32, 16)).train(train)
    return make


for shapes in [(8,), (8, 8), (8, 12), (12, 8), (8, 8, 8)]:
    check(f"written then saved in one forward {shapes}",
          lambda: same_as_eager(*twins(Scaled, warm=(8, 12)), shapes))
    check(f"num_warmup_iters=3 {shapes}",
          lambda: same_as_eager(*twins(Scaled, warm=(8, 12), num_warmup_iters=3), shapes))
for name, make in [("data", DataWrite), ("detach", DetachWrite), ("frozen", FrozenWrite),
                   ("clamp", Clamp), ("tied", Tied)]:
    for shapes in [(8,), (8, 8), (8, 12)]:
        check(f"{name} write {shapes}",
              lambda: same_as_eager(*twins(make, warm=(8, 12)), shapes))
for train in (True, False):
    for shapes in [(8,), (8, 8), (8, 8, 8), (8, 12)]:
        check(f"batchnorm train={train} {shapes}",
              lambda: same_as_eager(*twins(bn(train), warm=(8, 12)), shapes, steps=4))


def _fresh(m):
    m.scale = m.scale.clone()


check("buffer rebound to new memory, twins",
      lambda: same_as_eager(*twins(Scaled, prep=_fresh), (8, 8)))
check("load_state_dict(assign=True), twins",
      lambda: same_as_eager(*twins(Scaled, prep=lambda m: m.load_state_dict(
          m.state_dict(), assign=True)), (8, 8)))
check("first-call-only write, order that agrees",
      lambda: same_as_eager(*twins(lambda: __import__("common").FirstCallWrites("scale"),
                                   warm=(8, 12), warm_backward=False), (8, 12)))
_ = (DEV, cg)
