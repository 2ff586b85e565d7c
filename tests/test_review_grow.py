"""Review of c213750 (a region slot's memory checked as a ``copy_outputs=False`` output's: an
alias grown in place moves the graph's memory, ``handed_moved()`` sees it and that graph runs
eagerly for good). CPU, on the simulated backend (``sim``); every scenario runs graphified
callables beside eager twins (``copy.deepcopy`` before ``graphify``) and compares bitwise
(``torch.equal``). On the double a replay that reads memory which moved raises an
``AssertionError`` ("stale replay"); on a GPU it reads the freed memory, silently.

Findings: G1 and G2 are fixed (their tests are plain tests now: a borrowed slot's address is
in the borrower's ``handed`` and the slot keeps its key, ``Slot.ptr``); G3 is documented in the
README (strict xfail tests).

- G1 (silent on a GPU; left open by the change): a graph that BORROWS a slot (reads another
  graph's output in place: ``GraphRegion.borrowable`` at its capture, ``entry.borrowed``) is
  not told that the slot's memory moved. Its copy-in (``CapturedGraph.run`` and the fast path's
  inline loop over ``entry._copy_in``) keeps the borrowed slot's tensor as its "buffer": the
  argument's address differs from the captured one, so it copies the argument into
  ``slot.tensor``, whose storage is now the caller's grown memory, and the replay reads the
  graph's OLD address (freed into the pool). Only the slot's own graph checks ``handed``;
  ``protect_before``'s borrowed check compares the argument with ``slot.tensor`` (both moved:
  equal). So once a caller grows an output of ``fa`` and drops it, ``fb(fa(x))`` reads ``fa``'s
  old memory on every later call, for good (``fa`` itself runs eagerly, correctly): on a GPU
  (expected) the value of ``fa``'s last replay before the growth, over and over.
  * ``test_g1_borrower_reads_the_old_memory_after_the_alias_grew_and_was_dropped[fast|slow]``
  * ``test_g1_the_moved_alias_passed_straight_to_the_borrower[...]``: storage grown with the
    shape kept (``untyped_storage().resize_``), grown and shrunk back (``resize_`` twice),
    storage resized to the same size, freed to 0 and back: the borrower's shape guard passes.
  * ``test_g1_piecewise_root_grows_a_pieces_output_on_one_call``: the same in a piecewise plan
    (the root grows ``a``'s output on one call only, with its shape kept): ``b`` borrowed ``a``'s
    slot when captured, and reads its old memory on that call and every later one.
- G2 (loud, memory; left open): ``GraphRegion._slots`` is keyed by the slot's ``data_ptr``
  at capture; ``forget`` (a graph released: evicted, invalidated) deletes the key found at
  ``slot.tensor.data_ptr()`` NOW, which after a growth is the caller's new address: the stale
  key stays, and holds the slot, its tensor and the caller's grown storage until the region
  closes (an implicit region of a piecewise plan: as long as the model). ``del y`` then frees
  nothing. ``test_g2_a_released_graph_whose_alias_grew_keeps_the_grown_memory``.
- G3 (loud; not from this change, left open): ``torch.utils.swap_tensors`` on a region alias
  (a piece's output in the root's code, or an explicit region's output) raises
  ``RuntimeError: Cannot swap t1 because it has weakref associated with it`` (``Slot.alias``
  is a weakref to it) on every call after the first, where eager swaps.
  ``test_g3_swap_tensors_on_a_pieces_output``, ``test_g3_swap_tensors_on_a_region_alias``.

Controls (pass): the grown alias's own graph runs eagerly and the caller's grown tensor keeps
its values, for each way of moving the memory: ``resize_``, ``set_`` to a larger size through
the alias, another tensor ``set_`` on its storage and grown, ``untyped_storage().resize_``
(larger, same size, 0 and back, 0 kept), ``share_memory_``; ``y.data = ...``, ``.grad`` set to
the alias, a shrink only (no move) keep replaying; a shrink-only alias
read in place by a borrower; a graph captured before the moved one replays (the grown alias
kept by the caller is moved, values kept; a view of it held: that call eager); the region
reopened and the callable's own cache outside the region replay afresh; a forward returning an
object with a ``static`` attribute (no action picks it up) and a training graph keep replaying;
a region's single-output graph keeps its fast path (the slot check costs no miss); two threads
each in a region of its own.

Seen, documented (README: clone an alias handed to DLPack), not counted: ``torch.from_dlpack``
of an alias holds its TensorImpl, not a second use of its storage, so the next replay moves the
alias to a copy and overwrites what the DLPack tensor reads. Not a move the ``data_ptr`` check
misses, as far as found: every storage reallocation (growth, shrink, same size, 0 and back)
is expected to change the address on CUDA (the new block comes from outside the graph's
private pool; on the CPU double it did every time; not run on a GPU here).
"""
from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _fast

pytestmark = pytest.mark.usefixtures("quiet")

MOVED = "resized in place"


def _pair(seed: int = 0, n: int = 8):
    torch.manual_seed(seed)
    ref = nn.Linear(n, n)
    return ref, cg.graphify(copy.deepcopy(ref))


@pytest.fixture(params=["fast", "slow"])
def path(request, monkeypatch):
    """Replays through the fast path (as they come) or the slow path only."""
    if request.param == "slow":
        monkeypatch.setattr(_fast.Fast, "make", staticmethod(lambda *a, **k: None))
    return request.param


def _moved_calls(g) -> int:
    return sum(n for r, n in cg.stats(g).eager_calls.items() if MOVED in r)


def _chain_warm(fa, fb, ra, rb, n=4):
    for _ in range(n):
        x = torch.randn(2, 8)
        assert torch.equal(fb(fa(x)), rb(ra(x)))


def _borrows(fb) -> bool:
    """Whether ``fb``'s graph in the region in effect reads another graph's slot in place."""
    from cudagraphify import _region
    state = fb.__dict__["_cudagraphify_state"]
    return any(e.borrowed for e in _region.current().cache_for(state).graphs())


# -- G1: a borrower reads a moved slot's old memory -------------------------------------------

def test_g1_borrower_reads_the_old_memory_after_the_alias_grew_and_was_dropped(sim, path):
    ra, fa = _pair(0)
    rb, fb = _pair(1)
    with torch.no_grad(), cg.graph_region():
        _chain_warm(fa, fb, ra, rb)
        y = fa(torch.randn(2, 8))
        y.resize_(64, 8)  # the caller grows it once (a user's own buffer, an out= of another size)
        del y
        for i in range(4):
            x = torch.randn(2, 8)
            assert torch.equal(fb(fa(x)), rb(ra(x))), f"call {i}"
    assert _moved_calls(fa) == 4


@pytest.mark.parametrize("how", ["storage grown", "grown, shrunk back", "storage same size",
                                 "storage freed and back"])
def test_g1_the_moved_alias_passed_straight_to_the_borrower(sim, path, how):
    ra, fa = _pair(0)
    rb, fb = _pair(1)

    def move(t):
        s = t.untyped_storage()
        n = s.nbytes()
        if how == "storage grown":
            s.resize_(4 * n)
        elif how == "grown, shrunk back":
            t.resize_(64, 8)
            t.resize_(2, 8)
        elif how == "storage same size":
            s.resize_(n)
        else:
            s.resize_(0)
            s.resize_(n)
        t.fill_(3.0)

    with torch.no_grad(), cg.graph_region():
        _chain_warm(fa, fb, ra, rb)
        x = torch.randn(2, 8)
        y, ye = fa(x), ra(x)
        move(y)
        move(ye)
        assert torch.equal(fb(y), rb(ye))


class _GrowsOnce(nn.Module):
    """``a``'s output, a piece's (chained in the root's implicit region), has its storage
    grown by the root's own code on the calls whose input asks for it (a data-dependent
    branch of the root's eager code); its shape is kept."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        if y.sum().item() > 1e9:  # a host sync: the root runs piecewise, a and b are pieces
            y = y * 0
        if x[0, 0].item() > 100:
            # (room to append: a user's own growable buffer; an out= of a larger size, then a
            # view of the first rows, does the same)
            y.untyped_storage().resize_(2 * y.untyped_storage().nbytes())
            y.mul_(2)
        return self.b(y)


def test_g1_piecewise_root_grows_a_pieces_output_on_one_call(sim):
    torch.manual_seed(0)
    ref = _GrowsOnce().eval()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(10):
            x = torch.randn(4, 8)
            if i == 6:
                x[0, 0] = 1000.0  # (this call only)
            assert torch.equal(g(x), ref(x)), f"call {i}"
    assert cg.stats(g.b).replays >= 3


def test_g1_control_shrunk_only_alias_read_in_place(sim, path):
    # (a shrink keeps the storage: nothing moved, the borrower reads the slot in place)
    ra, fa = _pair(0)
    rb, fb = _pair(1)
    with torch.no_grad(), cg.graph_region():
        _chain_warm(fa, fb, ra, rb)
        x = torch.randn(2, 8)
        y, ye = fa(x), ra(x)
        for t in (y, ye):
            t.resize_(1, 8)
            t.resize_(2, 8)
            t.mul_(3.0)
        assert torch.equal(fb(y), rb(ye))
        assert _borrows(fb)
        _chain_warm(fa, fb, ra, rb, 3)
    assert cg.stats(fb).replays >= 7 and not cg.stats(fb).eager_calls


def test_g1_control_chain_without_a_growth_replays(sim, path):
    ra, fa = _pair(0)
    rb, fb = _pair(1)
    with torch.no_grad(), cg.graph_region():
        _chain_warm(fa, fb, ra, rb, 8)
    assert cg.stats(fa).replays >= 5 and cg.stats(fb).replays >= 5


# -- controls: the moved slot's own graph, each way of moving its memory ----------------------

def _set_grow(t):
    t.set_(t.untyped_storage(), 0, (64, 8), (8, 1))
    t.fill_(1.0)


def _other_tensor_grows(t):
    z = torch.empty(0).set_(t.untyped_storage())
    z.resize_(128)
    z.fill_(5.0)
    return z


def _storage(k):
    def f(t):
        s = t.untyped_storage()
        n = s.nbytes()
        if k == 0:
            s.resize_(0)
            s.resize_(n)
        else:
            s.resize_(k * n)
        t.fill_(6.0)
    return f


def _freed(t):
    t.untyped_storage().resize_(0)


def _shared(t):
    t.share_memory_()
    t.fill_(4.0)


MOVES = {
    "resize_": lambda t: (t.resize_(64, 8), t.fill_(7.0)),
    "set_ larger": _set_grow,
    "another tensor on its storage grown": _other_tensor_grows,
    "storage x4": _storage(4),
    "storage same size": _storage(1),
    "storage 0 and back": _storage(0),
    "storage freed, kept so": _freed,
    "share_memory_": _shared,
}


@pytest.mark.parametrize("how", list(MOVES), ids=list(MOVES))
def test_control_each_way_of_moving_the_memory_makes_that_graph_eager(sim, path, how):
    ra, fa = _pair(0)
    with torch.no_grad(), cg.graph_region():
        for _ in range(3):
            fa(torch.randn(2, 8))
        x = torch.randn(2, 8)
        y, ye = fa(x), ra(x)
        keep = [MOVES[how](y), MOVES[how](ye)]  # noqa: F841 (held, as the caller would)
        for i in range(3):
            x = torch.randn(2, 8)
            assert torch.equal(fa(x), ra(x)), f"call {i}"
        if y.untyped_storage().nbytes():
            assert torch.equal(y, ye)
    assert _moved_calls(fa) == 3


def _data(t):
    t.data = torch.full((64, 8), 2.0)


def _grad(t):
    w = torch.zeros(2, 8, requires_grad=True)
    w.grad = t
    w.grad.mul_(2)
    return w


KEEPS = {
    ".data = another": _data,
    ".grad = alias": _grad,
    "shrink only": lambda t: (t.resize_(4), t.fill_(9.0)),
}


@pytest.mark.parametrize("how", list(KEEPS), ids=list(KEEPS))
def test_control_changes_that_do_not_move_the_memory_keep_replaying(sim, path, how):
    ra, fa = _pair(0)
    with torch.no_grad(), cg.graph_region():
        for _ in range(3):
            fa(torch.randn(2, 8))
        x = torch.randn(2, 8)
        y, ye = fa(x), ra(x)
        keep = [KEEPS[how](y), KEEPS[how](ye)]
        for i in range(3):
            x = torch.randn(2, 8)
            assert torch.equal(fa(x), ra(x)), f"call {i}"
        assert torch.equal(y, ye)
        if isinstance(keep[0], torch.Tensor):
            assert torch.equal(keep[0].grad, keep[1].grad)
    assert _moved_calls(fa) == 0


def test_control_an_earlier_graph_replays_past_a_grown_alias_kept(sim, path):
    # fb captured first (seq 0), fa after (seq 1): fb's replays protect fa's slot, whose alias
    # the caller grew and keeps; it is moved to a copy (values kept), or the call runs eagerly
    # where a view of it is held
    ra, fa = _pair(0)
    rb, fb = _pair(1)
    with torch.no_grad(), cg.graph_region():
        for _ in range(3):
            x = torch.randn(2, 8)
            assert torch.equal(fb(x), rb(x))
            assert torch.equal(fa(x), ra(x))
        x = torch.randn(2, 8)
        y, ye = fa(x), ra(x)
        for t in (y, ye):
            t.resize_(32, 8)
            t[2:] = 1.5
        v, ve = y[3:], ye[3:]
        for i in range(3):
            x = torch.randn(2, 8)
            assert torch.equal(fb(x), rb(x)), f"call {i}"
            assert torch.equal(fa(x), ra(x)), f"call {i}"
        assert torch.equal(y, ye) and torch.equal(v, ve)
        del v, ve
        x = torch.randn(2, 8)
        assert torch.equal(fb(x), rb(x))
        assert torch.equal(y, ye)


def test_control_region_reopened_and_own_cache_replay_afresh(sim, path):
    ra, fa = _pair(0)
    with torch.no_grad():
        with cg.graph_region():
            for _ in range(3):
                fa(torch.randn(2, 8))
            y = fa(torch.randn(2, 8))
            y.resize_(64, 8)
            fa(torch.randn(2, 8))
        assert _moved_calls(fa) == 1
        before = cg.stats(fa).replays
        with cg.graph_region():
            for i in range(4):
                x = torch.randn(2, 8)
                assert torch.equal(fa(x), ra(x))
        for i in range(4):
            x = torch.randn(2, 8)
            assert torch.equal(fa(x), ra(x))
        assert _moved_calls(fa) == 1
        assert cg.stats(fa).replays >= before + 4


class _Obj:
    """An argument object with a ``static`` attribute (a tensor) and a bound method: returned
    as it is (its output action is a closure over its index, not the object)."""

    def __init__(self, t):
        self.static = t

    def m(self):
        return self.static


class _ReturnsArg(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, obj):
        return self.lin(x), obj, 3


def test_control_an_output_object_with_a_static_attribute_is_not_handed(sim, path):
    torch.manual_seed(0)
    ref = _ReturnsArg()
    g = cg.graphify(copy.deepcopy(ref))
    obj = _Obj(torch.zeros(3))
    with torch.no_grad():
        for region in (False, True):
            with cg.graph_region() if region else warnings.catch_warnings():
                for i in range(5):
                    x = torch.randn(2, 8)
                    a, b = g(x, obj), ref(x, obj)
                    assert torch.equal(a[0], b[0]) and a[1] is obj and a[2] == 3
                    obj.static.resize_(100 + i)  # (the object's tensor grown: not the graph's)
    assert _moved_calls(g) == 0 and cg.stats(g).replays >= 4, cg.stats(g)


def test_control_training_graph_unaffected(sim):
    torch.manual_seed(0)
    ref = nn.Linear(8, 8)
    g = cg.graphify(copy.deepcopy(ref))
    for i in range(5):
        x = torch.randn(2, 8)
        a, b = g(x), ref(x)
        assert torch.equal(a, b)
        a.sum().backward()
        b.sum().backward()
        a.detach().resize_(50, 8)  # (a copy: growing it moves nothing of the graph's)
    assert torch.equal(g.weight.grad, ref.weight.grad)
    assert _moved_calls(g) == 0 and cg.stats(g).replays >= 3


def test_control_region_single_output_keeps_its_fast_path(sim):
    # (the slot in entry.handed: one more address compared per call, no miss)
    ra, fa = _pair(0)
    misses = []
    real = _fast.Fast.call

    def call(self, fn, args, kwargs):
        out = real(self, fn, args, kwargs)
        misses.append(out is _fast._MISS)
        return out

    with torch.no_grad(), cg.graph_region():
        for _ in range(3):
            fa(torch.randn(2, 8))
        _fast.Fast.call = call
        try:
            for _ in range(6):
                x = torch.randn(2, 8)
                assert torch.equal(fa(x), ra(x))
        finally:
            _fast.Fast.call = real
    assert misses and not any(misses), misses


def test_control_threads_each_in_a_region_of_its_own(sim):
    ra, fa = _pair(0)
    errors = []

    def work(seed):
        try:
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad(), cg.graph_region():
                for i in range(6):
                    x = torch.randn(2, 8, generator=gen)
                    y = fa(x)
                    assert torch.equal(y, ra(x))
                    if seed == 1 and i == 3:
                        y.resize_(64, 8)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=work, args=(s,)) for s in (1, 2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors


# -- G2: a released graph whose alias grew keeps the grown memory -----------------------------

def test_g2_a_released_graph_whose_alias_grew_keeps_the_grown_memory(sim):
    ra, fa = _pair(0)
    use = torch._C._storage_Use_Count
    with torch.no_grad(), cg.graph_region(max_graphs=1) as region:
        for _ in range(3):
            fa(torch.randn(2, 8))
        y = fa(torch.randn(2, 8))
        y.resize_(100_000, 8)  # 3.2 MB of the caller's
        storage = y.untyped_storage()
        del y
        for _ in range(4):  # another signature: the first graph is evicted (max_graphs=1)
            x = torch.randn(3, 8)
            assert torch.equal(fa(x), ra(x))
        assert region.stats().evictions == 1
        held = [s for s in region._slots.values()
                if s.tensor.untyped_storage().nbytes() >= 3_200_000]
        assert not held and use(storage._cdata) == 1, "the grown memory is still held"


def test_g2_control_a_released_graph_leaves_no_slot(sim):
    ra, fa = _pair(0)
    with torch.no_grad(), cg.graph_region(max_graphs=1) as region:
        for _ in range(3):
            fa(torch.randn(2, 8))
        y = fa(torch.randn(2, 8))
        del y
        for _ in range(4):
            fa(torch.randn(3, 8))
        assert region.stats().evictions == 1 and len(region._slots) == 1


# -- G3: swap_tensors on a region alias ----------------------------------------------------------

class _SwapsPieceOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.a(x)
        if y.sum().item() > 1e9:  # a host sync: the root runs piecewise
            y = y * 0
        z = torch.ones_like(y)
        torch.utils.swap_tensors(y, z)
        return self.b(y) + z


@pytest.mark.xfail(strict=True, raises=RuntimeError,
                   reason="G3: Slot.alias is a weakref to the piece's output; swap_tensors "
                          "refuses a tensor with a weakref (eager swaps)")
def test_g3_swap_tensors_on_a_pieces_output(sim):
    torch.manual_seed(0)
    ref = _SwapsPieceOutput().eval()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(6):
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x)), f"call {i}"


@pytest.mark.xfail(strict=True, raises=RuntimeError,
                   reason="G3: Slot.alias is a weakref to the region's output; swap_tensors "
                          "refuses a tensor with a weakref (eager swaps)")
def test_g3_swap_tensors_on_a_region_alias(sim):
    ra, fa = _pair(0)
    with torch.no_grad(), cg.graph_region():
        for _ in range(3):
            fa(torch.randn(2, 8))
        x = torch.randn(2, 8)
        y, ye = fa(x), ra(x)
        z, ze = torch.zeros(2, 8), torch.zeros(2, 8)
        torch.utils.swap_tensors(ye, ze)
        torch.utils.swap_tensors(y, z)
        assert torch.equal(y, ye) and torch.equal(z, ze)
