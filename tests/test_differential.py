"""Differential suite: a scripted sequence of calls that changes one thing at a time, through a
graphified model and an eager twin given the same changes; every output must be equal.

On a CPU it runs through the simulated capture backend (the engine's keys, guards,
invalidations and static buffers are real; the graphs are re-runs), on our GPT. The sequence is
the one the GPU differential suite is meant to run on third-party models.
"""

from __future__ import annotations

import copy
import warnings
from typing import Callable

import pytest
import torch
from torch import nn

import cudagraphify as cg
from conftest import contexts
from cudagraphify.bench.models import GPT


def _both(fn: Callable[[nn.Module], None]) -> Callable:
    """A step that changes the graphified model and its eager twin the same way."""
    def apply(pair):
        for m in pair:
            fn(m)
    return apply


def _reassign(m: nn.Module) -> None:
    lin = m.blocks[0].mlp.fc
    lin.weight = nn.Parameter(lin.weight.detach() * 0.5)


def _assign_state(m: nn.Module) -> None:
    state = {k: v.detach() + 0.01 for k, v in m.state_dict().items()}
    m.load_state_dict(state, assign=True)


def _data(m: nn.Module) -> None:
    p = m.blocks[1].attn.proj.weight
    p.data = p.data.clone() * 1.5


def _inplace(m: nn.Module) -> None:
    with torch.no_grad():
        m.ln_f.weight.mul_(0.9)  # an optimizer-like in-place update: same memory, new values


# (name, change applied to both models or None, input factory, context factory, expect)
# expect: "capture" (a new graph), "replay", "invalidate" (the old graphs dropped, a new one)
def _steps(dtype=torch.float32):
    x2 = lambda: torch.randn(2, 8, 32, dtype=dtype)  # noqa: E731
    ng = torch.no_grad
    return [
        ("first call", None, x2, ng, "capture"),
        ("same signature", None, x2, ng, "replay"),
        ("batch size 3", None, lambda: torch.randn(3, 8, 32, dtype=dtype), ng, "capture"),
        ("sequence length 5", None, lambda: torch.randn(2, 5, 32, dtype=dtype), ng, "capture"),
        ("non-contiguous input", None,
         lambda: torch.randn(8, 2, 32, dtype=dtype).transpose(0, 1), ng, "capture"),
        ("back to the first signature", None, x2, ng, "replay"),
        ("in-place weight update", _both(_inplace), x2, ng, "replay"),
        ("parameter reassigned", _both(_reassign), x2, ng, "invalidate"),
        ("load_state_dict(assign=True)", _both(_assign_state), x2, ng, "invalidate"),
        ("p.data = ...", _both(_data), x2, ng, "invalidate"),
        ("train mode", _both(lambda m: m.train()), x2, ng, "capture"),
        ("eval mode again", _both(lambda m: m.eval()), x2, ng, "replay"),
        ("inference_mode", None, x2, torch.inference_mode, "capture"),
        ("autocast bf16", None, x2,
         lambda: contexts(torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16)), "capture"),
        ("autocast off again", None, x2, ng, "replay"),
        ("float64 model and input", _both(lambda m: m.double()),
         lambda: torch.randn(2, 8, 32, dtype=torch.float64), ng, "invalidate"),
    ]



def test_scripted_changes_keep_every_output_equal_to_eager(sim):
    torch.manual_seed(0)
    ref = GPT(32, 2, 2).eval()
    model = cg.graphify(copy.deepcopy(ref))
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudagraphifyWarning)
        for name, change, make, ctx, expect in _steps():
            if change is not None:
                change((ref, model))
            x = make()
            before = cg.stats(model)
            with ctx():
                got, want = model(x), ref(x)
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
            after = cg.stats(model)
            what = ("invalidate" if after.invalidations > before.invalidations
                    else "capture" if after.captures > before.captures
                    else "replay" if after.replays > before.replays else "eager")
            seen.append((name, what))
    assert seen == [(name, expect) for name, _, _, _, expect in _steps()], seen


def test_a_static_input_mutated_in_place_is_read_in_place(sim):
    lin = nn.Linear(4, 4)
    g = cg.graphify(copy.deepcopy(lin))
    state = cg.mark_static(torch.zeros(2, 4))
    with torch.no_grad():
        for step in range(4):
            state.add_(1.0)  # the caller updates its state between calls
            torch.testing.assert_close(g(state), lin(state), rtol=0, atol=0, msg=str(step))
    s = cg.stats(g)
    assert (s.captures, s.replays, s.input_copies) == (1, 3, 0)  # 4 calls, never copied


@pytest.mark.parametrize("seed", range(3))
def test_random_walks_over_the_changes_stay_equal_to_eager(sim, seed):
    """The same steps in a random order (each step's own effect; counters not checked)."""
    gen = torch.Generator().manual_seed(seed)
    steps = _steps()
    order = torch.randperm(len(steps), generator=gen).tolist() * 2
    torch.manual_seed(seed)
    ref = GPT(32, 2, 2).eval()
    model = cg.graphify(copy.deepcopy(ref))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudagraphifyWarning)
        for i in order:
            name, change, make, ctx, _ = steps[i]
            if change is not None:
                change((ref, model))
            dtype = next(ref.parameters()).dtype
            x = make().to(dtype)
            with ctx():
                got, want = model(x), ref(x)
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
