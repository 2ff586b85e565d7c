"""The differential suite's scripted changes (tests/test_differential.py) through a GPT with a
host sync in every block and segments on: each step is called several times (probe, record,
replays), and every output must equal its eager twin's bitwise. CPU, simulated backend."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import cudagraphify as cg
from cudagraphify.bench.models import GPT
from test_differential import _steps


def _run(sync: str, order: list[int], seed: int = 0, calls: int = 4) -> tuple[int, int]:
    steps = _steps()
    torch.manual_seed(seed)
    ref = GPT(32, 2, 2, sync=sync).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudagraphifyWarning)
        model = cg.graphify(copy.deepcopy(ref), segments=True)
        for i in order:
            name, change, make, ctx, _ = steps[i]
            if change is not None:
                change((ref, model))
            dtype = next(ref.parameters()).dtype
            for k in range(calls):
                x = make().to(dtype)
                with ctx():
                    got, want = model(x), ref(x)
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{name}, call {k}")
    s = cg.stats(model)
    return s.segments, s.segment_replays


@pytest.mark.parametrize("sync", ["item", "item-inline"])
def test_every_scripted_change_with_segments_gives_eagers_bits(sim, sync):
    segments, replays = _run(sync, list(range(len(_steps()))))
    assert replays > 0  # (the segments were used, not only eager runs)


@pytest.mark.parametrize("seed", range(3))
def test_random_walks_with_segments_give_eagers_bits(sim, seed):
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(_steps()), generator=gen).tolist() * 2
    _run("item-inline", order, seed, calls=3)
