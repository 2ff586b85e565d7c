"""Review of 5a18ca2 (``graphify(torch.sin)``: a torch builtin graphified directly is called
through ``_wrap.user_call``'s one-line function, so the probe sees its call; the guard reads
the callable it calls through ``__cudagraphify_calls__``). CPU, on the simulated backend
(``sim``; ``sim_rng`` where random ops are compared with eager's).

Plain tests pin down what the change gets right (in-place, ``out=``, views and returned
arguments, tuples, scalars, partials' bound state, host syncs, RNG, threads, ordinary
functions and modules untouched). The findings, all fixed since (their tests plain):

- U1 (caused) ``copy.deepcopy`` of a graphified builtin (alone, or kept on a module) made a
  Dispatch without ``user_call``: the copy ran every call eagerly, the bug the commit fixes.
- U2 (caused, cosmetic) findings of a graphified builtin were located at the synthetic code
  (``<graphified TensorBase.item>:2``), not at the caller's line.
- U3 (caused, minor) ``g.__wrapped__ = other`` (wrapt's setter) was ignored for a builtin even
  on a new signature: ``user_call`` called the callable given to ``graphify``.
- U4 (pre-existing, reachable for partials of builtins, eager before) a partial's
  ``__setstate__`` that swaps its function or its keywords dict: the guard watched the old
  ``args``/``keywords`` objects, never ``p.func`` nor which objects ``p`` holds now: stale.
- U5 (pre-existing, in ``callable_state``) a ``functools.partial`` subclass with its own
  ``__call__`` reading ``self.<attr>``: the partial branch never looked at it: stale.
- U6 (pre-existing, now reachable) ``graphify(torch.Tensor.size)`` replays returned a tuple,
  not a ``torch.Size`` (pytree's unflatten): ``.numel()`` raised.
- U7 (pre-existing, now reachable) ``graphify(torch.resolve_conj)`` of a conjugate view:
  replays returned the argument itself, its conj bit set (eager's is resolved, new memory):
  the static copy of a conj or neg view did not keep the bit.
"""

from __future__ import annotations

import copy
import functools
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudagraphify as cg
from cudagraphify._guards import callable_state
from cudagraphify._wrap import user_call


def _stats(g):
    s = cg.stats(g)
    return s.captures, s.replays, dict(s.eager_calls)


# -- what the change gets right (plain tests) ------------------------------------------------

@pytest.mark.parametrize("fn", [torch.Tensor.add_, torch.Tensor.mul_, torch.Tensor.copy_],
                         ids=["add_", "mul_", "copy_"])
def test_an_in_place_method_writes_the_callers_tensor_on_replay(sim, fn):
    g = cg.graphify(fn)
    with torch.no_grad():
        for _ in range(4):
            x, y = torch.randn(3, 4), torch.randn(3, 4)
            want = fn(x.clone(), y)
            out = g(x, y)
            assert out is x and torch.equal(x, want)
    assert _stats(g) == (1, 3, {})


def test_an_in_place_write_into_a_view_reaches_its_base(sim):
    g = cg.graphify(torch.Tensor.add_)
    with torch.no_grad():
        for _ in range(4):
            base, y = torch.randn(3, 4), torch.randn(3)
            want = base.clone()
            want[:, 1].add_(y)
            g(base[:, 1], y)
            assert torch.equal(base, want)
    assert _stats(g)[:2] == (1, 3)


def test_out_arguments_are_written(sim):
    g = cg.graphify(torch.add)
    with torch.no_grad():
        for _ in range(4):
            x, y = torch.randn(3, 4), torch.randn(3, 4)
            out, base = torch.empty(3, 4), torch.zeros(3, 8)
            assert g(x, y, out=out) is out and torch.equal(out, x + y)
            r = g(x, y, out=base[:, 2:6])
            assert torch.equal(r, x + y) and torch.equal(base[:, 2:6], x + y)
            assert not base[:, :2].any() and not base[:, 6:].any()
    assert cg.stats(g).replays >= 6 and not cg.stats(g).eager_calls


def test_an_argument_aliased_as_out_runs_eagerly(sim):
    g = cg.graphify(torch.add)
    with torch.no_grad():
        for _ in range(3):
            x, y = torch.randn(3, 4), torch.randn(3, 4)
            want = x + y
            assert g(x, y, out=x) is x and torch.equal(x, want)
    assert _stats(g)[:2] == (0, 0)


@pytest.mark.parametrize("fn,args,same", [
    (torch.Tensor.view, (12,), False), (torch.Tensor.t, (), False),
    (torch.Tensor.contiguous, (), True), (torch.Tensor.float, (), True),
    (torch.Tensor.detach, (), False), (torch.narrow, (0, 1, 2), False),
], ids=["view", "t", "contiguous", "float", "detach", "narrow"])
def test_views_and_returned_arguments_are_the_callers(sim, fn, args, same):
    g = cg.graphify(fn)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, 4)
            xe = x.clone()
            want = fn(xe, *args)
            r = g(x, *args)
            assert torch.equal(r, want) and r.stride() == want.stride()
            assert (r is x) == same and (want is xe) == same
            r.add_(1)  # (through the view: eager's writes its argument)
            want.add_(1)
            assert torch.equal(x, xe)
    assert _stats(g) == (1, 3, {})


def test_tuple_outputs_keep_their_type_and_views(sim):
    gs, gm = cg.graphify(torch.split), cg.graphify(torch.max)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 4)
            parts = gs(x, 2)
            assert type(parts) is tuple and all(torch.equal(a, b)
                                                 for a, b in zip(parts, torch.split(x, 2)))
            parts[1].zero_()
            assert not x[2:].any()
            m, want = gm(x, dim=1), torch.max(x, dim=1)
            assert type(m) is type(want)
            assert torch.equal(m.values, want.values) and torch.equal(m.indices, want.indices)
    assert _stats(gs) == (1, 3, {}) and _stats(gm) == (1, 3, {})


def test_a_changed_scalar_argument_is_a_new_key(sim):
    g = cg.graphify(torch.add)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    with torch.no_grad():
        for a in (1.0, 2.0, 1.0, 2.0, 3.0):
            assert torch.equal(g(x, y, alpha=a), torch.add(x, y, alpha=a))
    assert _stats(g) == (3, 2, {})


@pytest.mark.parametrize("fn", [torch.ops.aten.sin.default, torch.Tensor.__add__,
                                torch.Tensor.__iadd__, torch.Tensor.__getitem__],
                         ids=["aten.sin.default", "__add__", "__iadd__", "__getitem__"])
def test_overloads_and_dunders(sim, fn):
    g = cg.graphify(fn)
    with torch.no_grad():
        for _ in range(4):
            x, y = torch.randn(3, 4), torch.randn(3, 4)
            args = (x,) if fn is torch.ops.aten.sin.default else (x, 1) \
                if fn is torch.Tensor.__getitem__ else (x, y)
            args2 = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
            assert torch.equal(g(*args), fn(*args2)) and torch.equal(x, args2[0])
    assert _stats(g) == (1, 3, {})


def test_a_partials_list_keyword_changed_in_place_is_seen(sim):
    pad = [1, 1]
    p = functools.partial(F.pad, pad=pad)
    g = cg.graphify(p)
    with torch.no_grad():
        for i in range(6):
            if i == 3:
                pad[0] = 3
            x = torch.randn(2, 3)
            assert torch.equal(g(x), F.pad(x, pad))
    assert _stats(g) == (2, 4, {})


def test_a_partials_bound_tensor_written_or_moved_is_seen(sim):
    held = torch.randn(3, 4)
    p = functools.partial(torch.add, other=held)
    g = cg.graphify(p)
    with torch.no_grad():
        for i in range(7):
            if i == 3:
                held.add_(1)  # (read in place by the graph)
            if i == 4:
                held.data = torch.randn(3, 4)
            if i == 5:
                held.set_(torch.randn(3, 4))
            x = torch.randn(3, 4)
            assert torch.equal(g(x), x + held)
    assert cg.stats(g).replays >= 3 and not cg.stats(g).eager_calls


def test_a_bound_method_of_a_tensor_reads_from_outside_and_runs_eagerly(sim):
    x = torch.randn(3, 4)
    g = cg.graphify(x.add)
    with torch.no_grad():
        for i in range(4):
            if i == 2:
                x.data = torch.randn(3, 4)
            y = torch.randn(3, 4)
            assert torch.equal(g(y), x + y)
    captures, replays, eager = _stats(g)
    assert (captures, replays) == (0, 0) and all("OUTSIDE_TENSOR" in r for r in eager)


@pytest.mark.parametrize("fn", [torch.Tensor.item, torch.nonzero, torch.Tensor.tolist],
                         ids=["item", "nonzero", "tolist"])
def test_a_host_sync_builtin_runs_eagerly_with_its_reason(sim, fn):
    # (before the change, Tensor.item was captured with its sync: no op was seen, and a float
    # output is not "made outside"; the double then refused to replay it)
    g = cg.graphify(fn)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4) if fn is not torch.Tensor.item else torch.randn(1)
            got, want = g(x), fn(x)
            assert torch.equal(got, want) if fn is torch.nonzero else got == want
    captures, replays, eager = _stats(g)
    assert (captures, replays) == (0, 0) and all("HOST_SYNC" in r for r in eager)


@pytest.mark.parametrize("fn", [torch.rand_like, torch.randn_like,
                                functools.partial(torch.dropout, p=0.5, train=True),
                                functools.partial(torch.bernoulli, p=0.5)],
                         ids=["rand_like", "randn_like", "dropout", "bernoulli"])
def test_random_builtins_draw_eagers_numbers(sim_rng, fn):
    def run(f):
        torch.manual_seed(0)
        with torch.no_grad():
            return [f(torch.ones(3, 4)) for _ in range(5)]
    want = run(fn)
    g = cg.graphify(fn)
    got = run(g)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert _stats(g) == (1, 4, {})


def test_grad_mode_through_a_graphified_builtin(sim):
    g = cg.graphify(torch.sin)
    for _ in range(4):
        x = torch.randn(3, 4, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        g(x).sum().backward()
        torch.sin(x2).sum().backward()
        assert torch.equal(x.grad, x2.grad)
    assert _stats(g) == (1, 3, {})


def test_threads_share_one_graphified_builtin(sim):
    g = cg.graphify(torch.sin)
    bad: list = []

    def work():
        try:
            with torch.no_grad():
                for _ in range(30):
                    x = torch.randn(3, 4)
                    if not torch.equal(g(x), torch.sin(x)):
                        bad.append("differs")
        except Exception as e:  # noqa: BLE001
            bad.append(repr(e))
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad and cg.stats(g).captures == 1


def test_a_graphified_builtin_inside_a_graphified_function_and_region(sim):
    gs = cg.graphify(torch.sin)
    go = cg.graphify(lambda x: gs(x) * 2)
    ge = cg.graphify(torch.Tensor.exp)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(3, 4)
            assert torch.equal(go(x), torch.sin(x) * 2)
        with cg.graph_region():
            for _ in range(4):
                x = torch.randn(3, 4)
                assert torch.equal(ge(gs(x)), torch.sin(x).exp())
    assert _stats(go) == (1, 3, {}) and cg.stats(ge).replays >= 3


def test_ordinary_functions_and_modules_get_no_user_call(sim):
    def plain(x):
        return torch.sin(x)

    assert user_call(plain) is None and user_call(F.relu) is None
    assert user_call(torch.ops.aten.sin.default) is None  # (an OpOverload: Python __call__)
    g = cg.graphify(plain)
    m = cg.graphify(nn.Linear(4, 4))
    assert callable_state(plain)[0] is plain
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 4)
            assert torch.equal(g(x), torch.sin(x))
            assert torch.equal(m(x), F.linear(x, m.weight, m.bias))
    assert _stats(g) == (1, 2, {}) and _stats(m) == (1, 2, {})
    assert g._self_dispatch._user_call == (plain, None)  # (a module's dispatch never asks)
    assert m.forward._self_dispatch._user_call == (None, None)


# -- findings (strict xfails) ----------------------------------------------------------------

def test_u1_a_deep_copied_graphified_builtin_replays(sim):
    g = copy.deepcopy(cg.graphify(torch.sin))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 4)
            assert torch.equal(g(x), torch.sin(x))
    assert _stats(g) == (1, 2, {})


class _Act(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = cg.graphify(F.gelu)

    def forward(self, x):
        return self.act(self.lin(x))


def test_u1_a_deep_copied_modules_graphified_activation_replays(sim):
    m = copy.deepcopy(_Act())
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 4)
            assert torch.equal(m(x), F.gelu(m.lin(x)))
    assert _stats(m.act) == (1, 2, {})


def test_u1_a_deep_copied_partial_is_the_copys_own(sim):
    # (what a fix must keep: the copy calls and watches its own partial, not the original's;
    # copying user_call itself would keep calling the original)
    p = functools.partial(torch.add, alpha=2.0)
    g2 = copy.deepcopy(cg.graphify(p))
    p2 = cg.ungraphify(g2)
    assert p2 is not p
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(g2(x, y), p2(x, y))
        p2.keywords["alpha"] = 5.0
        assert torch.equal(g2(x, y), torch.add(x, y, alpha=5.0))
        p.keywords["alpha"] = 7.0
        assert torch.equal(g2(x, y), torch.add(x, y, alpha=5.0))


def test_u2_a_finding_names_the_callers_line(sim):
    g = cg.graphify(torch.Tensor.item)
    with torch.no_grad():
        g(torch.randn(1))
    (reason,) = cg.stats(g).eager_calls
    # (the caller's line: on the CPU double the backend's own frames, tests/conftest.py, are
    # the first outside cudagraphify; on CUDA this file's)
    assert "<graphified" not in reason and (
        "test_review_usercall.py:" in reason or "conftest.py:" in reason), reason


def test_u3_a_reassigned_wrapped_is_called_on_a_new_signature(sim):
    g = cg.graphify(torch.sin)
    with torch.no_grad():
        g(torch.randn(3))
        g.__wrapped__ = torch.cos
        x = torch.randn(5)
        assert torch.equal(g(x), torch.cos(x))


def test_u4_a_partials_function_swapped_by_setstate_is_seen(sim):
    p = functools.partial(torch.add, alpha=2.0)
    g = cg.graphify(p)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(3):
            g(x, y)
        p.__setstate__((torch.sub, (), p.keywords, None))
        assert torch.equal(g(x, y), torch.sub(x, y, alpha=2.0))


def test_u4_a_partials_keywords_replaced_by_setstate_are_seen(sim):
    p = functools.partial(torch.add, alpha=2.0)
    g = cg.graphify(p)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(3):
            g(x, y)
        p.__setstate__((torch.add, (), {"alpha": 3.0}, None))
        assert torch.equal(g(x, y), torch.add(x, y, alpha=3.0))


class _Scaled(functools.partial):
    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **kwargs) * self.scale


def test_u5_a_partial_subclass_attribute_it_reads_is_guarded(sim):
    p = _Scaled(torch.add, alpha=2.0)
    p.scale = 1.0
    g = cg.graphify(p)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(3):
            g(x, y)
        p.scale = 3.0
        assert torch.equal(g(x, y), p(x, y))


def test_u6_tensor_size_graphified_returns_a_torch_size(sim):
    g = cg.graphify(torch.Tensor.size)
    with torch.no_grad():
        for _ in range(3):
            s = g(torch.randn(2, 3))
            assert type(s) is torch.Size and s.numel() == 6


def test_u7_resolve_conj_replays_a_resolved_tensor(sim):
    g = cg.graphify(torch.resolve_conj)
    with torch.no_grad():
        for _ in range(3):
            z = torch.randn(3, dtype=torch.complex64).conj()
            r = g(z)
            assert torch.equal(r, torch.resolve_conj(z)) and not r.is_conj()
            torch.view_as_real(r)
            # (eager's result is new memory: the replay's is not the argument)
            before = z.clone()
            r.add_(1)
            assert torch.equal(z, before)
