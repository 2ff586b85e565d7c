"""bucketed(target, sizes): a leading dimension padded to the next bucket, outputs sliced back,
each bucket checked against eager on its first call. Through the simulated backend (fixture
``sim``), so the padded calls replay captured graphs as on a GPU."""

from __future__ import annotations


import pytest
import torch
from torch import nn

import cudagraphify as cg


class Rows(nn.Module):
    """Each output row depends on its input row alone; a dict out, with a tuple inside."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x, scale: float = 1.0):
        h = torch.tanh(self.a(x)) * scale
        return {"y": self.b(h), "parts": (h, x.abs())}


class Mixes(nn.Module):
    """Rows interact: each row minus the batch mean."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)

    def forward(self, x):
        h = self.a(x)
        return h - h.mean(0, keepdim=True)


def _same(got, want):
    g, w = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
    assert len(g) == len(w)
    for a, b in zip(g, w):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b)


def _bucketed(cls, sizes):
    """An eager module, a graphified twin with its weights, and that twin bucketed at sizes."""
    torch.manual_seed(0)
    ref = cls()
    g = cg.graphify(cls())
    g.load_state_dict(ref.state_dict())
    return ref, g, cg.bucketed(g, sizes)


def test_every_batch_size_is_served_by_the_bucket_graphs(sim, quiet):
    ref, g, b = _bucketed(Rows, [8, 2, 4])
    assert b.sizes == [2, 4, 8]
    with torch.no_grad():
        for n in [3, 1, 5, 8, 2, 7, 6, 4, 3, 1, 5, 7]:
            x = torch.randn(n, 6)
            out = b(x)
            _same(out, ref(x))
            assert out["y"].shape[0] == n and out["parts"][1].shape[0] == n
    # one check per batch size below its bucket (1, 3, 5, 6, 7); graphs only of the buckets
    assert len(b.verified) == 5 and not b.refused
    s = cg.stats(g)
    assert s.captures == 3 and s.replays > 0, s


def test_a_bucket_where_rows_interact_runs_unpadded(sim):
    ref, g, b = _bucketed(Mixes, [4])
    with torch.no_grad():
        x = torch.randn(3, 6)
        with pytest.warns(cg.CudagraphifyWarning, match="rows interact"):
            out = b(x)
        assert torch.equal(out, ref(x))  # the check's own result: eager, unpadded
        (why,) = b.refused.values()
        assert "real rows change with the padding rows' values" in why
        for _ in range(3):
            x = torch.randn(3, 6)
            assert torch.equal(b(x), ref(x))  # unpadded from then on (its own graph)
    assert not b.verified and b.padded_calls == 2  # the check's two paddings


def test_an_interaction_the_last_row_hides_is_seen_by_the_zero_rows(sim, quiet):
    """Each row minus the batch maximum: repeating the last row leaves the maximum as it is,
    zero rows change it where every real value is negative."""
    g = cg.graphify(lambda x: x - x.max(0, keepdim=True).values)
    b = cg.bucketed(g, [4])
    x = -torch.rand(3, 5) - 0.1
    assert torch.equal(b(x), x - x.max(0, keepdim=True).values)
    (why,) = b.refused.values()
    assert "rows interact" in why


def test_a_zero_copy_target_is_checked_on_copies(sim, quiet):
    """copy_outputs=False: a replay writes the same output memory; the check keeps copies
    (else both paddings would read as the same)."""
    g = cg.graphify(lambda x: x - x.mean(0, keepdim=True), copy_outputs=False)
    b = cg.bucketed(g, [4])
    with torch.no_grad():
        for _ in range(2):
            g(torch.randn(4, 5))  # its graph of 4 rows, captured
        b(torch.randn(3, 5))
    assert b.refused and not b.verified


def test_an_output_without_the_batch_is_refused(sim, quiet):
    g = cg.graphify(nn.Linear(4, 4))
    b = cg.bucketed(lambda x: g(x).sum(), [4])
    with torch.no_grad():
        x = torch.randn(3, 4)
        assert torch.equal(b(x), g(x).sum())
    (why,) = b.refused.values()
    assert "does not keep the batch" in why


class Counts(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen += x.shape[0]
        return self.lin(x)


def test_a_forward_that_writes_a_buffer_is_not_bucketed_and_runs_once(sim, quiet):
    g = cg.graphify(Counts())
    b = cg.bucketed(g, [4])
    with torch.no_grad():
        b(torch.randn(3, 4))
    assert g.seen.item() == 3  # the call ran once (the check stopped before the padded run)
    (why,) = b.refused.values()
    assert "forward writes memory it did not make" in why
    with torch.no_grad():
        b(torch.randn(3, 4))
    assert g.seen.item() == 6


def test_other_values_of_a_plain_argument_are_checked_apart(sim, quiet):
    ref, g, b = _bucketed(Rows, [4])
    with torch.no_grad():
        for scale in (1.0, 2.0, 1.0):
            x = torch.randn(3, 6)
            _same(b(x, scale), ref(x, scale))
    assert len(b.verified) == 2


def test_sizes_in_or_beyond_the_buckets_run_as_they_are(sim, quiet):
    g = cg.graphify(nn.Linear(4, 4))
    b = cg.bucketed(g, [2, 4])
    with torch.no_grad():
        for n in (2, 4, 9):
            x = torch.randn(n, 4)
            assert torch.equal(b(x), g(x))
    assert not b.verified and b.padded_calls == 0


def test_another_dimension(sim, quiet):
    torch.manual_seed(0)
    lin = nn.Linear(5, 5)
    g = cg.graphify(lambda x: lin(x.transpose(0, 1)).transpose(0, 1))
    b = cg.bucketed(g, [4], dim=1)
    with torch.no_grad():
        x = torch.randn(2, 3, 5)
        out = b(x)
        assert out.shape == (2, 3, 5)
        torch.testing.assert_close(out, lin(x.transpose(0, 1)).transpose(0, 1))
    assert len(b.verified) == 1


def test_bad_input_is_refused_with_the_fix():
    g = cg.graphify(nn.Linear(4, 4))
    with pytest.raises(cg.CudagraphifyUsageError, match="must be callable"):
        cg.bucketed(3, [1])
    with pytest.raises(cg.CudagraphifyUsageError, match="dim must be"):
        cg.bucketed(g, [1], dim=-1)
    with pytest.raises(cg.CudagraphifyUsageError, match="positive ints"):
        cg.bucketed(g, [0, 2])
    b = cg.bucketed(lambda x, y: g(x) + y, [4])
    with pytest.raises(cg.CudagraphifyUsageError, match="disagree on the batch size"):
        b(torch.randn(3, 4), torch.randn(2, 4))
    with pytest.raises(cg.CudagraphifyUsageError, match="must have a dimension 0"):
        b(torch.randn(3, 4), torch.tensor(1.0))


class Hooks(nn.Module):
    """Registers a gradient hook on its weight on every call (a grad-scaling trick)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if torch.is_grad_enabled():
            self.lin.weight.register_hook(lambda g: g * 2)
        return self.lin(x)


def test_a_first_buckets_padded_check_runs_register_no_hook(sim, quiet):
    """The check's padded runs are not the user's: a hook they registered on a parameter would
    run in every later backward (gradients scaled once per padded run)."""
    ref, g, b = _bucketed(Hooks, [4])
    for _ in range(2):
        x = torch.randn(3, 4)
        b(x).sum().backward()
        ref(x).sum().backward()
        assert len(g.lin.weight._backward_hooks) == len(ref.lin.weight._backward_hooks)
        torch.testing.assert_close(g.lin.weight.grad, ref.lin.weight.grad)
