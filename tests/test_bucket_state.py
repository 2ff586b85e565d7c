"""bucketed: module state a bucket's check cannot stand for (hunt 9's findings, fixed).

- A value read on the host (``bool(t)``, ``.item()``, ``nonzero``) that comes from module
  state no guard watches (a buffer, a tensor kept in an attribute, or anything an op computed
  from one) refuses the bucket at its check: such a state may change in place afterwards.
  Parameters and what the arguments hold are the check's data: reads of those are bucketed.
- A submodule replaced, added to a container (``layers.append``) or hooked after a check is
  another module tree: checked again (the trees are walked after such a write only).
- An argument that is neither a tensor nor an immutable value runs unpadded.

Elementwise models, so that padded and unpadded outputs are equal bit for bit on the CPU;
the graphified targets run through the simulated backend (conftest.py).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from test_review_bucket2 import Outer, _center, _rowwise

pytestmark = pytest.mark.usefixtures("quiet")


class Gated(nn.Module):
    """Centres the batch where ``gate(self, h)`` is true on the host."""

    def __init__(self, gate):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.register_buffer("flag", torch.tensor(False))
        self.kept = torch.tensor(0)  # a tensor in a plain attribute
        self.gate = gate

    def forward(self, x):
        h = _rowwise(x, self.w)
        return _center(h) if self.gate(self, x) else h


def _served(target, ref, calls=3, n=3):
    b = cg.bucketed(target, [4, 8])
    with torch.no_grad():
        for _ in range(calls):
            x = torch.randn(n, 4)
            assert torch.equal(b(x.clone()), ref(x.clone()))
    return b


def _twins(gate, graph):
    torch.manual_seed(0)
    ref = Gated(gate)
    m = copy.deepcopy(ref)
    return ref, m, (cg.graphify(m) if graph else m)


def _copied_flag(self, x):
    h = torch.zeros((), dtype=torch.bool)
    h.copy_(self.flag)  # (state written into a tensor the run made)
    return bool(h)


def _indexed_flag(self, x):
    h = torch.zeros(2, dtype=torch.bool)
    h[0] = self.flag  # (state set into a tensor the run made: ``__setitem__`` returns None)
    return bool(h.any())


def _argument_written_with_state(self, x):
    x.add_(self.flag * 0)  # (the argument now holds what came from state)
    return bool(x.isnan().any())


STATE_READS = {
    "a buffer set into a new tensor by indexing": _indexed_flag,
    "an argument written with state": _argument_written_with_state,
    "a buffer itself": lambda self, x: bool(self.flag),
    "a buffer through an op": lambda self, x: bool(self.flag.any()),
    "a buffer's item": lambda self, x: (self.flag * 1).sum().item() > 0,
    "a tensor in a plain attribute": lambda self, x: self.kept.item() > 0,
    "a buffer copied into a new tensor": _copied_flag,
    "a buffer mixed with the data": lambda self, x: bool((x.abs().amax() * self.flag) > 0),
    "a parameter alone": lambda self, x: bool(self.w.abs().sum() < 0),
}


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("read", list(STATE_READS))
def test_a_host_read_of_module_state_refuses_the_bucket_at_its_check(sim, read, graph):
    ref, m, target = _twins(STATE_READS[read], graph)
    b = _served(target, ref)
    (why,) = b.refused.values()
    assert "reads on the host" in why and "not from the call's arguments" in why
    assert b.padded_calls == 0  # (refused before any padded run)
    for mod in (ref, m):  # the state changed in place, no attribute written: still eager's
        mod.flag.fill_(True)
        mod.kept.fill_(1)
    with torch.no_grad():
        x = torch.randn(3, 4)
        assert torch.equal(b(x.clone()), ref(x.clone()))


DATA_READS = {
    "the arguments": lambda self, x: not bool(torch.isfinite(x).all()),
    "a parameter with the data": lambda self, x: not bool((x * self.w).isfinite().all()),
    "a new tensor": lambda self, x: torch.zeros(()).item() > 0,
}


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("read", list(DATA_READS))
def test_a_host_read_of_the_data_is_bucketed(sim, read, graph):
    ref, m, target = _twins(DATA_READS[read], graph)
    b = _served(target, ref)
    assert not b.refused and b.padded_calls >= 2 + 2  # (the check's two, then padded calls)


def _batch_head():
    return nn.BatchNorm1d(4, affine=False, track_running_stats=False).eval()


def test_a_submodule_of_a_function_targets_module_replaced_is_checked_again(sim):
    torch.manual_seed(0)
    ref = Outer()
    m = copy.deepcopy(ref)
    g = cg.graphify(m)
    b = _served(lambda x: g(x) * 2, lambda x: ref(x) * 2)
    assert not b.refused
    ref.head, m.head = _batch_head(), _batch_head()
    with torch.no_grad():
        x = torch.randn(3, 4)
        assert torch.equal(b(x.clone()), ref(x.clone()) * 2)
    assert any("rows interact" in why for why in b.refused.values())


def test_a_submodule_replaced_by_a_rowwise_one_is_checked_and_padded_again(sim):
    torch.manual_seed(0)
    ref = Outer()
    m = copy.deepcopy(ref)
    b = _served(cg.graphify(m), ref)
    padded = b.padded_calls
    ref.head, m.head = nn.Tanh(), nn.Tanh()
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(3, 4)
            assert torch.equal(b(x.clone()), ref(x.clone()))
    assert not b.refused
    assert b.padded_calls == padded + 2 + 1  # (checked again: two padded runs, then one call)


class Stack(nn.Module):
    """Its layers run from a ModuleList the forward iterates (never called itself)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.layers = nn.ModuleList([nn.Identity()])

    def forward(self, x):
        h = _rowwise(x, self.w)
        for layer in self.layers:
            h = layer(h)
        return h


class Centering(nn.Module):
    def forward(self, h):
        return _center(h)


STACK_CHANGES = {
    "appended": lambda m, registry: m.layers.append(Centering()),  # (add_module: no attribute set)
    "replaced": lambda m, registry: m.layers.__setitem__(0, Centering()),
    "inserted": lambda m, registry: m.layers.insert(0, Centering()),
    # (its registry kept elsewhere too, so not watched: walked on any module write)
    "written past its registry": lambda m, registry: (registry.__setitem__("1", Centering()),
                                                       setattr(m, "note", 1)),
    "hooked": lambda m, registry: m.layers[0].register_forward_hook(lambda mod, i, o: _center(o)),
}


@pytest.mark.parametrize("graph", [False, True], ids=["plain", "graphified"])
@pytest.mark.parametrize("change", list(STACK_CHANGES))
def test_a_layer_added_to_a_container_after_the_check_is_checked_again(sim, change, graph):
    torch.manual_seed(0)
    ref = Stack()
    m = copy.deepcopy(ref)
    if change == "written past its registry":
        m.held = m.layers._modules  # (kept in an attribute too: not watched in place)
    b = _served(cg.graphify(m) if graph else m, ref)
    assert not b.refused
    STACK_CHANGES[change](ref, ref.layers._modules)
    STACK_CHANGES[change](m, m.layers._modules)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(3, 4)
            assert torch.equal(b(x.clone()), ref(x.clone())), "padded rows joined the batch"
    assert any("rows interact" in why for why in b.refused.values())


def test_an_attribute_write_does_not_walk_the_trees_a_layer_added_does(sim, monkeypatch):
    from cudagraphify import _bucket
    torch.manual_seed(0)
    m = Stack()
    b = _served(m, m)
    walks = []
    tree = _bucket._tree
    monkeypatch.setattr(_bucket, "_tree", lambda roots: walks.append(1) or tree(roots))
    with torch.no_grad():
        for i in range(4):
            m.note = i  # (a plain attribute of a watched module: the epoch moves)
            b(torch.randn(3, 4))
        assert not walks
        m.layers.append(nn.Tanh())  # (rowwise: checked again, padded)
        for _ in range(2):
            x = torch.randn(3, 4)
            assert torch.equal(b(x.clone()), m(x.clone()))
    assert walks and not b.refused


class Scaled(nn.Module):
    def forward(self, x, opts):
        return x * opts.scale


class Opts:
    scale = 2.0


def test_an_argument_neither_tensor_nor_constant_runs_unpadded_with_one_warning(sim):
    b = cg.bucketed(cg.graphify(Scaled()), [4, 8])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            for n in (3, 5, 3):
                x = torch.randn(n, 4)
                assert torch.equal(b(x, Opts()), x * 2.0)
    assert b.padded_calls == 0
    assert list(b.refused) == [("argument", Opts)]
    assert sum("neither a tensor nor an immutable value" in str(w.message)
               for w in caught) == 1


class ByValue(nn.Module):
    def forward(self, x, scale: float, shift: tuple):
        return x * scale + shift[0]


def test_constant_arguments_are_still_keyed_by_value_and_padded(sim):
    b = cg.bucketed(cg.graphify(ByValue()), [4, 8])
    with torch.no_grad():
        for scale in (2.0, 3.0, 2.0, 3.0):
            x = torch.randn(3, 4)
            assert torch.equal(b(x, scale, (1.0, "a")), x * scale + 1.0)
    assert not b.refused
    assert len(b.verified) == 2  # (one check per value)
    assert b.padded_calls == 2 * 2 + 2  # (two checks of two padded runs, two padded calls)


class LazyFlag(nn.Module):
    """A flag buffer set up on the first call (``if self.flag is None``), read through an op."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.register_buffer("flag", None)

    def forward(self, x):
        if self.flag is None:
            self.flag = torch.zeros(2, dtype=torch.bool)  # (a buffer: its registry's name)
        h = _rowwise(x, self.w)
        return _center(h) if bool(self.flag.any()) else h


@pytest.mark.parametrize("graph", [False, True])
def test_state_set_up_on_the_checks_call_is_checked_on_the_next_call(sim, graph):
    torch.manual_seed(0)
    ref = LazyFlag()
    m = copy.deepcopy(ref)
    b = _served(cg.graphify(m) if graph else m, ref)
    (why,) = b.refused.values()  # (the second call's check found the buffer from before it)
    assert "reads on the host" in why and b.padded_calls == 0
    for mod in (ref, m):
        mod.flag.fill_(True)
    with torch.no_grad():
        x = torch.randn(3, 4)
        assert torch.equal(b(x.clone()), ref(x.clone()))


class MadeEachCall(nn.Module):
    """A tensor made anew on every call, read on the host: the call's own values."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        self.seen = torch.zeros(())  # (set to a new tensor every call: changes on every call)
        h = _rowwise(x, self.w)
        return _center(h) if bool(self.seen > 0) else h


def test_a_tensor_set_on_every_call_is_checked_once_more_then_decided(sim):
    torch.manual_seed(0)
    ref = MadeEachCall()
    b = _served(copy.deepcopy(ref), ref, calls=4)
    (why,) = b.refused.values()  # (the second check goes on: it sets the attribute anew)
    assert "on every call" in why


class Transposed(nn.Module):
    """Reads its weight through a view (``self.w.t()``) and the data on the host."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        h = x @ self.w.t()
        return h * 2 if bool((h > 100).any()) else h


def test_a_view_of_a_parameter_is_not_state_set_up_by_the_check(sim):
    """A view the run made of a module's tensor is no tensor it left in module state: the
    check is not put off to the next call."""
    torch.manual_seed(0)
    m = Transposed()
    b = cg.bucketed(m, [4, 8])
    with torch.no_grad():
        x = torch.randn(3, 4)
        assert torch.equal(b(x.clone()), m(x.clone()))
    assert b.padded_calls == 2 and not b.refused  # (checked on this call: two padded runs)


def test_weights_alone_read_on_the_host_through_a_view_refuse(sim):
    class Flagged(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.Parameter(torch.zeros(2, 1), requires_grad=False)

        def forward(self, x):
            return _center(x) if bool(self.p.t()[0, 0]) else torch.tanh(x)
    b = cg.bucketed(Flagged(), [4, 8])
    with torch.no_grad():
        b(torch.randn(3, 4))
    assert any("module state" in why for why in b.refused.values())
