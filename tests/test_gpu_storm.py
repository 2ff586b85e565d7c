"""GPU: new signatures on every call stop paying a capture each (``_engine._storming``); every
output equals eager's, bitwise; counters show the captures stopped and the graphs made replay."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("quiet_gpu")]

DEV = "cuda"


def test_a_new_batch_size_every_call_stops_capturing_and_old_sizes_replay():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).to(DEV)
    g = cg.graphify(copy.deepcopy(ref), max_graphs=10)
    with torch.no_grad():
        for n in range(1, 31):
            x = torch.randn(n, 32, device=DEV)
            assert torch.equal(g(x), ref(x))
        s = cg.stats(g)
        assert s.captures == 10, s  # (max_graphs captures never replayed: then eager)
        assert any(r.startswith("a new signature on every call") for r in s.eager_calls), s
        x = torch.randn(3, 32, device=DEV)
        assert torch.equal(g(x), ref(x))
        assert cg.stats(g).replays == s.replays + 1


def test_sizes_that_come_round_more_than_max_graphs_hold_keep_some_graphs_replaying():
    # six sizes in turn through four graphs (a decode loop's lengths on every generate): a size
    # whose graph was evicted twice runs eagerly, and the graphs kept replay
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).to(DEV)
    g = cg.graphify(copy.deepcopy(ref), max_graphs=4)
    with torch.no_grad():
        for _ in range(30):
            for n in range(1, 7):
                x = torch.randn(n, 32, device=DEV)
                assert torch.equal(g(x), ref(x))
    s = cg.stats(g)
    assert s.captures <= 12 and s.replays >= 100, s
    assert any("evicted 2 times before" in r for r in s.eager_calls), s.eager_calls
