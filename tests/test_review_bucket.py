"""Review of 39f4bc5 + e67bbdd (``bucketed``) and 9975f9c (the probe's cached empty tags and op
names).

Plain tests pass when the library is right; the findings (strict xfails when found) were fixed
the same day and their marks removed. CPU only, through
the simulated backend (fixture ``sim``)."""

from __future__ import annotations

import inspect
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import cudagraphify as cg
from cudagraphify import _policy as new_policy
from test_bucket import Mixes

ROOT = Path(__file__).resolve().parent.parent


def _pair(cls, *a):
    torch.manual_seed(0)
    ref = cls(*a)
    m = cls(*a)
    m.load_state_dict(ref.state_dict())
    return ref, m


# -- bucketed: what is right ------------------------------------------------------------------


def test_max_over_the_batch_is_right_for_every_n(sim, quiet):
    """A batch max is unchanged by a repeated row: padded or refused, the answers are right."""
    lin = nn.Linear(5, 5)

    def f(x):
        h = lin(x)
        return h / h.abs().amax(0, keepdim=True), h.amin(0, keepdim=True).expand_as(h)

    b = cg.bucketed(cg.graphify(f), [4, 8])
    with torch.no_grad():
        for n in (1, 3, 2, 5, 7, 3, 6, 1):
            x = torch.randn(n, 5)
            for got, want in zip(b(x), f(x)):
                torch.testing.assert_close(got, want)


def test_a_mean_over_the_batch_is_refused_when_first_seen_with_distinct_rows(sim, quiet):
    ref, m = _pair(Mixes)
    b = cg.bucketed(cg.graphify(m), [4])
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 6)
            torch.testing.assert_close(b(x), ref(x))
    assert b.refused and not b.verified


def test_autograd_through_the_padding_matches_eager(sim, quiet):
    ref, m = _pair(nn.Linear, 4, 3)
    b = cg.bucketed(cg.graphify(m), [4])
    for _ in range(4):
        x = torch.randn(3, 4)
        xr, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref.zero_grad()
        m.zero_grad()
        (ref(xr) ** 2).sum().backward()
        (b(xb) ** 2).sum().backward()
        torch.testing.assert_close(xb.grad, xr.grad)
        torch.testing.assert_close(m.weight.grad, ref.weight.grad)
        torch.testing.assert_close(m.bias.grad, ref.bias.grad)


def test_token_ids_and_a_bool_mask_as_keyword(sim, quiet):
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4)

    def f(ids, *, mask):
        return emb(ids) * mask.unsqueeze(-1), ids.argmax(-1), mask.any(-1)

    b = cg.bucketed(cg.graphify(f), [4, 8])
    with torch.no_grad():
        for n in (3, 5, 3, 7):
            ids, mask = torch.randint(0, 10, (n, 6)), torch.rand(n, 6) > 0.5
            for got, want in zip(b(ids, mask=mask), f(ids, mask=mask)):
                assert got.dtype == want.dtype and torch.equal(got, want)
    assert len(b.verified) == 3 and not b.refused  # (a key per batch size: 3, 5, 7)


def test_outputs_kept_across_calls_in_a_graph_region(sim, quiet):
    lin = nn.Linear(4, 4)
    b = cg.bucketed(cg.graphify(lin), [4])
    kept = []
    with torch.no_grad(), cg.graph_region():
        for _ in range(5):
            x = torch.randn(3, 4)
            kept.append((x, b(x)))
    with torch.no_grad():
        for x, out in kept:
            torch.testing.assert_close(out, F.linear(x, lin.weight, lin.bias))


# -- bucketed: findings -----------------------------------------------------------------------


def test_a_bucket_first_seen_with_one_row_serves_more_rows_right(sim, quiet):
    """(39f4bc5 verified Mixes on one row, where a repeated row keeps the mean, and then padded
    n=3 wrongly; e67bbdd's zero-row padding refuses it.)"""
    ref, m = _pair(Mixes)
    b = cg.bucketed(cg.graphify(m), [4])
    with torch.no_grad():
        x = torch.randn(1, 6)
        torch.testing.assert_close(b(x), ref(x))
        for _ in range(3):
            x = torch.randn(3, 6)
            torch.testing.assert_close(b(x), ref(x))


def test_a_forward_that_branches_on_the_batch_size(sim, quiet):
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)

    def f(x):
        y = lin(x)
        return y * 2 if x.shape[0] > 2 else y

    b = cg.bucketed(cg.graphify(f), [4])
    with torch.no_grad():
        x = torch.randn(3, 4)
        torch.testing.assert_close(b(x), f(x))
        x = torch.randn(1, 4)
        torch.testing.assert_close(b(x), f(x))


def test_training_mode_after_an_eval_check(sim, quiet):
    def make():
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))

    ref, m = _pair(make)
    g = cg.graphify(m)
    b = cg.bucketed(g, [4])
    ref.eval()
    g.eval()
    with torch.no_grad():
        x = torch.randn(3, 4)
        torch.testing.assert_close(b(x), ref(x))
        ref.train()
        g.train()
        for _ in range(2):
            x = torch.randn(3, 4)
            torch.testing.assert_close(b(x), ref(x))
        torch.testing.assert_close(g[1].running_mean, ref[1].running_mean)


def test_a_forward_that_divides_by_the_batch_size(sim, quiet):
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)

    def f(x):
        return lin(x) / x.shape[0]  # e.g. per-sample weights 1/B

    b = cg.bucketed(cg.graphify(f), [4])
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 4)
            torch.testing.assert_close(b(x), f(x))


def test_a_function_target_that_accumulates_into_a_closed_over_tensor(sim, quiet):
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    acc = torch.zeros(4)

    def f(x):
        acc.add_(x.sum(0))
        return lin(x)

    b = cg.bucketed(cg.graphify(f), [4])
    want = torch.zeros(4)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 4)
            want += x.sum(0)
            torch.testing.assert_close(b(x), lin(x))
    torch.testing.assert_close(acc, want)  # graphify(f) alone gets this right


def test_a_module_behind_a_lambda_runs_once(sim, quiet):
    def make():
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))

    ref, m = _pair(make)
    g = cg.graphify(m)
    b = cg.bucketed(lambda x: g(x), [4])
    with torch.no_grad():
        x = torch.randn(3, 4)
        torch.testing.assert_close(b(x), ref(x))
    assert int(m[1].num_batches_tracked) == int(ref[1].num_batches_tracked) == 1
    torch.testing.assert_close(m[1].running_mean, ref[1].running_mean)


def test_an_argument_written_through_data(sim, quiet):
    # an idempotent write (clamp): both paddings agree, so the bucket is verified
    b = cg.bucketed(cg.graphify(lambda x: (x.data.clamp_(min=0), x * 2)[1]), [4])
    with torch.no_grad():
        for _ in range(3):
            x = torch.tensor([[-1.0, 1.0]] * 3)
            out = b(x)
            assert torch.equal(out, torch.tensor([[0.0, 2.0]] * 3))
            assert torch.equal(x, torch.tensor([[0.0, 1.0]] * 3))  # eager clamps the caller's x


def test_inference_mode(sim, quiet):
    b = cg.bucketed(cg.graphify(nn.Linear(4, 4)), [4])
    with torch.inference_mode():
        for _ in range(2):
            assert b(torch.randn(3, 4)).shape == (3, 4)


def test_an_empty_batch(sim, quiet):
    lin = nn.Linear(4, 4)
    b = cg.bucketed(cg.graphify(lin), [4])
    with torch.no_grad():
        assert b(torch.randn(0, 4)).shape == (0, 4)


def test_a_returned_argument_is_the_argument(sim, quiet):
    b = cg.bucketed(cg.graphify(lambda x: (x, x * 2)), [4])
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 4)
            assert b(x)[0] is x


# -- 9975f9c: the probe's cached empty tags -----------------------------------------------------


def _old_policy() -> types.ModuleType:
    src = subprocess.run(["git", "show", "9975f9c^:cudagraphify/_policy.py"], cwd=ROOT,
                         capture_output=True, text=True)
    if src.returncode:
        pytest.skip("no git history here")
    mod = types.ModuleType("cudagraphify._policy_before_9975f9c")
    mod.__package__ = "cudagraphify"
    sys.modules[mod.__name__] = mod
    exec(compile(src.stdout, "_policy_before_9975f9c.py", "exec"), mod.__dict__)
    return mod


def _funcs() -> list:
    out = []
    for ns in (torch, F, torch.special, torch.linalg, torch.fft):
        for n in dir(ns):
            v = getattr(ns, n, None)
            if callable(v) and not isinstance(v, type):
                out.append(v)
    for n in dir(torch.Tensor):
        v = inspect.getattr_static(torch.Tensor, n, None)
        if type(v).__name__ == "getset_descriptor":
            out.append(v.__get__)
        v = getattr(torch.Tensor, n, None)
        if callable(v) and not isinstance(v, type):
            out.append(v)
    return out


def _tags(policy, f, a, k, accel):
    try:
        return policy.tags(f, a, dict(k), accel=accel)
    except Exception as e:  # noqa: BLE001 (the same error in both)
        return type(e).__name__


# functions whose rules changed on purpose since 9975f9c (one-argument ``repeat_interleave``,
# ``where(condition=)`` and uint8 masks are data-dependent shapes: review bucket4's B4-1, B4-6)
_RULES_SINCE = frozenset({torch.repeat_interleave, torch.Tensor.repeat_interleave, torch.where,
                          torch.Tensor.where, torch.Tensor.__getitem__, torch.Tensor.__setitem__,
                          torch.Tensor.index_put, torch.Tensor.index_put_, torch.index_put})


def test_cached_empty_tags_equal_the_rules_over_a_sweep():
    old = _old_policy()
    t, mask = torch.randn(3, 4), torch.rand(3, 4) > 0.5
    reps, gen = torch.tensor([1, 2, 0]), torch.Generator()
    argforms = [(t,), (t, mask), (t, reps), (t, 0.5, True), (3, 4), (t, "cpu")]
    kwforms = [{}, {"generator": gen}, {"generator": None}, {"pin_memory": True},
               {"device": "cpu"}, {"dropout_p": 0.1}, {"output_size": 3}]
    accels = (frozenset({"cuda"}), frozenset({"cpu"}))  # cpu: CPU tensors count as on device
    po, pn = old.OpPolicy(), new_policy.OpPolicy()
    diffs, tagged = [], 0
    for f in _funcs():
        for a in argforms:
            for k in kwforms:
                for accel in accels:
                    o = _tags(po, f, a, k, accel)
                    w = _tags(pn, f, a, k, accel)
                    tagged += bool(o)
                    if (o != w or _tags(pn, f, a, k, accel) != w) and f not in _RULES_SINCE:
                        diffs.append((f, a[:1], k, accel, o, w))
    assert tagged > 1000 and not diffs[:5]


def test_cached_empty_tags_equal_the_rules_on_recorded_calls():
    old = _old_policy()
    calls = []

    class Rec(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            calls.append((func, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True)
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout2d(0.2), nn.RReLU())
    gen = torch.Generator()
    with Rec():
        layer(torch.randn(2, 3, 8)).sum().backward()
        conv(torch.randn(2, 3, 6, 6))
        x = torch.randn(4, 4)
        x.nonzero(), x[x > 0], x.unique(), torch.where(x > 0), x.tolist(), x.sum().item()
        torch.repeat_interleave(x, torch.tensor([1, 2, 0, 1]), dim=0), x.shape, x.T
        torch.randn(3, generator=gen), torch.multinomial(x.abs(), 2), x.clone().bernoulli_(0.5)
        x.to("cpu"), x.cpu(), x.clone().copy_(x), torch.tensor([1.0]), F.dropout(x, 0.5, True)
        torch.empty(3).uniform_(generator=gen), torch.rand(2, pin_memory=False)
    assert len(calls) > 50
    po, pn = old.OpPolicy(), new_policy.OpPolicy()
    for accel in (frozenset({"cuda"}), frozenset({"cpu"})):
        for f, a, k in calls:
            assert pn.tags(f, a, k, accel=accel) == po.tags(f, a, k, accel=accel), f


def test_an_override_after_a_cached_empty_answer():
    p = new_policy.OpPolicy()
    t = torch.randn(2)
    assert p.tags(torch.Tensor.sinh, (t,), {}) == frozenset()
    p.tag_op(torch.Tensor.sinh, "HOST_SYNC")
    assert p.tags(torch.Tensor.sinh, (t,), {}) == frozenset({"HOST_SYNC"})
    assert not p.can_graph(torch.Tensor.sinh, p.tags(torch.Tensor.sinh, (t,), {}))
    p.mark_safe(torch.Tensor.cosh)
    assert p.tags(torch.Tensor.cosh, (t,), {}) == frozenset({"SAFE"})
    assert new_policy.default_policy.tags(torch.Tensor.sinh, (t,), {}) == frozenset()


def test_property_reads_keep_their_own_names():
    for n in ("shape", "dtype", "device", "T", "mT", "grad", "data", "is_cuda", "requires_grad"):
        for _ in range(2):  # the second from the cache
            assert new_policy.op_name(getattr(torch.Tensor, n).__get__) == f"Tensor.{n}"


def test_aliases_keep_their_own_names():
    assert new_policy.op_name(torch.saddmm) == "torch.saddmm"
    assert new_policy.op_name(torch.sspaddmm) == "torch.sspaddmm"
    assert new_policy.op_name(torch.dsmm) == "torch.dsmm"
    assert new_policy.op_name(torch.mm) == "torch.mm"
