"""GPU: the replay fast path where this session changed it (cudagraphify/_fast.py): an
inference graph called under grad mode replays through it, and misses it once a parameter
requires grad; in a region, this graph's own dropped alias is not protected again, a held one
is moved, a view of one runs eagerly; a piece timed through the fast path. Every output equals
eager's bitwise; counters show the path taken."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify._fast import Fast

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("quiet_gpu")]


def _pair(frozen: bool = False):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).cuda()
    if frozen:
        ref.requires_grad_(False)
    return ref, cg.graphify(copy.deepcopy(ref))


def test_grad_mode_inference_graph_replays_fast_then_misses_once_a_parameter_needs_grad():
    ref, g = _pair(frozen=True)
    with torch.enable_grad():
        for _ in range(5):
            x = torch.randn(4, 64, device="cuda")
            out = g(x)
            assert torch.equal(out, ref(x)) and not out.requires_grad
        assert type(g._cudagraphify_state._fast) is Fast
        s = cg.stats(g)
        assert s.captures == 1 and s.replays == 4 and s.eager == 0, s
        ref[0].weight.requires_grad_(True)
        g[0].weight.requires_grad_(True)
        x = torch.randn(4, 64, device="cuda")
        out, want = g(x), ref(x)
        assert out.requires_grad and torch.equal(out, want)
        out.sum().backward()
        want.sum().backward()
        assert torch.equal(g[0].weight.grad, ref[0].weight.grad)


def test_region_fast_path_dropped_held_and_viewed_aliases():
    ref, g = _pair()
    with torch.no_grad(), cg.graph_region() as r:
        for _ in range(4):  # dropped at once: the inline check
            x = torch.randn(4, 64, device="cuda")
            assert torch.equal(g(x), ref(x))
        replays = cg.stats(g).replays
        x1, x2, x3 = (torch.randn(4, 64, device="cuda") for _ in range(3))
        y1 = g(x1)
        y2 = g(x2)  # y1 held: moved to a copy
        assert torch.equal(y1, ref(x1)) and torch.equal(y2, ref(x2))
        assert r.stats().moved_outputs == 1
        assert cg.stats(g).replays == replays + 2
        v = y2[1:]  # a view of the alias held: eager
        y3 = g(x3)
        assert torch.equal(y3, ref(x3)) and torch.equal(v, ref(x2)[1:])


def test_two_graphs_in_a_region_protect_each_other():
    torch.manual_seed(0)
    a_ref, b_ref = nn.Linear(64, 64).cuda(), nn.Linear(64, 64).cuda()
    a, b = cg.graphify(copy.deepcopy(a_ref)), cg.graphify(copy.deepcopy(b_ref))
    with torch.no_grad(), cg.graph_region():
        for _ in range(3):
            x = torch.randn(4, 64, device="cuda")
            assert torch.equal(b(a(x)), b_ref(a_ref(x)))
        x1, x2 = torch.randn(4, 64, device="cuda"), torch.randn(4, 64, device="cuda")
        yb = b(a(x1))  # held while a and b replay again
        ya = a(x2)
        assert torch.equal(yb, b_ref(a_ref(x1))) and torch.equal(ya, a_ref(x2))


@pytest.mark.parametrize("fn", [torch.sin, torch.nn.functional.gelu, torch.Tensor.exp],
                         ids=["torch.sin", "F.gelu", "Tensor.exp"])
def test_a_torch_function_graphified_itself_replays_eagers_kernels(fn):
    # (before: "returns a tensor that is not an argument", every call eager)
    g = cg.graphify(fn)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(8, 64, device="cuda")
            assert torch.equal(g(x), fn(x))
    s = cg.stats(g)
    assert (s.captures, s.replays, s.eager) == (1, 3, 0), s


@pytest.mark.parametrize("fn", [torch.resolve_conj, lambda z: z.conj() * 2,
                                lambda z: torch.view_as_real(z.resolve_conj()) * 2],
                         ids=["resolve_conj", "conj", "view_as_real"])
def test_a_conjugate_view_argument_is_copied_as_one(fn):
    # (its static copy was a plain tensor: resolve_conj of it returned it, so a replay handed
    # out the caller's own conj view where eager makes new memory)
    g = cg.graphify(fn)
    with torch.no_grad():
        for _ in range(4):
            z = torch.randn(8, 64, dtype=torch.complex64, device="cuda").conj()
            before = z.clone()
            got, want = g(z), fn(z)
            assert torch.equal(got, want) and got.is_conj() == want.is_conj()
            got.add_(1)
            assert torch.equal(z, before)
    s = cg.stats(g)
    assert (s.captures, s.replays, s.eager) == (1, 3, 0), s


def test_a_graph_blocked_anew_after_each_reassignment_is_captured_again_each_time():
    # F, then G reads F's output in place; a view of G's output is held across F's next call.
    # G's weight is reassigned six times: G is captured anew after F, which blocks F, which is
    # captured again after G. Before, F ran eagerly for good from the fifth time on. (F has
    # temporaries of its own, its hidden activation: a replay of a graph without any, one
    # Linear, writes only its outputs and is never blocked by a later graph's held output)
    torch.manual_seed(0)
    rf = nn.Sequential(nn.Linear(64, 4096), nn.GELU(), nn.Linear(4096, 64)).cuda()
    rg = nn.Linear(64, 64).cuda()
    gf, gg = cg.graphify(copy.deepcopy(rf)), cg.graphify(copy.deepcopy(rg))
    with torch.no_grad(), cg.graph_region() as region:
        gf(torch.randn(4, 64, device="cuda"))
        (entry,) = region.cache_for(gf._cudagraphify_state).graphs()
        assert entry.scratch, "F's capture freed no block: the test's premise fails"
        v = rv = None
        for t in range(240):
            if t % 40 == 20:
                w = torch.randn(64, 64, device="cuda")
                rg.weight, gg.weight = nn.Parameter(w.clone()), nn.Parameter(w.clone())
            if t == 230:
                before = cg.stats(gf)
            x = torch.randn(4, 64, device="cuda")
            a, ra = gf(x), rf(x)
            b, rb = gg(a), rg(ra)
            assert torch.equal(a, ra) and torch.equal(b, rb), t
            if v is not None:
                assert torch.equal(v, rv), t
            v, rv = b[:2], rb[:2]
            del a, b
    after = cg.stats(gf)
    assert after.captures == 8, after
    assert after.replays - before.replays == 10 and after.eager == before.eager, after
