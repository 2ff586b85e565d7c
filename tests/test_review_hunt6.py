"""Review hunt 6: silent wrong results in piecewise plans under changes users make between
calls (and inside the root's own eager code). CPU, on the simulated backend (``sim``); each
scenario runs a graphified model beside an eager twin (``copy.deepcopy`` before ``graphify``)
and compares outputs (and gradients, buffers) bitwise.

Finding F1 (fixed; its tests check the fix): the root's eager code grows a piece's output
in place (``y.resize_``, an ``out=`` of another size). In a piecewise plan the pieces chain in
the root's implicit region: a piece's output is handed on as an alias of its graph's static
output, without a clone. Growing it reallocates that storage (the graph's own memory moves
with it): later replays wrote the old address while the alias handed out read the new one (on
the double: "stale replay"; on a GPU: the previous call's values, silently). Region slots are
now checked as ``copy_outputs=False`` outputs were (``CapturedGraph.handed``): the moved
piece runs eagerly for good, with the reason.

The rest are controls that passed: a piece called twice in one forward (its first output kept),
pieces' outputs written in place by the root between pieces, kept across calls, viewed; a
data-dependent branch choosing which pieces run; a buffer the root writes between two calls of a
piece; weight changes (in place, new Parameter), hooks, a piece replaced or swapped, train/eval,
dropout p, a piece's forward replaced, requires_grad; training through pieces (gradients); a
piece shared by two roots (one ungraphified); the same changes while a piece's trial or the
plan's trial runs (kept or given back); layout changes of a chained output that keep its storage;
pieces writing arguments that alias each other.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg

pytestmark = pytest.mark.usefixtures("quiet")


def _twin(make, seed=0):
    torch.manual_seed(seed)
    ref = make().eval()
    g = cg.graphify(copy.deepcopy(ref))
    return g, ref


def _check(g, ref, xs, between=None):
    outs = []
    with torch.no_grad():
        for i, x in enumerate(xs):
            if between is not None:
                between(i, g, ref)
            a, b = g(x.clone()), ref(x.clone())
            assert torch.equal(a, b), f"call {i}: output differs from eager's"
            outs.append(a)
    return outs


class Lin(nn.Linear):
    pass


# -- S1: a piece called twice in one forward, the first output kept and read after the second
class TwiceKept(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        if y.sum().item() > 1e9:
            y = y * 2
        z = self.a(y)          # same piece, same shape: overwrites y's memory on replay
        return self.b(y + z)


def test_control_s1_piece_twice_first_output_kept(sim):
    g, ref = _twin(TwiceKept)
    _check(g, ref, [torch.randn(4, 8) for _ in range(6)])



# -- S2: piece output modified in place by root, then fed to another piece
class InPlaceBetween(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        if y.sum().item() > 1e9:
            y = y * 2
        y.add_(1)
        w = self.b(y)
        y.mul_(3)
        return self.b(y) + w


def test_control_s2_inplace_between(sim):
    g, ref = _twin(InPlaceBetween)
    _check(g, ref, [torch.randn(4, 8) for _ in range(6)])


# -- S3: root keeps a piece's output across calls
class Cache(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.cache = None

    def forward(self, x):
        y = self.a(x)
        if y.sum().item() > 1e9:
            y = y * 2
        prev = self.cache if self.cache is not None else torch.zeros_like(y)
        self.__dict__["cache"] = y
        return self.b(y) + prev


def test_control_s3_cache_across_calls(sim):
    g, ref = _twin(Cache)
    _check(g, ref, [torch.randn(4, 8) for _ in range(6)])


# -- S4: piece returns a view of its input
class ViewOut(nn.Module):
    def forward(self, x):
        return x[:, :4]


class ViewRoot(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.v, self.b = nn.Linear(8, 8), ViewOut(), nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        if y.sum().item() > 1e9:
            y = y * 2
        v = self.v(y)
        y.add_(1)
        y2 = self.a(x + 1)
        return self.b(v) + y2[:, :4] + v


def test_control_s4_view_of_input(sim):
    g, ref = _twin(ViewRoot)
    _check(g, ref, [torch.randn(4, 8) for _ in range(6)])


# -- S5: data-dependent branch which submodules run
class Branch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        if y.sum().item() > 0:
            y = self.b(y)
        else:
            y = self.c(y) + self.b(y)
        return self.a(y)


def test_control_s5_branch(sim):
    g, ref = _twin(Branch)
    _check(g, ref, [torch.randn(4, 8) * (1 if i % 3 else -1) for i in range(12)])


# -- S6: root mutates a buffer between pieces, piece reads it
class BufPiece(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("s", torch.zeros(8))

    def forward(self, x):
        return x + self.s


class BufRoot(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.p = nn.Linear(8, 8), BufPiece()

    def forward(self, x):
        y = self.a(x)
        if y.sum().item() > 1e9:
            y = y * 2
        self.p.s.add_(1)
        y1 = self.p(y)
        self.p.s.mul_(2)
        return self.p(y1)


def test_control_s6_buffer_between(sim):
    g, ref = _twin(BufRoot)
    _check(g, ref, [torch.randn(4, 8) for _ in range(6)])
    assert torch.equal(g.p.s, ref.p.s)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = 1.0
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        return self.drop(self.lin(x)) * self.scale


class Root2(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Scaled(), Scaled()

    def forward(self, x):
        y = self.a(x)
        if y.sum().item() > 1e9:
            y = y * 2
        return self.b(y)


def _changes(change):
    g, ref = _twin(Root2)
    xs = [torch.randn(4, 8) for _ in range(10)]

    def between(i, g, ref):
        if i in (4, 7):
            for m in (g, ref):
                change(m, i)
    _check(g, ref, xs, between)
    return g, ref


@pytest.mark.parametrize("name,change", [
    ("weight_inplace", lambda m, i: m.a.lin.weight.data.add_(1)),
    ("weight_new_param", lambda m, i: setattr(m.a.lin, "weight", nn.Parameter(m.a.lin.weight * 2))),
    ("scale", lambda m, i: setattr(m.b, "scale", float(i))),
    ("hook", lambda m, i: m.a.register_forward_hook(lambda mod, inp, out: out * 3)),
    ("hook_inner", lambda m, i: m.a.lin.register_forward_hook(lambda mod, inp, out: out * 3)),
    ("pre_hook", lambda m, i: m.b.register_forward_pre_hook(lambda mod, inp: (inp[0] + 1,))),
    ("replace", lambda m, i: (torch.manual_seed(i), setattr(m, "a", Scaled()))),
    ("swap", lambda m, i: (setattr(m, "a", m.b), setattr(m, "b", m.a))),
    ("train", lambda m, i: m.train() if i == 4 else m.eval()),
    ("dropout_p", lambda m, i: setattr(m.a.drop, "p", 0.5 if i == 4 else 0.0)),
    ("inner_replace", lambda m, i: (torch.manual_seed(i), setattr(m.a, "lin", nn.Linear(8, 8)))),
    ("double", lambda m, i: m.a.double() if False else m.a.lin.bias.data.zero_()),
    ("requires_grad", lambda m, i: m.a.lin.weight.requires_grad_(False)),
    ("forward_inst", lambda m, i: setattr(m.a, "forward", lambda x: x * 5)),
])
def test_control_changes(sim, name, change):
    _changes(change)


# -- training through pieces, gradients compared
def test_control_training_grads(sim):
    torch.manual_seed(0)
    ref = Root2().train()
    g = cg.graphify(copy.deepcopy(ref))
    og = torch.optim.SGD(g.parameters(), lr=0.1)
    orf = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(8):
        x = torch.randn(4, 8)
        if i == 5:
            for m in (g, ref):
                m.b.scale = 2.0
        for m, o in ((g, og), (ref, orf)):
            o.zero_grad()
            m(x).square().sum().backward()
        for (n, p), q in zip(g.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), (i, n)
        og.step(); orf.step()


class TwoShapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        n = 1 + int((y[0, 0] > 0).item())
        z = self.a(x[:n])
        w = self.a(y)
        return self.b(w)[:n] + z + y[:n]


def test_control_piece_two_shapes(sim):
    g, ref = _twin(TwoShapes)
    _check(g, ref, [torch.randn(4, 8) for _ in range(12)])


def test_control_piece_two_roots(sim):
    torch.manual_seed(0)
    r1, r2 = Root2().eval(), Root2().eval()
    r2.a = r1.a
    e1, e2 = copy.deepcopy((r1, r2))
    g1, g2 = cg.graphify(r1), cg.graphify(r2)
    with torch.no_grad():
        for i in range(10):
            x = torch.randn(4, 8)
            if i == 5:
                for m in (g1, e1):
                    m.a.lin.weight.add_(1)
                    m.a.scale = 3.0
            if i == 7:
                cg.ungraphify(g1)
            assert torch.equal(g1(x), e1(x)), i
            assert torch.equal(g2(x), e2(x)), i


# -- F1: the root grows a piece's output in place ------------------------------------------

class GrowsPieceOutput(nn.Module):
    """``a``'s output is grown by the root's eager code: 4x8 -> 8x8 (its storage reallocated)."""

    def __init__(self, how):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.how = how

    def forward(self, x):
        y = self.a(x)
        if y.sum().item() > 1e9:  # a host sync: the root runs piecewise, a and b are pieces
            y = y * 0
        if self.how == "resize_":
            y.resize_(8, 8)
            y[4:] = x
        elif self.how == "cat out=":
            torch.cat([y.clone(), x], out=y)  # an out= of another size: resize_ of y
        else:  # control: the same, out of place
            y = torch.cat([y, x])
        return self.b(y)


def _grows(how):
    torch.manual_seed(0)
    ref = GrowsPieceOutput(how).eval()
    g = cg.graphify(copy.deepcopy(ref))
    import warnings
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (cat out= warns that it resized)
        for i in range(6):
            x = torch.randn(4, 8)
            # (on the double a stale replay raises an AssertionError inside g(x); on a GPU the
            # output is last call's values)
            assert torch.equal(g(x), ref(x)), f"call {i}: output differs from eager's"
    return g


@pytest.mark.parametrize("how", ["resize_", "cat out="])
def test_f1_root_grows_a_pieces_output_in_place(sim, how):
    # (fixed: a region slot's memory is checked as a copy_outputs=False output's is; the piece
    # whose output moved runs eagerly from then on, with the reason)
    g = _grows(how)
    reasons = cg.stats(g.a).eager_calls
    assert any("resized in place" in r for r in reasons), reasons
    assert cg.stats(g.b).replays >= 3  # (its neighbour stays graphed)


def test_f1_control_grown_out_of_place(sim):
    g = _grows("out of place")
    assert cg.stats(g.a).replays >= 3  # the pieces did replay


def test_f1_control_copy_outputs_false_is_guarded(sim):
    # (the same growth of an output handed out without a copy, on a graphified Linear with
    # copy_outputs=False: detected, that signature runs eagerly)
    import warnings
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    f = cg.graphify(copy.deepcopy(lin), copy_outputs=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(3):
            f(torch.randn(4, 8))
        y = f(torch.randn(4, 8))
        y.resize_(8, 8)
        for _ in range(3):
            x = torch.randn(4, 8)
            assert torch.equal(f(x), lin(x))


# -- controls: changes between calls while pieces are timed (a piece's own trial, fake clock)
# or the plan is timed as a whole, with pieces kept (cheap graph) or given back (costly one);
# training through pieces with changes between steps, kept outputs, no_grad steps, new shapes
from test_trial import _COST, _Piece  # noqa: E402
from test_trial import timed  # noqa: E402,F401 (a fixture)
from test_review_plan import plan_timed  # noqa: E402,F401 (a fixture)
from test_trial import _COST, _Piece, _Root
from test_trial import timed  # noqa
from test_review_plan import plan_timed  # noqa


class Root3(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _Piece(8, 8), _Piece(8, 8)
        self.scale = 1.0

    def forward(self, x):
        y = self.a(x)
        if bool((y > -1e9).all()):
            y = y + 1
        return self.b(y) * self.scale


CH = {
    "weight": lambda m, i: m.a.weight.data.add_(0.5),
    "param": lambda m, i: setattr(m.a, "weight", nn.Parameter(m.a.weight * 2)),
    "hook": lambda m, i: m.b.register_forward_hook(lambda mod, inp, out: out * 3),
    "bias_none": lambda m, i: setattr(m.b, "bias", None),
    "train": lambda m, i: m.train(i % 2 == 0),
    "scale": lambda m, i: setattr(m, "scale", float(i)),
    "replace": lambda m, i: (torch.manual_seed(i), setattr(m, "a", _Piece(8, 8))),
    "fwd": lambda m, i: setattr(m.a, "forward", lambda x, _m=m.a: nn.Linear.forward(_m, x) * 2),
}


@pytest.mark.parametrize("fixture", ["timed", "plan_timed"])
@pytest.mark.parametrize("cost", [(30e-6, 10e-6), (1e-6, 50e-6)])
@pytest.mark.parametrize("name", list(CH))
@pytest.mark.parametrize("at", [2, 12])
def test_control_trial_changes(request, fixture, cost, name, at):
    request.getfixturevalue(fixture)
    _COST.update(graph=cost[0], eager=cost[1])
    torch.manual_seed(0)
    ref = Root3()
    g = cg.graphify(copy.deepcopy(ref))
    for i in range(20):
        if i in (at, at + 3):
            CH[name](g, i); CH[name](ref, i)
        for k in range(2 if i % 5 == 0 else 1):
            x = torch.randn(4 if k == 0 else 2, 8)
            assert torch.equal(g(x), ref(x)), i


class TRoot(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.n = nn.LayerNorm(8)

    def forward(self, x):
        y = self.a(x)
        if y.sum().item() > 1e9:
            y = y * 2
        return self.n(self.b(y) + y)


TCH = {
    "param": lambda m, i: setattr(m.a, "weight", nn.Parameter(m.a.weight.detach() * 2)),
    "freeze": lambda m, i: m.a.weight.requires_grad_(i % 2 == 0),
    "hook": lambda m, i: m.b.register_forward_hook(lambda mod, inp, out: out * 3),
    "grad_hook": lambda m, i: m.a.weight.register_hook(lambda g: g * 2),
    "eps": lambda m, i: setattr(m.n, "eps", 1e-2),
    "ln_weight_inplace": lambda m, i: m.n.weight.data.mul_(2),
    "nograd_step": None,
    "keep": None,
    "shape": None,
}


@pytest.mark.parametrize("name", list(TCH))
def test_control_training_changes(sim, name):
    torch.manual_seed(0)
    ref = TRoot().train()
    g = cg.graphify(copy.deepcopy(ref))
    kept = []
    for i in range(12):
        if i in (4, 8) and TCH[name] is not None:
            TCH[name](g, i); TCH[name](ref, i)
        x = torch.randn(2 if (name == "shape" and i % 3 == 0) else 4, 8)
        if name == "nograd_step" and i % 3 == 0:
            with torch.no_grad():
                assert torch.equal(g(x), ref(x)), i
            continue
        grads = []
        for m in (g, ref):
            for p in m.parameters():
                p.grad = None
            out = m(x)
            if name == "keep" and i % 4 == 1:
                kept.append(out)
                grads.append(out.detach())
                continue
            out.square().sum().backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in m.parameters()] + [out.detach()])
        if isinstance(grads[0], list):
            for p, q in zip(*grads):
                assert (p is None and q is None) or torch.equal(p, q), i
        else:
            assert torch.equal(grads[0], grads[1]), i


# -- controls: a piece's chained output changed in layout by the root before another piece
# reads it (no reallocation), and pieces that write arguments aliasing each other or a weight

class _W2(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, a, b):
        a.add_(1)
        return self.lin(a + b)


class _Layouts(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.w2 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), _W2()
        self.mode = 0

    def forward(self, x):
        y = self.a(x)
        if x.sum().item() > 1e9:
            y = y * 2
        m = self.mode
        if m == 1:
            y.t_()
        elif m == 2:
            y.as_strided_((8, 8), (1, 8))
        elif m == 3:
            y.set_(y.untyped_storage(), 0, (8, 8), (1, 8))
        elif m == 4:
            y.resize_(4, 8)  # (shrinks: the storage stays)
        elif m == 5:
            return self.b(self.w2(y, y)) + y
        elif m == 6:
            return self.b(self.w2(y, self.w2.lin.weight)) + y
        elif m == 7:
            c = self.c(x)
            return self.b(self.w2(c, c.view(8, 8))) + y
        return self.b(y) + y


@pytest.mark.parametrize("modes", [[0] * 3 + [m] * 3 + [0] * 2 for m in range(1, 8)]
                         + [[m] * 3 + [0] * 3 for m in range(1, 8)])
def test_control_layout_and_alias_changes_of_chained_outputs(sim, modes):
    torch.manual_seed(0)
    ref = _Layouts().eval()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i, m in enumerate(modes):
            g.mode = ref.mode = m
            x = torch.randn(8, 8)
            assert torch.equal(g(x.clone()), ref(x.clone())), i
    assert torch.equal(g.w2.lin.weight, ref.w2.lin.weight)
