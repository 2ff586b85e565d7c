"""capture_sizes (serving: sizes captured up front, largest first) on a CPU, through the
simulated capture backend of conftest.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudagraphifyWarning)
        yield


def test_every_size_is_captured_largest_first_then_replayed(sim, capsys):
    m = cg.graphify(nn.Linear(8, 4))
    seen = []

    def inputs(b):
        seen.append(b)
        return (torch.randn(b, 8),)

    with torch.no_grad():
        done = cg.capture_sizes(m, inputs, [1, 4, 2, 4, 3])
    assert seen == [4, 3, 2, 1] and done.graphed == [4, 3, 2, 1] and done.eager == {}
    s = cg.stats(m)
    assert s.captures == 4 and s.graphs == 4
    err = capsys.readouterr().err
    assert "size 1 (4/4)" in err and "4 sizes graphed (1-4)" in err.splitlines()[-1]
    with torch.no_grad():
        for b in (1, 2, 3, 4):
            x = torch.randn(b, 8)
            assert torch.equal(m(x), nn.Linear.forward(m, x))
    assert cg.stats(m).captures == 4 and cg.stats(m).replays == 4


def test_keyword_and_single_tensor_inputs_and_sizes_already_captured(sim):
    m = cg.graphify(nn.Linear(8, 4))
    with torch.no_grad():
        m(torch.randn(2, 8))
        done = cg.capture_sizes(m, lambda b: {"input": torch.randn(b, 8)}, [2, 5],
                                progress=False)
        assert done.graphed == [5, 2]  # (by keyword: a signature of its own)
        assert cg.stats(m).captures == 3
        done = cg.capture_sizes(m, lambda b: torch.randn(b, 8), range(1, 3), progress=False)
    assert done.graphed == [2, 1]
    assert cg.stats(m).captures == 4  # 2 had its graph: replayed, not captured again


class Syncs(nn.Module):
    """Runs eagerly at every size but 1 (a host sync on a value that depends on the size)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        if x.shape[0] > 1:
            y = y * y.sum().item()
        return y


def test_a_size_that_runs_eagerly_is_reported_with_its_reason(sim):
    m = cg.graphify(Syncs(), probe="auto")
    with torch.no_grad():
        done = cg.capture_sizes(m, lambda b: (torch.randn(b, 8),), [1, 3], progress=False)
    assert 1 in done.graphed
    assert 3 in done.eager and done.eager[3], done
    assert "eager (3:" in str(done)


def test_a_function_and_a_static_cache_like_set_up(sim):
    """A call that sets an object up (allocates its tensors on first use) is followed by the
    one that captures."""

    class Lazy:
        def __init__(self):
            self.buf = None

    lin = nn.Linear(4, 100)  # (over 64 elements: a device-like buffer, not a CPU scalar)

    @cg.graphify(static_argnames=("holder",))
    def step(x, holder):
        if holder.buf is None:
            holder.buf = torch.zeros(100)
        holder.buf.add_(lin(x).sum(0))
        return holder.buf * 1

    holder = Lazy()
    with torch.no_grad():
        done = cg.capture_sizes(step, lambda b: (torch.ones(b, 4), holder), [2],
                                progress=False)
    assert done.graphed == [2], done
    assert cg.stats(step).captures == 1


@pytest.mark.parametrize("bad, match", [
    ([], "empty"), ([0], "positive"), ([2, True], "positive"), ("12", "iterable"),
    ([1.0], "positive")])
def test_bad_sizes(sim, bad, match):
    m = cg.graphify(nn.Linear(2, 2))
    with pytest.raises(cg.CudagraphifyUsageError, match=match):
        cg.capture_sizes(m, lambda b: (torch.randn(b, 2),), bad)


def test_bad_target_and_inputs(sim):
    with pytest.raises(cg.CudagraphifyUsageError, match="not graphified"):
        cg.capture_sizes(nn.Linear(2, 2), lambda b: (torch.randn(b, 2),), [1])
    m = cg.graphify(nn.Linear(2, 2))
    with pytest.raises(cg.CudagraphifyUsageError, match="function of the size"):
        cg.capture_sizes(m, [torch.randn(1, 2)], [1])
    with pytest.raises(cg.CudagraphifyUsageError, match=r"inputs\(1\) must return"):
        cg.capture_sizes(m, lambda b: [torch.randn(b, 2)], [1], progress=False)
