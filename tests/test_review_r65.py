"""Review of 1450aaf (held_storages from the tensors the real call bound that the capture's ops
read or wrote; ``_wrote_held(made_ok)``; explain's ``_own_state``/``_ours`` and
``generation_bump``; share_graph's lazy ``_describe``) and 32f88f7 (``_DictCheck``: an
OrderedDict's order by its first and last keys). Run on the simulated backend.

Tests named ``test_finding_*`` failed on the reviewed code (one finding, A, in two forms: a
reorder between calls, and one made by the runs that are not calls); fixed after the review
(the whole order compared again, by the keys' identities). The others are controls. Every comparison is with eager PyTorch on a ``copy.deepcopy`` twin of the
module (outputs and state).
"""

from __future__ import annotations

import collections
import copy
import types

import pytest
import torch
from torch import nn

import cudagraphify as cg
from conftest import SimBackend  # noqa: F401 (the fixtures' backend)

pytestmark = pytest.mark.usefixtures("quiet")


def close(a, b):
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


# -- F-A (wrong values, introduced by 32f88f7): an OrderedDict reordered in its middle, its ends
#    kept -------------------------------------------------------------------------------------


class Experts(nn.Module):
    """Applies the weights of an OrderedDict attribute in its order (an LRU of adapters, a
    routing order kept by the caller): the order is part of what forward computes."""

    def __init__(self, rotate: bool = False):
        super().__init__()
        self.table = collections.OrderedDict((k, torch.randn(4, 4)) for k in "abcd")
        self.rotate = rotate

    def forward(self, x):
        for w in self.table.values():
            x = torch.tanh(x @ w)
        if self.rotate:
            # rotate the middle experts (the first and last stay): two move_to_end calls
            keys = list(self.table)
            self.table.move_to_end(keys[1])
            self.table.move_to_end(keys[-1])
        return x


def test_finding_a_guard_misses_a_middle_reorder_that_keeps_the_ends(sim):
    """``_DictCheck`` (_guards.py:387, 398) now compares an OrderedDict's order by its first
    and last keys only (``_ends``, _guards.py:315), on the grounds that ``move_to_end`` puts
    the key at one end. One ``move_to_end`` does; two do not leave a trace there:
    ``move_to_end("b"); move_to_end("d")`` takes a, b, c, d to a, c, b, d (an LRU touching b
    then d), the dict's version does not move and the ends are the same, so the guard holds
    and the graph replays the old order (wrong outputs). Before 32f88f7 every key was
    compared and the call recaptured."""
    torch.manual_seed(0)
    ref = Experts()
    g = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(2, 4)
    with torch.no_grad():
        for i in range(3):
            assert close(g(x), ref(x)), i
        for m in (g, ref):
            m.table.move_to_end("b")
            m.table.move_to_end("d")
        assert list(g.table) == list(ref.table) == ["a", "c", "b", "d"]
        for i in range(3):
            assert close(g(x), ref(x)), i


@pytest.mark.parametrize("warmups", [1, 2])
def test_finding_a_runs_that_are_not_calls_leave_a_middle_rotation(sim, warmups):
    """The same ends-only compare in ``_DictCheck.restore`` (_guards.py:409) and in
    ``verify``'s volatile check (_first_call.py: ``warm_guard.valid()``): the extra warm-ups
    and the capture rotate the middle of the table again, ``self()`` says nothing changed,
    so nothing is put back (the table is left as the capture's run left it, not as the real
    call did) and a graph is made of a forward that reorders its table on every call (a
    Python side effect a replay cannot repeat): outputs and the table's order differ from
    eager from the first call on. Before 32f88f7 both saw it (eager, ``forward changes a
    container``)."""
    torch.manual_seed(0)
    ref = Experts(rotate=True)
    g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=warmups)
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), (i, list(g.table), list(ref.table))
            assert list(g.table) == list(ref.table), (i, list(g.table), list(ref.table))


# -- controls --------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["middle_to_end", "first_to_end", "last_to_front",
                                 "popitem_first_reinsert", "pop_middle_reinsert"])
def test_single_reorder_or_write_is_seen_control(sim, how):
    """One ``move_to_end`` changes an end; a ``popitem``/``pop`` and re-insert writes (the
    version moves, every item is compared in order): each is seen."""
    torch.manual_seed(0)
    ref = Experts()
    g = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(2, 4)
    with torch.no_grad():
        for i in range(3):
            assert close(g(x), ref(x)), i
        for m in (g, ref):
            t = m.table
            if how == "middle_to_end":
                t.move_to_end("b")
            elif how == "first_to_end":
                t.move_to_end("a")
            elif how == "last_to_front":
                t.move_to_end("d", last=False)
            elif how == "popitem_first_reinsert":
                k, v = t.popitem(last=False)
                t[k] = v
            else:
                v = t.pop("b")
                t["b"] = v
        assert list(g.table) == list(ref.table)
        for i in range(3):
            assert close(g(x), ref(x)), i


class Keeps(nn.Module):
    """Keeps the buffer it is first passed (in one of several holders) and adds to it in
    place; returns ``lin`` of the argument (read after the write)."""

    def __init__(self, how):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.how = how
        self.acc = None
        self.ns = types.SimpleNamespace(acc=None)

    def _held(self):
        if self.how == "dict":
            return self.acc["a"]
        if self.how == "ns":
            return self.ns.acc
        if self.how == "view":
            return self.acc.view(-1)
        return self.acc

    def forward(self, x, buf):
        if self.acc is None and self.ns.acc is None:
            if self.how == "dict":
                self.acc = {"a": buf}
            elif self.how == "ns":
                self.ns.acc = buf
            elif self.how == "row":
                self.acc = buf[1:]
            else:
                self.acc = buf
        held = self._held()
        held.add_(x[1:] if self.how == "row" else x.reshape(held.shape))
        return self.lin(buf)


@pytest.mark.parametrize("how", ["plain", "view", "dict", "ns", "row"])
@pytest.mark.parametrize("pattern", ["always", "after_fast_replays"])
def test_argument_aliasing_a_bound_tensor_control(sim, how, pattern):
    """held_storages (_first_call.py:393-398) hold the bound tensor's storage however the
    capture reaches it (a view, a dict, a plain object, an offset view), and the fast path's
    byte ranges (_fast.py:214) catch the aliasing argument after replays of fresh ones."""
    torch.manual_seed(0)
    ref = Keeps(how)
    g = cg.graphify(copy.deepcopy(ref))
    bg, br = torch.zeros(2, 4), torch.zeros(2, 4)
    with torch.no_grad():
        for i in range(6):
            x = torch.randn(2, 4)
            if pattern == "after_fast_replays" and 0 < i < 4:
                b = torch.randn(2, 4)
                assert close(g(x, b.clone()), ref(x, b.clone())), i
            else:
                assert close(g(x, bg), ref(x, br)), i
            assert close(bg, br), i
    if pattern == "after_fast_replays":
        # (>= 1: the first call a set-up, deferred; a small CPU accumulator is guarded by value
        # on the CPU double, so every other call captures again)
        assert cg.stats(g).replays >= 1


class GrowsPos(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("pos", torch.arange(2.0))

    def forward(self, x):
        if x.shape[0] > self.pos.shape[0]:
            self.register_buffer("pos", torch.arange(float(x.shape[0])))
        return self.lin(x) + self.pos.mean()


class WithGraphedPiece(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = GrowsPos()
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("which", ["inner", "both"])
def test_explain_with_a_separately_graphified_submodule_control(sim, which):
    """explain on a model whose submodule is graphified on its own (its own state), and on
    that submodule: what the runs registered (a grown buffer) is put back in both."""
    torch.manual_seed(0)
    ref = WithGraphedPiece()
    m = copy.deepcopy(ref)
    m.a = cg.graphify(m.a)
    g = cg.graphify(m) if which == "both" else m
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
        cg.explain(g, torch.randn(3, 4))
        for i in range(3):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
        cg.explain(m.a, torch.randn(3, 4))
        for i in range(3):
            x = torch.randn(2, 4)
            assert close(g(x), ref(x)), i
    assert list(m.state_dict()) == list(ref.state_dict())
    for (k, v), (_, w) in zip(m.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(v, w), k
    assert cg.stats(m.a if which == "inner" else g).replays >= 1
