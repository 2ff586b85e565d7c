"""Hunt 7 controls on the device: parametrizations, spectral norm, LoRA-style toggles, norm
flags, indirect reads; every [control] line should PASS (each proves a replay first)."""
import torch
import torch.nn.utils.parametrize as P
from torch import nn
from torch.nn.utils import parametrizations as PZ

from common import check, finish, scenario, skip_without_cuda

skip_without_cuda("b_controls")
H = 64


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = 2.0
        self.register_buffer("b", torch.tensor([1.5]))

    def forward(self, w):
        return w * self.s + self.b


def parametrized():
    m = nn.Sequential(nn.Linear(H, H), nn.ReLU(), nn.Linear(H, H))
    P.register_parametrization(m[0], "weight", Scale())
    return m


def sn():
    m = nn.Sequential(nn.Linear(H, H), nn.ReLU(), nn.Linear(H, H))
    PZ.spectral_norm(m[0])
    return m


class Lora(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(H, H)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(H, 4, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(4, H, bias=False)})
        self.scaling = {"default": 2.0}
        self.active = ["default"]
        self.disabled = False

    def forward(self, x):
        r = self.base(x)
        if self.disabled:
            return r
        for a in self.active:
            r = r + self.lora_B[a](self.lora_A[a](x)) * self.scaling[a]
        return r


cases = [
    ("parametrization attribute", parametrized,
     lambda m: setattr(m[0].parametrizations.weight[0], "s", 3.0), {}),
    ("parametrization buffer in place", parametrized,
     lambda m: m[0].parametrizations.weight[0].b.fill_(0.25), {}),
    ("parametrization removed", parametrized,
     lambda m: P.remove_parametrizations(m[0], "weight"), {"fresh": True}),
    ("spectral_norm train -> eval", sn, lambda m: m.eval(), {"train": True}),
    ("spectral_norm eval -> train", sn, lambda m: m.train(), {}),
    ("lora scaling dict", Lora, lambda m: m.scaling.__setitem__("default", 4.0), {}),
    ("lora disabled", Lora, lambda m: setattr(m, "disabled", True), {}),
    ("lora merged in place", Lora, lambda m: m.base.weight.data.add_(0.5), {}),
    ("batchnorm momentum (train)", lambda: nn.Sequential(nn.Linear(H, H), nn.BatchNorm1d(H)),
     lambda m: setattr(m[1], "momentum", 0.5), {"train": True}),
    ("batchnorm eps", lambda: nn.Sequential(nn.Linear(H, H), nn.BatchNorm1d(H)),
     lambda m: setattr(m[1], "eps", 0.5), {}),
    ("layernorm eps", lambda: nn.Sequential(nn.Linear(H, H), nn.LayerNorm(H)),
     lambda m: setattr(m[1], "eps", 0.5), {}),
]
for name, make, change, kw in cases:
    ok, why, _ = scenario(make, change, **kw)
    check(ok, f"[control] {name}", why)

finish("b_controls")
