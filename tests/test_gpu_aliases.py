"""GPU tests of what a call hands out of graph memory, and of pieces given back for good.

- Region slots and ``copy_outputs=False`` outputs are ``.data`` aliases of the static outputs: a
  new tensor object each call, with a version counter of its own (as eager's new tensor has).
- A region walks its live slots only when one was captured at or after the graph that replays
  (``_region.GraphRegion._live_top``): random call orders keep every held output.
- A piece given back gets its plain forward back (``_wrap._retire_piece``).

Every output is compared with eager bitwise; counters prove the graphs replayed.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _trial, _wrap
from cudagraphify.bench.models import GPT, GPTConfig

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("quiet_gpu")]

DEV = "cuda"


def _linear(seed: int, frozen: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Linear(16, 16).to(DEV)
    return m.requires_grad_(not frozen)


def test_region_outputs_have_version_counters_of_their_own():
    ref = _linear(0)
    g = cg.graphify(copy.deepcopy(ref))
    w = torch.randn(16, device=DEV, requires_grad=True)
    with cg.graph_region():
        for _ in range(3):
            g(torch.randn(4, 16, device=DEV))
        x1, x2 = torch.randn(4, 16, device=DEV), torch.randn(4, 16, device=DEV)
        y1 = g(x1)
        y2 = g(x2)  # y1 moved to a copy
        assert y1 is not y2
        loss = (w * y2).sum()  # saves y2
        with torch.no_grad():
            y1.add_(1)  # eager: y1 and y2 are unrelated tensors
        assert y2._version == 0
        loss.backward()
        assert torch.equal(w.grad, ref(x2).detach().sum(0))
        assert torch.equal(y1, ref(x1).detach() + 1) and torch.equal(y2, ref(x2).detach())
    assert cg.stats(g).replays == 5


def test_copy_outputs_false_hands_out_a_new_tensor_each_call():
    ref = _linear(1)
    g = cg.graphify(copy.deepcopy(ref), copy_outputs=False)
    with torch.no_grad():
        outs = []
        for _ in range(4):
            x = torch.randn(4, 16, device=DEV)
            y = g(x)
            assert torch.equal(y, ref(x))
            outs.append(y)
        y.t_()  # the caller's tensor only
        x = torch.randn(4, 16, device=DEV)
        z = g(x)
        assert z.shape == (4, 16) and torch.equal(z, ref(x))
    assert len({id(o) for o in outs}) == 4
    assert cg.stats(g).replays >= 4 and cg.stats(g).eager == 0


@pytest.mark.parametrize("seed", range(3))
def test_random_calls_of_three_graphs_in_a_region_keep_every_held_output(seed):
    gen = torch.Generator().manual_seed(seed)
    refs = [_linear(10 * seed + k) for k in range(3)]
    gs = [cg.graphify(copy.deepcopy(r)) for r in refs]
    kept = []
    with torch.no_grad(), cg.graph_region() as region:
        for _ in range(60):
            i = int(torch.randint(0, 3, (1,), generator=gen))
            x = torch.randn(4, 16, generator=gen).to(DEV)
            y = gs[i](x)
            want = refs[i](x)
            assert torch.equal(y, want)
            if torch.rand(1, generator=gen).item() < 0.3:
                kept.append((y, want))
        torch.cuda.synchronize()
        for y, want in kept:
            assert torch.equal(y, want)
        assert region.stats().replays > 0


@pytest.mark.times_pieces  # (the trials run: their verdicts are forced)
def test_pieces_given_back_run_their_plain_forward(monkeypatch):
    """Every piece of a GPT with an ``.item()`` per block given back (its trial's verdict
    forced): plain forwards in place, outputs bitwise eager's, and no graph left."""
    monkeypatch.setattr(_trial, "PLAN_TRIAL", False)
    monkeypatch.setattr(_trial.Trial, "verdict", lambda self: "piece given back: by the test")
    torch.manual_seed(0)
    ref = GPT.from_config(GPTConfig(256, 4, 4, 1, 8, torch.float32), DEV, sync="item")
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for _ in range(10):
            x = torch.randn(1, 8, 256, device=DEV)
            assert torch.equal(g(x), ref(x))
    pieces = g._cudagraphify_state.pieces
    assert pieces and all(p._cudagraphify_state.given_back for p in pieces)
    assert all(_wrap.retired(p) and "forward" not in p.__dict__ for p in pieces)
    s = cg.stats(g)
    assert s.graphs == 0 and s.captures == len(pieces), s


class _GrowsPieceOutput(nn.Module):
    """``a``'s output (a piece's, chained in the root's implicit region) is grown in place by
    the root's own code: the graph's output memory moves with it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        y = self.a(x)
        if y.sum().item() > 1e9:  # a host sync: the root runs piecewise, a and b are pieces
            y = y * 0
        y.resize_(8, 16)
        y[4:] = x
        return self.b(y)


def test_a_pieces_output_grown_in_place_by_the_root_runs_that_piece_eagerly():
    torch.manual_seed(0)
    ref = _GrowsPieceOutput().to(DEV).eval()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(6):
            x = torch.randn(4, 16, device=DEV)
            assert torch.equal(g(x), ref(x)), i
        # a region's alias the caller grows: that graph runs eagerly too
        lin = _linear(2)
        f = cg.graphify(copy.deepcopy(lin))
        with cg.graph_region():
            for _ in range(3):
                f(torch.randn(4, 16, device=DEV))
            y = f(torch.randn(4, 16, device=DEV))
            y.resize_(64, 16)
            y.fill_(7.0)
            for _ in range(3):
                x = torch.randn(4, 16, device=DEV)
                assert torch.equal(f(x), lin(x))
            assert torch.equal(y, torch.full((64, 16), 7.0, device=DEV))
    assert any("resized in place" in r for r in cg.stats(g.a).eager_calls)
    assert cg.stats(g.b).replays >= 3
    assert sum(n for r, n in cg.stats(f).eager_calls.items() if "resized in place" in r) == 3
    assert cg.stats(f).replays >= 1


class _Mlp(nn.Module):
    """Temporaries of its own: the hidden activation and GELU's output, freed in its capture
    (a graph captured after it into the pool may be given their memory)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 4096), nn.Linear(4096, 16)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def _entry(region, g):
    (entry,) = region.cache_for(g._cudagraphify_state).graphs()
    return entry


def test_an_output_captured_after_a_graph_with_temporaries_is_kept_from_its_replay(
        slot_moves):
    """``up`` (an output the size of ``mlp``'s temporaries) is captured after ``mlp`` into one
    region's pool, so its output may lie on memory ``mlp``'s replay writes (on an H100 it did:
    with ``mlp``'s protection switched off, 4 of 4 held outputs were overwritten). Its output
    held across ``mlp``'s replays keeps its value (it is moved to a copy first); a graph that
    writes only its outputs (one ``Linear``: its capture freed no block) is known as such."""
    moves = slot_moves
    torch.manual_seed(0)
    mlp, up = _Mlp().to(DEV).eval(), nn.Linear(16, 4096).to(DEV).eval()
    gm, gu = cg.graphify(copy.deepcopy(mlp)), cg.graphify(copy.deepcopy(up))
    with torch.no_grad(), cg.graph_region() as region:
        gm(torch.randn(4, 16, device=DEV))
        gu(torch.randn(4, 16, device=DEV))
        m, u = _entry(region, gm), _entry(region, gu)
        assert m.seq < u.seq and m.scratch and m.frees, (m.frees, m.scratch)
        before = cg.stats(gm).replays, cg.stats(gu).replays
        for _ in range(4):
            x1, x2 = torch.randn(4, 16, device=DEV), torch.randn(4, 16, device=DEV)
            y = gu(x1)  # (held across mlp's replay)
            z = gm(x2)  # (held across its own next replay: moved then too)
            assert torch.equal(z, mlp(x2))
            assert torch.equal(y, up(x1))
        assert moves[u.seq] == 4 and moves[m.seq] == 3, moves
        # (up's own graph: nothing but its output)
        assert u.frees == 0 and u.allocs == 1 and not u.scratch, (u.frees, u.allocs, u.scratch)
    # (each of the four calls a replay; the first calls' own replay is not counted here)
    assert (cg.stats(gm).replays - before[0], cg.stats(gu).replays - before[1]) == (4, 4)


class _KeepsLast(nn.Module):
    """A piecewise root (a Python side effect) that returns a piece's output and keeps it:
    eager's caller and ``self.last`` share one tensor (see tests/test_kept_output.py)."""

    def __init__(self, view: bool):
        super().__init__()
        self.lin, self.view = nn.Linear(16, 16), view

    def forward(self, x):
        h = self.lin(x)
        self.last = h
        return h[1:] if self.view else h


@pytest.mark.parametrize("view", [False, True])
def test_a_pieces_output_returned_and_kept_is_one_tensor(monkeypatch, view):
    monkeypatch.setattr(_trial, "PLAN_TRIAL", False)  # (a one-Linear plan: never given back)
    torch.manual_seed(0)
    ref = _KeepsLast(view).to(DEV).eval()
    g = cg.graphify(copy.deepcopy(ref))
    got = []
    with torch.no_grad():
        for i in range(6):
            x = torch.randn(4, 16, device=DEV)
            hg, hw = g(x), ref(x)
            assert torch.equal(hg, hw)
            assert (hg._base is g.last) if view else (hg is g.last)
            hg.add_(i + 1)
            hw.add_(i + 1)
            assert torch.equal(g.last, ref.last)
            got.append((hg, hw))
    for hg, hw in got:  # (after the later replays)
        assert torch.equal(hg, hw)
    assert cg.stats(g.lin).replays >= 3
    assert g._cudagraphify_state._chain.moved_outputs == cg.stats(g.lin).replays


class _KeepsTwo(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h, k = self.a(x), self.b(x)
        self.first, self.second = h, k
        return h, k


def test_two_pieces_outputs_returned_and_kept_are_the_kept_tensors(monkeypatch):
    monkeypatch.setattr(_trial, "PLAN_TRIAL", False)
    torch.manual_seed(0)
    ref = _KeepsTwo().to(DEV).eval()
    g = cg.graphify(copy.deepcopy(ref))
    got = []
    with torch.no_grad():
        for i in range(6):
            x = torch.randn(4, 16, device=DEV)
            (hg, kg), (hw, kw) = g(x), ref(x)
            assert torch.equal(hg, hw) and torch.equal(kg, kw)
            assert hg is g.first and kg is g.second
            for t in (hg, kg, hw, kw):
                t.add_(i + 1)
            assert torch.equal(g.first, ref.first) and torch.equal(g.second, ref.second)
            got.append((hg, kg, hw, kw))
    for hg, kg, hw, kw in got:  # (after the later replays)
        assert torch.equal(hg, hw) and torch.equal(kg, kw)
    assert cg.stats(g.a).replays >= 3 and cg.stats(g.b).replays >= 3
