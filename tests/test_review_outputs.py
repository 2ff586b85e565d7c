"""Review 13: how outputs are handed back and what persists between calls (7558124..HEAD and
the working tree's inline ``Fast.call`` outputs).

CPU tests on the simulated backend (tests/conftest.py). Each finding is an xfail(strict=True)
test comparing with eager bitwise; controls are plain tests. Counters (replays, captures) prove
the graphed path was taken. GPU reproductions: .device/review13/."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _fast


def _replayed(f, n):
    s = cg.stats(f)
    assert s.captures == 1 and s.replays == n and not s.eager_calls, s


# -- F1: an overlapping (expanded) argument returned, or a view of it ------------------------

def _returns_expanded_arg(x):
    return x, x[0], x * 2


def test_f1_an_expanded_argument_or_a_view_of_it_returned_runs_eagerly(sim, quiet):
    # finding F1: an expanded argument returned by forward came back as a contiguous copy (not
    # the caller's tensor, other strides); a view of it cannot be rebuilt on the caller's
    # tensor from the graph's compact copy: that signature runs eagerly
    f = cg.graphify(_returns_expanded_arg)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, 1).expand(3, 4)
            out = f(x)
    want = _returns_expanded_arg(x)
    assert all(torch.equal(o, w) for o, w in zip(out, want))
    assert out[1].stride() == want[1].stride() == (0,)  # a view of the caller's row
    assert out[1].data_ptr() == x.data_ptr()
    assert out[0] is x  # README: "an argument returned by forward comes back as the object"
    assert cg.stats(f).replays == 0
    assert "overlaps itself" in next(iter(cg.stats(f).eager_calls))


def test_f1_control_a_non_overlapping_argument_and_its_views_come_back_on_it(sim):
    f = cg.graphify(_returns_expanded_arg)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 6)[:, ::2]  # gaps, no overlap: same layout buffer
            out = f(x)
    _replayed(f, 3)
    want = _returns_expanded_arg(x)
    assert out[0] is x and out[1]._base is x.__getattribute__("_base")
    assert out[1].stride() == want[1].stride() and out[1].data_ptr() == x.data_ptr()
    assert all(torch.equal(o, w) for o, w in zip(out, want))


# -- F2: outputs on graph memory, cloned one by one -----------------------------------------

def _views_of_one_result(x):
    y = x * 2
    return y, y[0], y[:, ::2], y.expand(2, 3, 4)


# (finding F2a, fixed: outputs that are views of one another came back as independent clones,
# a write through one not seen in the other; F2b, fixed: a non-dense or expanded output came
# back contiguous, a clone, not with eager's strides)
def test_f2ab_outputs_that_view_one_another_stay_aliased_with_eagers_strides(sim):
    f = cg.graphify(_views_of_one_result)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, 4)
            out = f(x)
        want = _views_of_one_result(x)
        assert all(torch.equal(o, w) for o, w in zip(out, want))
        assert [o.stride() for o in out] == [w.stride() for w in want]  # (8, 2), (0, 4, 1)
        out[0].add_(1)
        want[0].add_(1)
    _replayed(f, 3)
    assert torch.equal(out[1], want[1])  # eager: out[1] is a view of out[0]


def _conj_views(z):
    y = z * 2
    return y.conj(), y.conj().imag


# (finding F2c, fixed: a conj (neg) view output comes back with its bit resolved (clone), and
# .imag with other strides)
def test_f2c_conj_and_neg_bits_of_outputs_are_kept(sim):
    f = cg.graphify(_conj_views)
    with torch.no_grad():
        for _ in range(4):
            z = torch.randn(3, dtype=torch.complex64)
            out = f(z)
    _replayed(f, 3)
    want = _conj_views(z)
    assert all(torch.equal(o, w) for o, w in zip(out, want))
    assert out[0].is_conj() and out[1].is_neg() and out[1].stride() == want[1].stride()


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y, y, y[0]


class _TwiceNoView(_Twice):
    def forward(self, x):
        y = self.lin(x)
        return y, y, y * 2


def _train_calls(cls, calls: int = 4):
    """``calls`` grad-mode calls of a graphified ``cls`` with a backward each: (graphed, last
    outputs, eager's outputs for the last input)."""
    torch.manual_seed(0)
    ref = cls()
    g = cg.graphify(copy.deepcopy(ref))
    for _ in range(calls):
        x = torch.randn(3, 4, requires_grad=True)
        out = g(x)
        assert out[0] is out[1]  # eager: one object (finding F2d: two, from a training graph)
        (out[0].sum() + out[2].sum()).backward()
    want = ref(x)
    assert all(torch.equal(o, w) for o, w in zip(out, want))
    return g, out


def test_f2d_training_outputs_twice_replayed_as_one_object(sim):
    g, _ = _train_calls(_TwiceNoView)
    assert cg.stats(g).replays == 3


def test_f2d_training_outputs_that_view_one_another_run_eagerly(sim, quiet):
    # (a view of an output, a separate clone on replay: that signature runs eagerly)
    g, out = _train_calls(_Twice)
    assert out[2]._base is out[0]
    assert cg.stats(g).replays == 0
    assert any("share memory" in r for r in cg.stats(g).eager_calls)


class _Piecewise(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.b = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

    def forward(self, x):
        h = self.a(x)
        h.sum().item()  # refused: the root is piecewise
        return self.b(h)[:, ::2]


# (finding F2e, fixed: a piecewise root's output on a piece's memory is copied with clone()
# (owned_outputs): eager's strides are lost)
def piecewise_calls(cls):
    """Five no_grad calls of a graphified ``cls`` (a piecewise root): (its last outputs,
    eager's, graphed)."""
    torch.manual_seed(0)
    ref = cls().eval()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(3, 8)
            out, want = g(x), ref(x)
    assert cg.stats(g.b).replays > 0
    return out, want, g


def test_f2e_piecewise_root_output_keeps_its_strides(sim, quiet):
    out, want, _ = piecewise_calls(_Piecewise)
    assert torch.equal(out, want)
    assert out.stride() == want.stride()  # eager (8, 2)


def test_f2_control_zero_copy_outputs_alias_as_eagers(sim):
    f = cg.graphify(_views_of_one_result, copy_outputs=False)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, 4)
            out = f(x)
    _replayed(f, 3)
    want = _views_of_one_result(x)
    assert [o.stride() for o in out] == [w.stride() for w in want]
    assert all(torch.equal(o, w) for o, w in zip(out, want))
    with torch.no_grad():
        out[0].add_(1)
    assert torch.equal(out[1], want[1] + 1)  # views of the same memory


class _Statics(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))
        self.register_buffer("b", torch.randn(4))

    def forward(self, x):
        return self.w[0], self.b, self.w.t(), self.b.view(2, 2), x + self.b


def test_f2_control_views_of_parameters_and_buffers_are_views_of_them(sim):
    m = cg.graphify(_Statics())
    with torch.no_grad():
        for _ in range(4):
            out = m(torch.randn(4))
    _replayed(m, 3)
    assert out[0]._base is m.w and out[1] is m.b and out[2]._base is m.w
    assert out[3]._base is m.b and out[2].stride() == (1, 4)
    v = m.b._version
    with torch.no_grad():
        out[3].add_(1)
    assert m.b._version == v + 1 and torch.equal(out[1], m.b)


def _lin(**options):
    """A Linear(3, 5) and a graphified copy of it."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 5)
    return lin, cg.graphify(copy.deepcopy(lin), **options)


# -- F3: a region alias moved to a copy lost the caller's in-place metadata change ---------
# (Slot.protect moved it with set_(clone of the slot tensor): a t_()/unsqueeze_() was undone)

@pytest.mark.parametrize("how", ["t_", "unsqueeze_"])
def test_f3_a_moved_region_alias_keeps_the_callers_layout(sim, how):
    lin, f = _lin()
    xs = [torch.randn(2, 3) for _ in range(5)]
    with torch.no_grad(), cg.graph_region() as region:
        for x in xs[:3]:
            f(x)
        y = f(xs[3])
        want = lin(xs[3])
        getattr(y, how)(0) if how == "unsqueeze_" else y.t_()
        getattr(want, how)(0) if how == "unsqueeze_" else want.t_()
        f(xs[4])  # overwrites the slot: y is moved to a copy first
        assert region.stats().moved_outputs == 1
    assert cg.stats(f).replays >= 3
    assert y.shape == want.shape and y.stride() == want.stride()
    assert torch.equal(y, want)


def test_f3_control_a_moved_region_alias_keeps_its_values(sim):
    lin, f = _lin()
    xs = [torch.randn(2, 3) for _ in range(6)]
    with torch.no_grad(), cg.graph_region() as region:
        for x in xs[:3]:
            f(x)
        assert type(f._cudagraphify_state._fast) is _fast.Fast  # the inline slot hand-out
        kept = [f(x) for x in xs[3:]]
        assert region.stats().moved_outputs == 2
        s = region.stats()
    for y, x in zip(kept, xs[3:]):
        assert torch.equal(y, lin(x))
    # (in a region the first call replays too, to hand out an alias)
    assert s.replays == 6 and s.input_copies == s.replays, s


# -- F4: copy_outputs=False output resized by the caller ------------------------------------

# (finding F4, fixed: the out= moved the static output's storage, later replays wrote the old
# memory and every later output read the caller's; now that signature runs eagerly)
def test_f4_zero_copy_output_resized_by_the_caller(sim):
    lin, f = _lin(copy_outputs=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(3):
            f(torch.randn(2, 3))
        y = f(torch.randn(2, 3))
        torch.mul(torch.ones(40), 7, out=y)  # an out= of another size: resize_ of y
        x = torch.randn(2, 3)
        z = f(x)
        assert torch.equal(z, lin(x))
        assert y.shape == (40,) and torch.equal(y, torch.full((40,), 7.0))
        assert torch.equal(f(x), lin(x))
    assert any("resized in place" in r for r in cg.stats(f).eager_calls)


# -- F5: region aliases share one version counter -------------------------------------------

class _Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 5)
        self.lin.requires_grad_(False)

    def forward(self, x):
        return self.lin(x)


def test_f5_an_earlier_outputs_write_does_not_bump_a_later_outputs_version(sim):
    # (fixed: a region slot's alias is its ``.data``, with a version counter of its own, as
    # eager's output has; it had been a ``detach()``, sharing one counter with every alias)
    torch.manual_seed(0)
    m = cg.graphify(_Frozen())
    w = torch.randn(5, requires_grad=True)
    with cg.graph_region():
        for _ in range(3):
            m(torch.randn(2, 3))
        y1 = m(torch.randn(2, 3))
        y2 = m(torch.randn(2, 3))  # y1 moved to a copy
        loss = (w * y2).sum()  # saves y2
        with torch.no_grad():
            y1.add_(1)  # eager: y1 and y2 are unrelated tensors
        assert y2._version == 0
        loss.backward()
    assert cg.stats(m).replays == 5  # (the capture's call replays too)


# -- F6: a forward that changes its argument's metadata in place ----------------------------

def _meta(how):
    def g(x):
        if how == "t_":
            x.t_()
        elif how == "unsqueeze_":
            x.unsqueeze_(0)
        elif how == "requires_grad_":
            x.requires_grad_(False)
        else:
            x.tag = "seen"
        return x * 2
    return g


@pytest.mark.parametrize("how", ["t_", "unsqueeze_", "requires_grad_", "attribute"])
def test_f6_forward_changing_its_arguments_metadata_matches_eager(sim, quiet, how):
    g = _meta(how)
    f = cg.graphify(g)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, 4, requires_grad=how == "requires_grad_")
            mine = x.detach().clone().requires_grad_(x.requires_grad)
            out, want = f(x), g(mine)
            assert x.shape == mine.shape and x.stride() == mine.stride()
            assert x.requires_grad == mine.requires_grad
            assert getattr(x, "tag", None) == getattr(mine, "tag", None)
            assert out.shape == want.shape and torch.equal(out, want)
    # (was graphed: replays changed neither the caller's tensor nor returned eager's result;
    # now every call runs eagerly, with the reason)
    s = cg.stats(f)
    assert s.replays == 0 and s.captures == 0
    assert "requires_grad or attributes" in next(iter(s.eager_calls))
