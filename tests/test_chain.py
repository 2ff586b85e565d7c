"""Pieces chained in their root's implicit region: a piecewise root (or one planned around an
opaque argument) called for inference outside any region calls its graphed pieces inside a
region of its own, so an output goes on to the next piece without a clone and is read there in
place. On the CPU double (whose replays write the captured storages), against an eager twin,
bitwise; what the caller holds must not change."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _region

import test_opaque_plan as T


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class _Synced(nn.Module):
    """Two pieces around a host sync: the root runs piecewise."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x):
        h = self.norm(x)
        if h.sum().item() > 1e9:  # a host sync
            h = h * 0
        return self.mlp(h)


def _pair(cls=_Synced, **options):
    torch.manual_seed(0)
    ref = cls()
    return ref, cg.graphify(copy.deepcopy(ref), **options)


def test_pieces_chain_in_the_roots_region_and_read_outputs_in_place(sim):
    ref, g = _pair()
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x))
    root = g._cudagraphify_state
    assert root._chain is not None and root._chain in _region.all_open()
    norm, mlp = cg.stats(g.norm), cg.stats(g.mlp)
    assert (norm.captures, norm.graphs, mlp.captures, mlp.graphs) == (1, 1, 1, 1)
    # the mlp reads the norm's output where it lies (no copy); the norm copies x in
    assert mlp.input_copies == 0 and norm.input_copies == 4, (norm, mlp)  # calls 2-5
    assert root._chain.replays == 8  # calls 2-5, two pieces each


def test_outputs_held_across_calls_stay_as_they_were(sim):
    ref, g = _pair()
    held, want = [], []
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(4, 8)
            held.append(g(x))
            want.append(ref(x))
            view = held[-1][1:]  # a view of the last output, held too
    for got, w in zip(held, want):
        assert torch.equal(got, w)
    assert torch.equal(view, want[-1][1:])


def test_outputs_returned_are_copies_so_a_held_view_costs_nothing(sim):
    # (what the root returns is the caller's: a copy where it lies on a piece's memory, which
    # the caller may share where use counts do not see, DLPack or CuPy, or resize: review
    # helper-20, F3 and F4)
    ref, g = _pair()
    with torch.no_grad():
        for _ in range(3):
            g(torch.randn(4, 8))
        x = torch.randn(4, 8)
        out = g(x)
        view, want = out[:2], ref(x)[:2]
        chain = g._cudagraphify_state._chain
        assert all(out.untyped_storage().data_ptr() != s.storage.data_ptr()
                   for s in chain._slots.values())
        before = cg.stats(g.mlp).eager
        for _ in range(2):
            y = torch.randn(4, 8)
            assert torch.equal(g(y), ref(y))
    assert torch.equal(view, want)
    assert cg.stats(g.mlp).eager == before  # nothing of the pieces' memory was held


class _Returning(_Synced):
    """Returns a piece's output itself, twice, beside a tensor made from it."""

    def forward(self, x):
        h = self.norm(x)
        if h.sum().item() > 1e9:  # a host sync
            h = h * 0
        y = self.mlp(h)
        return y, y, y + 1


class _Consuming(_Synced):
    """Returns only a tensor computed from the pieces' outputs, none of theirs."""

    def forward(self, x):
        return super().forward(x) * 2


def _slot_ptrs(g) -> set[int]:
    return {s.storage.data_ptr() for s in g._cudagraphify_state._chain._slots.values()}


def test_a_returned_pieces_output_is_copied_once_however_often_it_is_returned(sim):
    ref, g = _pair(_Returning)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 8)
            got, want = g(x), ref(x)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            assert got[0] is got[1]  # as eager's: one tensor, returned twice
            if g._cudagraphify_state._chain is not None:
                assert all(t.untyped_storage().data_ptr() not in _slot_ptrs(g) for t in got)
    assert cg.stats(g.mlp).replays >= 3


def test_a_result_the_forward_made_itself_is_returned_as_it_is(sim, monkeypatch):
    ref, g = _pair(_Consuming)
    clones = []
    clone = torch.Tensor.clone
    with torch.no_grad():
        for _ in range(3):
            g(torch.randn(4, 8))
        chain = g._cudagraphify_state._chain
        monkeypatch.setattr(torch.Tensor, "clone", lambda t, *a, **k: clones.append(t) or clone(
            t, *a, **k))
        x = torch.randn(4, 8)
        out = g(x)
        monkeypatch.undo()
        assert torch.equal(out, ref(x))
    assert clones == [] and not chain._live  # the pieces' aliases died in the forward


class _Store:
    def __init__(self):
        self.items = []


class _Storing(_Synced):
    """Keeps a view of its first piece's output in an object the caller passes (a cache)."""

    def forward(self, x, store):
        h = self.norm(x)
        store.items.append(h[1:])
        return self.mlp(h)


def test_a_view_of_a_pieces_output_kept_by_the_forward_makes_the_overwriting_call_eager(sim):
    ref, g = _pair(_Storing)
    rs, gs = _Store(), _Store()
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(4, 8)
            assert torch.equal(g(x, gs), ref(x, rs))
    for got, want in zip(gs.items, rs.items):  # every kept view as eager's
        assert torch.equal(got, want)
    norm = cg.stats(g.norm)
    assert any("referenced through a view" in r for r in norm.eager_calls), norm


class _Halves(nn.Module):
    """A rotary embedding's ``rotate_half``: views of its input, taken apart and joined."""

    def forward(self, x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class _CalledTwice(nn.Module):
    """The first output of ``q`` is still held (``a``) when ``q`` replays again."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.halves = _Halves()

    def forward(self, x):
        a = self.q(x)
        if a.sum().item() > 1e9:  # a host sync: the root runs piecewise
            a = a * 0
        r = self.halves(a)
        b = self.q(x * 2)
        return r + a + b


def test_views_a_capture_makes_of_a_borrowed_output_are_not_the_graphs_own(sim):
    """The capture of ``halves`` reads q's output in place; its probe noted the views that
    the forward took of it (their layouts, kept until the capture is done), which counted as
    the new graph's own references left q's output unprotected: ``a`` was overwritten by the
    second call of ``q`` on every call from the second on."""
    ref, g = _pair(_CalledTwice)
    with torch.no_grad():
        for i in range(8):
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x)), i
    q, halves = cg.stats(g.q), cg.stats(g.halves)
    assert q.replays >= 10 and halves.replays >= 5, (q, halves)
    assert halves.input_copies == 0, halves  # (it reads q's output where it lies)


def _graphs_of(g, module):
    """The region graphs of ``module`` (a piece of ``g``), in its root's implicit region."""
    region = g._cudagraphify_state._chain
    return region.cache_for(module._cudagraphify_state).graphs()


@pytest.mark.parametrize("frees", [None, 0])
def test_a_graph_with_no_temporaries_does_not_protect_outputs_captured_after_it(
        sim, frees, monkeypatch, slot_moves):
    """``q`` (one Linear: its output is all it writes) was captured before ``halves``, whose
    output ``r`` is held when ``q`` replays again: ``r`` may lie on the temporaries of a graph
    captured before it, but ``q`` has none where its capture freed no block (``frees == 0``)
    and made one, its output (as the CUDA backend counts; the CPU double counts nothing: None).
    ``halves`` (``-x2``, then ``cat``) has temporaries either way."""
    if frees is not None:
        capture = type(sim).capture

        def counted(self, *a, **k):  # (as the CUDA backend counts: see _capture.RawGraph)
            raw, out = capture(self, *a, **k)
            raw.allocs, raw.frees = len(raw.fresh), frees
            return raw, out
        monkeypatch.setattr(type(sim), "capture", counted)
    moved = slot_moves
    ref, g = _pair(_CalledTwice)
    with torch.no_grad():
        for i in range(8):
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x)), i
    (q,), (halves,) = _graphs_of(g, g.q), _graphs_of(g, g.halves)
    assert q.seq < halves.seq and halves.scratch
    assert q.scratch is (frees is None)
    # ``a`` (q's own output) moved to a copy before each second replay of q, whatever q
    # writes; ``r`` too, from the third call on, where q may write more than its output
    assert moved[q.seq] >= 6, moved
    assert (moved[halves.seq] >= 5) if frees is None else (moved[halves.seq] == 0), moved
    assert cg.stats(g.q).replays >= 10 and cg.stats(g.halves).replays >= 5


def test_what_makes_a_graph_write_more_than_its_outputs():
    from cudagraphify._capturing import _scratch

    class Entry:
        def __init__(self, frees, outs, allocs=1):
            self.frees, self.outs, self.allocs = frees, outs, allocs

        def output_tensors(self):
            return self.outs

    class Probe:
        def __init__(self, produced):
            self.produced = produced

    out = torch.zeros(4)
    own = {out.untyped_storage().data_ptr()}
    tmp = torch.zeros(4).untyped_storage().data_ptr()
    assert not _scratch(Entry(0, [out, out[1:]]), Probe(set(own)))
    assert _scratch(Entry(None, [out]), Probe(set(own)))  # (not counted)
    assert _scratch(Entry(2, [out]), Probe(set(own)))  # (a block freed while captured)
    assert _scratch(Entry(0, [out]), None)  # (no probe: what it made is not known)
    assert _scratch(Entry(0, [out]), Probe(None))
    assert _scratch(Entry(0, [out]), Probe(own | {tmp}))  # (a temporary freed after it)
    # (a block handed out that the probe saw no op make: inside an op, a stream's workspace)
    assert _scratch(Entry(0, [out], allocs=2), Probe(set(own)))
    assert _scratch(Entry(0, [out], allocs=None), Probe(set(own)))


def test_opaque_plans_chain_across_nested_callables(sim):
    torch.manual_seed(0)
    ref = T._Model()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        T._decode(ref, g, steps=8)
    root = g._cudagraphify_state
    # one region, the outermost callable's: the layers plan inside it (their attentions get
    # the layer's opaque object: no pieces, their projections are the layers' pieces)
    assert root._chain is not None
    for layer in g.layers:
        assert layer._cudagraphify_state._chain is None
        assert layer._cudagraphify_state.pieces
        q = cg.stats(layer.attn.q)
        assert q.graphs == 1 and q.input_copies == 0, q  # reads the norm's output in place
    assert root._chain.replays > 0


def test_no_chain_in_grad_mode_or_inside_a_users_region(sim):
    ref, g = _pair()
    for _ in range(3):  # grad mode: the plan's eager runs call the pieces as before
        x = torch.randn(4, 8)
        assert torch.equal(g(x), ref(x))
    assert g._cudagraphify_state._chain is None
    ref, g = _pair()
    with torch.no_grad(), cg.graph_region() as region:
        for _ in range(4):
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x))
        assert g._cudagraphify_state._chain is None and region.stats().replays > 0


def test_the_chain_goes_with_ungraphify_and_with_moved_parameters(sim):
    ref, g = _pair()
    with torch.no_grad():
        for _ in range(3):
            g(torch.randn(4, 8))
        chain = g._cudagraphify_state._chain
        assert chain is not None and not chain.closed
        for m in (g, ref):
            m.double()
        for _ in range(3):
            x = torch.randn(4, 8, dtype=torch.double)
            assert torch.equal(g(x), ref(x))
        state = g._cudagraphify_state
        cg.ungraphify(g)
    assert (state._chain is None or state._chain.closed) and chain.closed
    assert chain not in _region.all_open()


def test_chaining_off_keeps_each_piece_to_its_own_copies(sim, monkeypatch):
    # (the bench's side-by-side switch)
    from cudagraphify import _pieces
    monkeypatch.setattr(_pieces, "CHAIN_PIECES", False)
    ref, g = _pair()
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(4, 8)
            assert torch.equal(g(x), ref(x))
    assert g._cudagraphify_state._chain is None
    assert cg.stats(g.mlp).input_copies == 3  # calls 3-5: the mlp copies the norm's clone in


def test_submodules_a_parent_calls_directly_are_pieces(sim):
    from cudagraphify.bench.models import GPT

    torch.manual_seed(0)
    ref = GPT(32, 2, 2, sync="item-inline").eval()  # its blocks call attn.qkv, attn.proj
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(1, 4, 32)
            assert torch.equal(g(x), ref(x))
    for blk in g.blocks:
        for piece in (blk.attn.qkv, blk.attn.proj, blk.mlp.fc, blk.mlp.out, blk.ln1):
            assert cg.stats(piece).replays == 3, piece  # calls 2-4
        assert "forward" not in blk.attn.__dict__  # never called: not a piece
