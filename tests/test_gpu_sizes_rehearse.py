"""GPU tests: capture_sizes lends the first size's rehearsal to the later sizes (issue 18).

A small model that asks ``torch.cuda.is_current_stream_capturing()`` as HF transformers' mask
building does (a host-sync shortcut when not captured, the mask applied while captured: the same
values), captured over several sizes. Outputs are compared with eager's bitwise; counters prove
that one rehearsal served the sizes alike, that a size whose path differs while captured (its
CUDA capture fails on a sync there) is rehearsed and planned as without lending, and that the
later calls replay.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _first_call

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("quiet_gpu")]

DEV = "cuda"
SIZES = [16, 12, 8, 6, 4, 3, 2, 1]


class MaskLike(nn.Module):
    """Embedding, three residual MLP blocks, a head; the attention mask applied as HF's mask
    code does: skipped eagerly where it is all ones (a host sync), applied while captured.
    ``sync_upto``: at sizes up to it, the path while captured syncs too (a CUDA capture fails
    there)."""

    def __init__(self, sync_upto: int = 0):
        super().__init__()
        self.sync_upto = sync_upto
        self.emb = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU())
                                    for _ in range(3))
        self.head = nn.Linear(32, 64)

    def forward(self, ids, attention_mask):
        h = self.emb(ids)
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing or not bool(attention_mask.all()):
            keep = attention_mask[..., None].bool()
            if capturing and ids.shape[0] <= self.sync_upto and not bool(keep.any()):
                h = h * 0
            h = torch.where(keep, h, torch.zeros_like(h))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _trusting() -> cg.OpPolicy:
    policy = cg.OpPolicy()
    policy.TRUSTED_CAPTURED_PATHS = (__name__,)
    return policy


def _inputs(b: int) -> dict:
    return {"ids": torch.randint(0, 64, (b, 1), device=DEV),
            "attention_mask": torch.ones(b, 1, dtype=torch.long, device=DEV)}


def _captured(monkeypatch, model: nn.Module, lend: bool = True):
    """capture_sizes over SIZES (with or without lending); the rehearsals it ran."""
    n = []
    real = _first_call.rehearse
    with monkeypatch.context() as m:
        m.setattr(_first_call, "rehearse", lambda first: n.append(1) or real(first))
        if not lend:
            m.setattr(_first_call, "borrow", lambda first: None)
        g = cg.graphify(model, op_policy=_trusting(), max_graphs=len(SIZES))
        with torch.no_grad():
            done = cg.capture_sizes(g, _inputs, SIZES, progress=False)
    return g, done, len(n)


def test_one_rehearsal_for_every_size_then_replays(monkeypatch):
    torch.manual_seed(0)
    ref = MaskLike().to(DEV).eval()
    g, done, rehearsals = _captured(monkeypatch, copy.deepcopy(ref))
    assert done.graphed == SIZES and not done.eager, done
    assert rehearsals == 1  # the largest size's; the others borrowed it, their captures agreed
    s = cg.stats(g)
    assert (s.captures, s.eager) == (len(SIZES), 0), s
    with torch.no_grad():
        for _ in range(2):
            for b in SIZES:
                x = _inputs(b)
                assert torch.equal(g(**x), ref(**x)), b
    after = cg.stats(g)
    assert after.replays == s.replays + 2 * len(SIZES), after  # every later call replayed
    assert (after.captures, after.eager) == (s.captures, 0), after


def test_sizes_whose_capture_syncs_are_rehearsed_and_planned_as_without_lending(monkeypatch):
    torch.manual_seed(0)
    ref = MaskLike(sync_upto=2).to(DEV).eval()
    runs = {}
    for lend in (True, False):
        g, done, rehearsals = _captured(monkeypatch, copy.deepcopy(ref), lend)
        with torch.no_grad():
            for b in SIZES:
                x = _inputs(b)
                assert torch.equal(g(**x), ref(**x)), (lend, b)
        runs[lend] = (done.graphed, sorted(done.eager), rehearsals)
    # sizes 2 and 1: their CUDA capture failed (a sync while captured), with a borrowed
    # rehearsal: each rehearsed then, which finds the sync; piecewise, as without lending
    assert runs[True][:2] == runs[False][:2] == (SIZES[:-2], [1, 2]), runs
    assert (runs[True][2], runs[False][2]) == (3, len(SIZES)), runs


class SyncAtTwo(MaskLike):
    """MaskLike whose path while captured syncs at size 2 only (a CUDA capture fails there)."""

    def forward(self, ids, attention_mask):
        h = self.emb(ids)
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing or not bool(attention_mask.all()):
            keep = attention_mask[..., None].bool()
            if capturing and ids.shape[0] == 2 and not bool(keep.any()):
                h = h * 0
            h = torch.where(keep, h, torch.zeros_like(h))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def test_a_size_captured_after_one_whose_capture_failed_gets_its_graph():
    # Size 2's capture (a lent rehearsal) fails on its sync, part way, in the callable's pool:
    # torch leaves that pool marked as being recorded to (capture_end raises before it ends
    # the host allocator's routing). Size 1's capture then failed to begin there ("already
    # recording to mempool_id", the H200) and ran eagerly: the pool is retired, size 1 is
    # captured into a new one, and replays.
    torch.manual_seed(0)
    ref = SyncAtTwo().to(DEV).eval()
    sizes = [4, 3, 2, 1]
    g = cg.graphify(copy.deepcopy(ref), op_policy=_trusting(), max_graphs=len(sizes))
    with torch.no_grad():
        done = cg.capture_sizes(g, _inputs, sizes, progress=False)
        assert done.graphed == [4, 3, 1] and sorted(done.eager) == [2], done
        for b in sizes:
            x = _inputs(b)
            assert torch.equal(g(**x), ref(**x)), b
        before = cg.stats(g).replays
        x = _inputs(1)
        assert torch.equal(g(**x), ref(**x))
        assert cg.stats(g).replays == before + 1, cg.stats(g)
    torch.randn(3, device=DEV)  # (the CUDA generator is out of capture mode)
    torch.cuda.synchronize()
