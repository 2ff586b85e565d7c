"""GPU tests of many input sizes of one callable: the graphs share one memory pool
(copy_outputs=True), capture_sizes captures them largest first; every output is compared with
eager, bitwise, and what a caller holds is never written by another size's replay."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify.bench.models import GPT, GPTConfig

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("quiet_gpu")]

DEV = "cuda"
CFG = GPTConfig(256, 4, 3, 1, 8, torch.float32)


def _pair(**kw):
    torch.manual_seed(0)
    ref = GPT.from_config(CFG, DEV).eval()
    return ref, cg.graphify(copy.deepcopy(ref), **kw)


def _x(b, seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    return torch.randn(b, CFG.seq, CFG.dim, device=DEV)


def _pools(g):
    return {id(e.raw.pool) for e in g._cudagraphify_state.cache.graphs(g._cudagraphify_state)}


def test_sizes_share_one_pool_and_kept_outputs_stay_intact():
    ref, g = _pair()
    sizes = [1, 4, 2, 8, 3]
    kept = []
    with torch.no_grad():
        for rnd in range(3):
            for b in sizes:
                x = _x(b, seed=100 * rnd + b)
                got, want = g(x), ref(x)
                assert torch.equal(got, want), (rnd, b)
                kept.append((got, want.clone()))
        for got, want in kept:  # no other size's replay wrote what the caller holds
            assert torch.equal(got, want)
    s = cg.stats(g)
    assert (s.captures, s.graphs, s.replays) == (5, 5, 10), s
    assert len(_pools(g)) == 1


def test_zero_copy_sizes_keep_their_own_pools():
    ref, g = _pair(copy_outputs=False)
    with torch.no_grad():
        for _ in range(2):
            a = g(_x(4, seed=1))
            b = g(_x(2, seed=2))
            assert torch.equal(a, ref(_x(4, seed=1)))  # held across the other size's replay
            assert torch.equal(b, ref(_x(2, seed=2)))
    assert cg.stats(g).replays == 2 and len(_pools(g)) == 2


def test_sizes_on_two_streams_and_evictions():
    ref, g = _pair(max_graphs=2)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    outs = []
    with torch.no_grad():
        for rnd in range(4):
            for b, stream in ((4, s1), (2, s2), (1, s1)):
                x = _x(b, seed=10 * rnd + b)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    y = g(x)
                torch.cuda.current_stream().wait_stream(stream)
                outs.append((y, ref(x)))
    torch.cuda.synchronize()
    for y, want in outs:
        assert torch.equal(y, want)
    s = cg.stats(g)
    assert s.evictions > 0 and s.captures > 3, s


def test_capture_sizes_largest_first_then_every_size_replays():
    ref, g = _pair()
    xs = {b: _x(b, seed=b) for b in (1, 2, 3, 4, 6, 8)}
    with torch.no_grad():
        done = cg.capture_sizes(g, lambda b: (xs[b],), xs, progress=False)
        assert done.graphed == [8, 6, 4, 3, 2, 1] and not done.eager, done
        assert done.memory_bytes > 0
        for b, x in xs.items():
            assert torch.equal(g(x), ref(x)), b
    s = cg.stats(g)
    assert (s.captures, s.graphs, s.replays, s.eager) == (6, 6, 6, 0), s
    assert len(_pools(g)) == 1


def test_capture_sizes_of_a_function_with_a_buffer_it_writes():
    """A graphed function that writes a buffer (a running count): every size's graph writes
    it once per call, as eagerly."""
    lin = nn.Linear(16, 16, device=DEV)
    count = torch.zeros(16, device=DEV)
    count_ref = count.clone()

    @cg.graphify
    def f(x):
        count.add_(1)
        return lin(x) + count

    def f_ref(x):
        count_ref.add_(1)
        return lin(x) + count_ref

    with torch.no_grad():
        done = cg.capture_sizes(f, lambda b: (torch.ones(b, 16, device=DEV),), [4, 2],
                                progress=False)
        assert done.graphed == [4, 2], done
        # capture_sizes' own calls ran the function for real (once per size, as eagerly)
        for b in (4, 2):
            f_ref(torch.ones(b, 16, device=DEV))
        assert torch.equal(count, count_ref)
        for b in (2, 4, 2):
            x = torch.randn(b, 16, device=DEV)
            assert torch.equal(f(x), f_ref(x))
    assert torch.equal(count, count_ref)
    assert cg.stats(f).replays == 3


def test_bucketed_batches_replay_the_bucket_graphs():
    """Batches 1-16 through buckets 4, 8, 16 captured up front: every output close to eager's
    on its own rows (a padded shape may pick another kernel), and only the three graphs."""
    ref, g = _pair()
    b = cg.bucketed(g, [4, 8, 16])
    with torch.no_grad():
        cg.capture_sizes(g, lambda n: (_x(n, seed=n),), b.sizes, progress=False)
        for rnd in range(2):
            for n in range(1, 17):
                x = _x(n, seed=1000 * rnd + n)
                got, want = b(x), ref(x)
                assert got.shape == want.shape
                torch.testing.assert_close(got, want)
    s = cg.stats(g)
    assert (s.captures, s.graphs) == (3, 3), s
    # one check per batch size below its bucket (eager on its rows, then padded twice): the
    # rest replays
    assert len(b.verified) == 13 and not b.refused
    assert s.replays >= 2 * 16 - 3, s


def test_bucketed_refuses_a_batch_that_interacts_on_the_gpu():
    torch.manual_seed(0)
    lin = nn.Linear(8, 8).to(DEV)
    g = cg.graphify(lambda x: torch.softmax(lin(x), dim=0))  # across the batch
    b = cg.bucketed(g, [4])
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 8, device=DEV)
            assert torch.equal(b(x), torch.softmax(lin(x), dim=0))
    assert b.refused and not b.verified and b.padded_calls == 2  # (the check's two paddings)


class _FlagCentred(nn.Module):
    """Rowwise, but centres the batch while its ``center`` buffer (a CUDA bool) is set."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("center", torch.tensor(False))

    def forward(self, x):
        h = self.lin(x)
        return h - h.mean(0, keepdim=True) if self.center else h


def test_bucketed_refuses_a_host_read_of_a_cuda_buffer_flag():
    """``if self.center:`` syncs on a CUDA buffer: the bucket is refused at its check (the
    flag may be flipped in place afterwards, unseen); every call equals eager's, flipped too."""
    torch.manual_seed(0)
    ref = _FlagCentred().to(DEV)
    m = copy.deepcopy(ref)
    b = cg.bucketed(cg.graphify(m), [4])
    with torch.no_grad():
        for flip in (False, False, True, True):
            if flip:
                ref.center.fill_(True)
                m.center.fill_(True)
            x = torch.randn(3, 8, device=DEV)
            assert torch.equal(b(x), ref(x))
    (why,) = b.refused.values()
    assert "reads on the host" in why and b.padded_calls == 0
