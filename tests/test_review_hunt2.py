"""Review hunt 2: silent differences from eager in graph_region, copy_outputs=False and aliases,
share_graph after user changes, capture_sizes / bucketed after model changes.

No silent wrong result was found in the areas tried. The one finding is loud: a strict xfail
below. The controls are the scenarios tried, kept as plain tests (eager twins, bitwise).
GPU-only behaviours (streams): .ci/review/hunt2/.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch
from torch import nn

import cudagraphify as cg
from test_share_engine import _distinct, _register, reading  # noqa: F401  (fixture)


# -- share_graph -----------------------------------------------------------------------------

class _Layer(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.scale = 1.0
        self.flag = False

    def forward(self, x):
        y = self.norm(self.lin(x)) * self.scale + x
        return y * 2 if self.flag else y


class _Stack(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _shared():
    torch.manual_seed(0)
    ref = _distinct(_Stack().eval())
    model = copy.deepcopy(ref)
    _register(model)
    return ref, model, cg.share_graph(model.layers)


def _same(model, ref, n=3):
    with torch.no_grad():
        for _ in range(n):
            x = torch.randn(2, 8)
            assert torch.equal(model(x), ref(x))


def test_deepcopy_of_shared_layers(sim):
    # (was a finding, loud: TypeError, cannot pickle '_thread.RLock' object: the layers' Share
    # was copied with its group; a copied layer is in no group now, graphified on its own)
    from cudagraphify._wrap import share_of
    torch.manual_seed(0)
    ref = _Stack().eval()
    model = copy.deepcopy(ref)
    cg.share_graph(model.layers)
    _same(model, ref)
    twin = copy.deepcopy(model)
    assert all(share_of(layer) is None for layer in twin.layers)
    assert all(share_of(layer) is not None for layer in model.layers)
    _same(twin, ref)
    with torch.no_grad():  # (its own weights: the original's graphs do not follow them)
        for layer in twin.layers:
            layer.lin.weight.mul_(2)
        x = torch.randn(2, 8)
        assert torch.equal(model(x), ref(x))
        for layer in ref.layers:
            layer.lin.weight.mul_(2)
        assert torch.equal(twin(x), ref(x))


@pytest.mark.parametrize("change", ["reverse", "swap", "delete", "load", "tie"])
def test_control_share_graph_after_layers_change(reading, change):
    ref, model, _ = _shared()
    _same(model, ref)
    loaded = {k: v + 0.5 for k, v in ref.state_dict().items()}
    for m in (ref, model):
        layers = list(m.layers)
        if change == "reverse":
            m.layers = nn.ModuleList(reversed(layers))
        elif change == "swap":
            layers[0], layers[2] = layers[2], layers[0]
            m.layers = nn.ModuleList(layers)
        elif change == "delete":
            del m.layers[1]
        elif change == "load":
            m.load_state_dict(loaded)
        elif change == "tie":
            m.layers[2].lin.weight = m.layers[0].lin.weight
    _same(model, ref)
    with torch.no_grad():
        for m in (ref, model):
            m.layers[0].lin.weight.add_(1.0)
    _same(model, ref)


@pytest.mark.parametrize("i", [0, 1])
@pytest.mark.parametrize("attr,val", [("scale", 3.0), ("flag", True)])
def test_control_share_graph_attribute_of_template_or_other_layer(reading, i, attr, val):
    ref, model, _ = _shared()
    _same(model, ref)
    for m in (ref, model):
        setattr(m.layers[i], attr, val)
    _same(model, ref)
    for m in (ref, model):
        setattr(m.layers[i], attr, getattr(_Layer(), attr))
    _same(model, ref)


def test_control_share_graph_parameters_moved_into_one_flat_buffer(reading):
    ref, model, _ = _shared()
    _same(model, ref)
    ps = [p for i in (1, 2) for p in model.layers[i].parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in ps])
    o = 0
    for p in ps:
        p.data = flat[o:o + p.numel()].view_as(p)
        o += p.numel()
    _register(model)
    _same(model, ref)


# -- graph_region ----------------------------------------------------------------------------

class _Raises(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[-1] != 4:
            raise ValueError("bad width")
        return torch.relu(self.lin(x))


def _pair():
    torch.manual_seed(0)
    a, b = _Raises().eval(), _Raises().eval()
    ra, rb = copy.deepcopy(a), copy.deepcopy(b)
    return cg.graphify(a), cg.graphify(b), ra, rb


def test_control_region_left_by_an_exception_keeps_held_outputs(sim):
    a, b, ra, rb = _pair()
    kept, rkept = [], []
    with torch.no_grad():
        for it in range(4):
            with contextlib.suppress(ValueError), cg.graph_region():
                for _ in range(3):
                    x = torch.randn(2, 4)
                    kept.append(a(x))
                    rkept.append(ra(x))
                    kept.append(b(kept[-1]))
                    rkept.append(rb(rkept[-1]))
                if it % 2:
                    b(torch.randn(2, 5))
            assert all(torch.equal(k, r) for k, r in zip(kept, rkept))
        x = torch.randn(2, 4)
        assert torch.equal(b(a(x)), rb(ra(x)))
    assert all(torch.equal(k, r) for k, r in zip(kept, rkept))


def test_control_nested_and_disabled_regions_and_in_place_on_aliases(sim):
    a, b, ra, rb = _pair()
    kept, rkept = [], []
    with torch.no_grad():
        for _ in range(4):
            with cg.graph_region():
                x = torch.randn(2, 4)
                y, ry = a(x), ra(x)
                y.mul_(2)
                ry.mul_(2)
                with cg.graph_region():
                    z, rz = b(y), rb(ry)
                    with cg.graph_region(enabled=False):
                        w, rw = a(z), ra(rz)
                v, rv = a(y), ra(ry)
                kept += [y, z, w, v]
                rkept += [ry, rz, rw, rv]
            assert all(torch.equal(k, r) for k, r in zip(kept, rkept))


# -- outputs ---------------------------------------------------------------------------------

@dataclasses.dataclass
class _Out:
    y: torch.Tensor


class _Returns(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("buf", torch.zeros(2, 4))
        self.how = how

    def forward(self, x):
        y = self.lin(x)
        if self.how == "dataclass":
            return _Out(y), y
        if self.how == "buffer":
            return y, self.buf
        if self.how == "written_buffer_view":
            self.buf.add_(y)
            return y, self.buf[1]
        return y, self.lin.weight.t()


@pytest.mark.parametrize("mode", ["copy", "nocopy", "region"])
@pytest.mark.parametrize("how", ["dataclass", "buffer", "written_buffer_view", "weight_t"])
def test_control_outputs_aliasing_state_mutated_by_the_caller(sim, how, mode):
    torch.manual_seed(0)
    m = _Returns(how).eval()
    r = copy.deepcopy(m)
    cg.graphify(m, copy_outputs=mode != "nocopy")
    with torch.no_grad():
        for _ in range(5):
            with cg.graph_region() if mode == "region" else contextlib.nullcontext():
                x = torch.randn(2, 4)
                (o, b), (ro, rb) = m(x), r(x)
                if how == "dataclass":
                    o, ro = o.y, ro.y
                assert torch.equal(o, ro) and torch.equal(b, rb)
                b.add_(1.0)
                rb.add_(1.0)
                for p, q in zip([*m.parameters(), *m.buffers()], [*r.parameters(), *r.buffers()]):
                    assert torch.equal(p, q)


# -- capture_sizes / bucketed ----------------------------------------------------------------

class _Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.k = 1.0

    def forward(self, x):
        return self.bn(self.lin(x)) * self.k


@pytest.mark.parametrize("change", ["load", "load_assign", "train_eval", "attr", "half_back",
                                    "requires_grad"])
@pytest.mark.parametrize("buck", [False, True])
def test_control_capture_sizes_and_bucketed_after_the_model_changed(sim, change, buck):
    torch.manual_seed(0)
    m = _Norm().eval()
    r = copy.deepcopy(m)
    cg.graphify(m, max_graphs=16)
    sizes = [1, 2, 4, 8]
    with torch.no_grad():
        for _ in range(2):
            cg.capture_sizes(m, lambda n: torch.randn(n, 8), sizes, progress=False)
    call = cg.bucketed(m, sizes) if buck else m

    def same():
        with torch.no_grad():
            for n in (1, 2, 3, 5, 8):
                for _ in range(2):
                    x = torch.randn(n, 8)
                    if buck:
                        torch.testing.assert_close(call(x), r(x))
                    else:
                        assert torch.equal(call(x), r(x))
        for p, q in zip(m.state_dict().values(), r.state_dict().values()):
            assert torch.equal(p, q)

    same()
    sd = {k: v * 1.3 if v.is_floating_point() else v for k, v in r.state_dict().items()}
    xin = torch.randn(4, 8)
    for x in (m, r):
        if change == "load":
            x.load_state_dict(sd)
        elif change == "load_assign":
            x.load_state_dict({k: v.clone() for k, v in sd.items()}, assign=True)
        elif change == "train_eval":
            x.train()
            with torch.no_grad():
                x(xin)
            x.eval()
        elif change == "attr":
            x.k = 2.0
        elif change == "half_back":
            x.half().float()
        else:
            x.lin.weight.requires_grad_(False)
    same()
