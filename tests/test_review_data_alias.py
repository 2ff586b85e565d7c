"""Review 18: 3abfc0c (aliases of graph memory made with ``.data``), a432bc4 (retired pieces: six
findings fixed) and 87871e5 (pieces logic moved from _engine to _pieces).

CPU tests on the simulated backend (tests/conftest.py ``sim``) and test_trial's fake clocks. A
test that fails shows a bug (each one passes on the commit before the change it names, where
that is said); ``test_control_...`` tests are checks found right. GPU reproductions:
.device/review18/.

D1-D3 (3abfc0c): ``.data`` gives each alias a version counter of its own. Eager's outputs that
view one another share one counter (a view shares its base's), and so does a view of a buffer
with the buffer: autograd's "modified by an inplace operation" check, which eager raises, is
then silently skipped and the backward uses the modified values (a wrong gradient, no error).
With ``detach()`` (before 3abfc0c) each static tensor's alias shared the static's counter, and
views of one static output shared it, as eager's do.

R7-R8 (a432bc4): an outer graph's StateGuard no longer sees two real changes of a module it
ran: a piece's forward replaced by another piece's plan wrapper (``_guards._forward_of``
reduces every plan wrapper with ``had_own=False`` to None, whoever owns it), and a call
override that is the bound ``_call_impl`` of another module (``_watch.own_call_impl`` takes any
bound ``nn.Module._call_impl`` for cudagraphify's own). The outer graph replays stale.

P1 (older than these commits, found probing inference tensors): under ``inference_mode`` a
held region or chain output cannot be moved, so the call runs eagerly.

All six fixed in the commit after this file's: ``.data`` only for an output that no other
output of its call shares memory with (``lone``; else ``detach()``, sharing the counter as
eager's views do); segments hand out ``detach()`` again; ``_forward_of`` reduces a piece's own
wrapper only; a retired piece holds a ``_watch.PlainCall`` (a marked partial of
``_call_impl``); ``Slot.protect`` keeps no version of an inference tensor.
"""

from __future__ import annotations

import copy
import functools
import itertools
import warnings

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import cudagraphify as cg
from cudagraphify import _pieces, _watch, _wrap
from test_trial import _COST, _Root, _run
from test_trial import timed  # noqa: F401 (a fixture)



class _TwoViews(nn.Module):
    """Returns an output and a view of it (``logits, logits[:, -1]`` in a decode step)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)

    def forward(self, x):
        y = self.lin(x)
        return y, y[0]


def _saved_then_written(m, region: bool):
    """``y0`` saved by autograd, then ``y`` (whose view it is) written in place: eager's backward
    raises. Returns (y0's version before, after, what backward did)."""
    w = torch.randn(4, requires_grad=True)
    ctx = cg.graph_region() if region else warnings.catch_warnings()
    with ctx:
        with torch.no_grad():
            for _ in range(3):
                m(torch.randn(2, 3))
            y, y0 = m(torch.randn(2, 3))
        loss = (w * y0).sum()  # saves y0
        before = y0._version
        with torch.no_grad():
            y.add_(1)  # eager: y0 is a view of y, its version moves too
        after = y0._version
        try:
            loss.backward()
            did = "ran"
        except RuntimeError as e:
            did = "raised" if "modified by an inplace operation" in str(e) else repr(e)
    return before, after, did


def test_control_eager_raises_for_a_written_view_that_backward_saved():
    torch.manual_seed(0)
    assert _saved_then_written(_TwoViews(), region=False) == (0, 1, "raised")


def test_control_copied_outputs_that_view_one_another_share_a_counter(sim):
    torch.manual_seed(0)
    m = cg.graphify(_TwoViews())
    before, after, did = _saved_then_written(m, region=False)
    assert (after - before, did) == (1, "raised")
    assert cg.stats(m).replays == 3


# -- D1: copy_outputs=False ------------------------------------------------------------------

def test_D1_nocopy_outputs_that_view_one_another_share_eagers_version_counter(sim):
    """``_replay.static_output``: each output is ``t.data`` of its own static tensor, so ``y0``
    (a view of ``y`` in eager) gets a counter of its own: ``y.add_(1)`` leaves it at 0 and a
    backward that saved ``y0`` silently computes with the written values (w.grad = y0 + 1).
    Passes on 3abfc0c^ (``detach()``: both aliases shared the static base's counter).
    Fix: hand out the outputs of one storage as views of one ``.data`` alias per call (as the
    copy path's ``rebuild`` does), e.g. ``base = root.data`` then ``base.as_strided(...)``."""
    torch.manual_seed(0)
    m = cg.graphify(_TwoViews(), copy_outputs=False)
    before, after, did = _saved_then_written(m, region=False)
    assert cg.stats(m).replays == 3  # (graphed: the calls replayed)
    assert (after - before, did) == (1, "raised"), "backward used y0 after a write through y"


# -- D2: graph_region slots ------------------------------------------------------------------

def test_D2_region_outputs_that_view_one_another_share_eagers_version_counter(sim):
    """``_region.Slot.hand_out`` (and ``_fast.Fast.call``'s inline copy): one ``.data`` per
    slot, the same as D1 inside a region. Passes on 3abfc0c^."""
    torch.manual_seed(0)
    m = cg.graphify(_TwoViews())
    before, after, did = _saved_then_written(m, region=True)
    assert cg.stats(m).replays >= 3
    assert (after - before, did) == (1, "raised"), "backward used y0 after a write through y"


# -- D3: segments hand out a view of a buffer with a counter of its own ----------------------

class _Accumulates(nn.Module):
    """Takes a view of its buffer in a graphed run of calls; writes through it on some calls
    (decided on the host)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("acc", torch.zeros(8))

    def forward(self, x):
        h = self.lin(x).relu()
        v = self.acc.view(-1)  # a segment member: a view of a buffer
        h = h * 2
        if x.sum().item() > 1000:  # a host sync: a boundary
            v.add_(1)  # refused (in place), runs eagerly on the handed alias
        return h * 3 + 1


def _accumulate(m):
    w = torch.randn(8, requires_grad=True)
    with torch.no_grad():
        for _ in range(4):
            m(torch.randn(2, 8))
    before = m.acc._version
    loss = (w * m.acc).sum()  # saves the buffer
    with torch.no_grad():
        m(torch.full((2, 8), 100.0))  # writes it through the view
    after = m.acc._version
    try:
        loss.backward()
        did = "ran"
    except RuntimeError as e:
        did = "raised" if "modified by an inplace operation" in str(e) else repr(e)
    return after - before, did


def test_control_eager_write_through_a_view_bumps_the_buffer():
    torch.manual_seed(0)
    assert _accumulate(_Accumulates().eval()) == (1, "raised")


def test_D3_segments_write_through_a_handed_view_of_a_buffer_bumps_its_version(
        sim, segments_enabled):
    """``_segrun._Replayer.__torch_function__`` (``_segmodes`` in the working tree) hands the member's output (a view of ``acc``,
    sharing its counter) out as ``.data``: a counter of its own. The eager write through it
    then leaves ``acc._version`` alone: a backward that saved ``acc`` runs on the written
    values, where eager raises (and any version check of cudagraphify's own on that buffer,
    a training graph's ``saved_statics``, misses the write too). Passes on 3abfc0c^.
    Fix: keep ``detach()`` for outputs on static (parameter/buffer) memory, or for every
    member output that is a view (``t._is_view()``), ``.data`` for the rest."""
    torch.manual_seed(0)
    m = cg.graphify(_Accumulates().eval(), segments=True)
    bumped, did = _accumulate(m)
    assert cg.stats(m).segment_replays > 0  # (the view came from a replay)
    assert (bumped, did) == (1, "raised"), "the write through the view was not seen by autograd"


# -- controls of .data elsewhere ---------------------------------------------------------------

class _Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).relu() + 1


def _lin_pair(**options):
    torch.manual_seed(0)
    ref = _Lin()
    return ref, cg.graphify(copy.deepcopy(ref), **options)


def _ctx(how):
    return cg.graph_region() if how == "region" else warnings.catch_warnings()


@pytest.mark.parametrize("how", ["nocopy", "region"])
def test_control_an_earlier_outputs_write_leaves_a_later_ones_version(sim, how):
    ref, g = _lin_pair(copy_outputs=how != "nocopy")
    with torch.no_grad(), _ctx(how):
        for _ in range(3):
            g(torch.randn(2, 4))
        y1 = g(torch.randn(2, 4))
        if how == "nocopy":
            y1 = y1.clone()  # (nocopy: the next call overwrites y1's memory)
        y2 = g(torch.randn(2, 4))
        y1.add_(1)
        assert y2._version == 0 and not y2._is_view() and y2._base is None


class _Sub(torch.Tensor):
    pass


class _Wrapping(TorchFunctionMode):
    """Every plain tensor a torch function returns comes back as a _Sub."""

    def __init__(self):
        super().__init__()
        self.funcs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        out = func(*args, **(kwargs or {}))
        return out.as_subclass(_Sub) if type(out) is torch.Tensor else out


@pytest.mark.parametrize("how", ["nocopy", "region"])
def test_control_a_torch_function_mode_around_the_call(sim, how):
    ref, g = _lin_pair(copy_outputs=how != "nocopy")
    with torch.no_grad(), _ctx(how):
        for _ in range(3):
            g(torch.randn(2, 4))
        x = torch.randn(2, 4)
        replays = cg.stats(g).replays
        with _Wrapping() as mode:
            got, want = g(x), ref(x)
        assert cg.stats(g).replays == replays + 1
        assert type(got) is type(want) is _Sub and torch.equal(got, want)
        assert torch.Tensor.data.__get__ in mode.funcs  # (.data is seen by the mode)


@pytest.mark.parametrize("how", ["nocopy", "region"])
def test_control_inference_mode_outputs_are_inference_tensors_as_eagers(sim, how):
    ref, g = _lin_pair(copy_outputs=how != "nocopy")
    with torch.inference_mode(), _ctx(how):
        for _ in range(4):
            got = want = None  # (a held region output is P1's case)
            x = torch.randn(2, 4)
            got, want = g(x), ref(x)
        assert torch.equal(got, want) and got.is_inference() and want.is_inference()
    assert cg.stats(g).replays >= 3 and not cg.stats(g).eager_calls
    for t in (got, want):
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
            t.add_(1)


@pytest.mark.parametrize("how", ["nocopy", "region"])
def test_control_torch_func_and_torch_compile_around_aliases(sim, how):
    ref, g = _lin_pair(copy_outputs=how != "nocopy")
    with _ctx(how):
        with torch.no_grad():
            for _ in range(3):
                g(torch.randn(2, 4))
        x, w = torch.randn(2, 4), torch.randn(2, 4)
        grads = [torch.func.grad(lambda w, m=m: (m(x) * w).sum())(w) for m in (g, ref)]
        assert torch.equal(*grads)

        class Outer(nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, x):
                return self.inner(x) * 2 + self.inner(x + 1)

        compiled, eager = torch.compile(Outer(g), backend="eager"), Outer(ref)
        with torch.no_grad():
            replays = cg.stats(g).replays
            for _ in range(3):
                x = torch.randn(2, 4)
                assert torch.equal(compiled(x), eager(x))
            assert cg.stats(g).replays == replays + 6


class _ViewOfInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        v = x.view(-1)
        h = self.lin(x).relu() * 2
        v.add_(1)
        if h.sum().item() > -1:
            h = h + 1
        return h * 3 + x


def test_control_segments_a_view_of_an_input_runs_eagerly(sim, segments_enabled):
    """(a member returning a view of a copied input would hand out a view of the copy: the
    write through it would miss the caller's tensor; the plan runs it eagerly instead)"""
    torch.manual_seed(0)
    ref = _ViewOfInput().eval()
    g = cg.graphify(copy.deepcopy(ref), segments=True)
    with torch.no_grad():
        for i in range(6):
            x1, x2 = torch.full((2, 8), float(i)), torch.full((2, 8), float(i))
            assert torch.equal(g(x1), ref(x2)) and torch.equal(x1, x2)
    assert cg.stats(g).segment_replays > 0


# -- P1 (before these commits): a held output in a region under inference_mode -----------------

class _Twice(nn.Module):
    """Calls piece ``a`` again while its first output is held (a residual)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h1 = self.a(x)
        h2 = self.a(h1)
        if bool((h2 > -1e9).all()):  # a host sync: piecewise, a and b chained
            h2 = h2 + 1
        return self.b(h2) + h1


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_P1_a_held_chained_output_is_moved_under_inference_mode_too(sim, mode):
    """``_region.Slot.protect`` moves the held alias inside ``_unsafe_preserve_version_counter``,
    which reads ``alias._version``: inside ``inference_mode`` an inference tensor has none and
    raises; ``protect`` takes the RuntimeError for "cannot be moved" and the call runs eagerly,
    counted as "still referenced through a view" (misleading). Under inference_mode every
    second call of a piece while its output is held (and every region call while the caller
    keeps the previous output) runs eagerly. Not from these commits (same on 3abfc0c^).
    Fix: skip the version keeping for ``alias.is_inference()`` (autograd cannot have saved
    it)."""
    torch.manual_seed(0)
    ref = _Twice()
    g = cg.graphify(copy.deepcopy(ref))
    with getattr(torch, mode)(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(6):
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x))
    s = cg.stats(g.a)
    assert s.replays == 10 and not s.eager_calls, s


# -- R7, R8: an outer graph's guard and a piece's forward or call override -----------------------

class _Outer(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.shared = shared

    def forward(self, x):
        return self.shared(x) * 3


def _live_pieces():
    """A root whose pieces a and b pay (live plan wrappers), and its eager twin."""
    _COST.update(graph=1e-6, eager=50e-6)
    torch.manual_seed(0)
    ref = _Root()
    g = cg.graphify(copy.deepcopy(ref))
    for _ in range(10):
        x = torch.randn(4, 8)
        assert torch.equal(g(x), ref(x))
    assert g.a._cudagraphify_state.given_back is None
    assert isinstance(g.a.__dict__.get("forward"), _wrap.GraphedForward)
    return ref, g


def _outer_after(change):
    ref, g = _live_pieces()
    outer, outer_ref = cg.graphify(_Outer(g.a)), _Outer(ref.a)
    for _ in range(3):
        x = torch.randn(4, 8)
        assert torch.equal(outer(x), outer_ref(x))
    change(g, ref)
    x = torch.randn(4, 8)
    assert torch.equal(g.a(x), ref.a(x))  # (the change is real: a computes something else)
    return all(torch.equal(outer(x), outer_ref(x))
               for x in (torch.randn(4, 8) for _ in range(2))), cg.stats(outer)


def test_R7_outer_guard_sees_a_piece_given_another_pieces_wrapper(timed):  # noqa: F811
    """``a.forward = b.forward``: a's calls now run b's plan wrapper, which calls b's forward
    (its owner's) with b's weights. ``_guards._forward_of`` counts every piece wrapper with
    ``had_own=False`` as None, a's as b's: the outer graph that ran a replays a's old
    computation. Passes on a432bc4^ (the wrapper object was recorded). Fix: reduce a plan
    wrapper to what it wraps only when its dispatch's ``owner`` is the module itself."""

    def change(g, ref):
        g.a.forward = g.b.__dict__["forward"]
        ref.a.forward = ref.b.forward

    same, s = _outer_after(change)
    assert same, s


def test_R8_outer_guard_sees_a_call_override_bound_to_another_module(timed):  # noqa: F811
    """``a._compiled_call_impl = b._call_impl`` (a call override, as ``module.compile()`` sets
    one): ``_watch.own_call_impl`` takes any bound ``nn.Module._call_impl`` for the one a
    retired piece holds, so ``call_override`` says None and the outer guard misses it (and
    ``ungraphify``'s ``_drop_direct_call`` would delete it). Passes on a432bc4^. Fix: count it
    as cudagraphify's own only when ``value.__self__ is module`` (``call_override`` has the
    module), or keep the retired piece's call in a marked CallImpl."""

    def change(g, ref):
        g.a._compiled_call_impl = g.b._call_impl
        ref.a._compiled_call_impl = ref.b._call_impl

    same, s = _outer_after(change)
    assert same, s


def _accelerate_like(m):
    old = m.forward
    m.forward = functools.update_wrapper(
        functools.partial(lambda mod, x, old=old: old(x) * 2, m), old)


@pytest.mark.parametrize("change", ["accelerate hook over the wrapper", "plain function",
                                    "module.compile()"])
def test_control_outer_guard_sees_real_changes_of_a_live_piece(timed, change):  # noqa: F811
    def apply(g, ref):
        for m, other in ((g.a, g.b), (ref.a, ref.b)):
            if change.startswith("accelerate"):
                _accelerate_like(m)
            elif change == "plain function":
                m.forward = lambda x, o=other: nn.Linear.forward(o, x)
            else:
                m.compile(backend="eager")

    same, s = _outer_after(apply)
    assert same, s


# -- controls of retirement (a432bc4) ----------------------------------------------------------

_GIVE_BACK = dict(graph_cost=30e-6, eager_cost=10e-6)


def _clean(m: nn.Module) -> bool:
    d = m.__dict__
    return "_cudagraphify_state" not in d and "forward" not in d and (
        "_compiled_call_impl" not in d or not _watch.own_call_impl(d["_compiled_call_impl"]))


_ORDERS = list(itertools.permutations(["graphify a", "ungraphify a", "ungraphify root",
                                       "graphify root", "call root"], 4))


@pytest.mark.parametrize("order", _ORDERS[::4])
def test_control_graphify_and_ungraphify_of_a_retired_piece_and_its_root_in_any_order(
        timed, order):  # noqa: F811
    g = _run(**_GIVE_BACK)
    assert g.a._cudagraphify_state.given_back is not None
    torch.manual_seed(1)
    ref = _Root()
    ref.load_state_dict(g.state_dict())
    for op in order + ("call root", "call a", "call root"):
        try:
            if op == "graphify a":
                cg.graphify(g.a)
            elif op == "ungraphify a":
                cg.ungraphify(g.a)
            elif op == "ungraphify root":
                cg.ungraphify(g)
            elif op == "graphify root":
                cg.graphify(g)
            else:
                m, r = (g, ref) if op == "call root" else (g.a, ref.a)
                for _ in range(3):
                    x = torch.randn(4, 8)
                    assert torch.equal(m(x), r(x)), (order, op)
        except cg.CudagraphifyUsageError:
            pass  # (already / not graphified)
    for _ in range(2):
        for t in (g.a, g):
            try:
                cg.ungraphify(t)
            except cg.CudagraphifyUsageError:
                pass
    assert all(_clean(m) for m in g.modules()), order


def test_control_module_compile_of_a_retired_piece_survives_ungraphify_of_the_root(
        timed):  # noqa: F811
    g = _run(**_GIVE_BACK)
    torch.manual_seed(1)
    ref = _Root()
    ref.load_state_dict(g.state_dict())
    g.a.compile(backend="eager")
    compiled = g.a.__dict__["_compiled_call_impl"]
    assert not _watch.own_call_impl(compiled)
    for _ in range(3):
        x = torch.randn(4, 8)
        assert torch.equal(g(x), ref(x))
    cg.ungraphify(g)
    assert g.a.__dict__["_compiled_call_impl"] is compiled
    full = torch.compile(_Outer(g.b), backend="eager", fullgraph=True)  # (b retired too)
    x = torch.randn(4, 8)
    assert torch.equal(full(x), _Outer(ref.b)(x))


def test_control_copies_and_load_state_dict_of_a_root_with_retired_pieces(timed):  # noqa: F811
    g = _run(**_GIVE_BACK)
    torch.manual_seed(1)
    ref = _Root()
    ref.load_state_dict(g.state_dict())
    for c in (copy.deepcopy(g), copy.copy(g)):
        for m, r in ((c, ref), (c.a, ref.a), (c, ref)):
            for _ in range(6):
                x = torch.randn(4, 8)
                assert torch.equal(m(x), r(x))
    sd = {k: v + 1 for k, v in ref.state_dict().items()}
    g.load_state_dict(sd), ref.load_state_dict(sd)
    for _ in range(3):
        x = torch.randn(4, 8)
        assert torch.equal(g(x), ref(x))


# -- 87871e5: the pieces logic moved to _pieces (checked once by AST comparison at review) ----

def test_control_chain_pieces_is_read_where_the_chain_is_decided(sim, monkeypatch):
    monkeypatch.setattr(_pieces, "CHAIN_PIECES", False)
    torch.manual_seed(0)
    ref = _Root()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(4):
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x))
    assert g._cudagraphify_state._chain is None and cg.stats(g.a).replays > 0
