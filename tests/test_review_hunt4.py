"""Review hunt 4: silent differences from eager in TRAINING loops as users write them (an eager
twin made with ``copy.deepcopy`` before ``graphify``, several steps, loss, gradients, parameters,
buffers and optimizer state compared bitwise).

Finding (silent: no error, no warning, no eager call; was a strict xfail asserting eager's
result, fixed: a plain test now):

- F1: two parameters whose gradients autograd computes as ONE tensor (``W + delta`` fed to
  ``F.linear``; ``x + (pos + seg)``; ``torch.cat([a, b]) + c``: ``add``'s backward hands the
  same tensor, or views of it, to both operands). The backward graph returns that one static
  buffer for both, and with ``.grad`` None (``zero_grad()``'s default, set_to_none=True)
  ``TrainingGraph._hand_out`` hands each parameter ``buf.detach()`` to adopt: two TensorImpls of
  one storage, each with use_count 1, so AccumulateGrad steals both and the two ``.grad`` share
  memory. Eager's AccumulateGrad sees the shared tensor with use_count 2 and clones it for one
  of them, never two ``.grad`` on one memory. The gradients' values are right, so a plain
  ``opt.step()`` is right; every in-place write to ``.grad`` before the step is applied twice:
  ``clip_grad_norm_`` (its ``_foreach_mul_``), ``GradScaler.unscale_``, a manual average
  ``p.grad /= n``. From the second step on, parameters, loss and optimizer state differ.
  With ``zero_grad(set_to_none=False)`` (``.grad`` kept: the buffer is added into it) and with
  gradient accumulation (``grads_held`` moves each ``.grad`` to a copy of its own before the
  next replay) it is right: controls.
  Where: ``_training.TrainingGraph._hand_out`` (mode 2, adoption) / ``_watch_gradients``:
  parameter gradient buffers that share a storage (with one another; a view of one another)
  are adopted each, where at most one per storage may be.

Controls (plain tests, all pass): SGD with momentum, Adam, AdamW(foreach) with both
``zero_grad`` modes; accumulation over two micro-batches with ``clip_grad_norm_``; two
micro-batches whose backwards run in reverse order; ``autograd.grad`` of a subset of
parameters; ``backward(inputs=...)`` of a subset; an input requiring grad, ``retain_grad()`` and
a hook on the output registered after the call; parameters frozen and unfrozen between steps;
BatchNorm + Dropout with ``train()``/``eval()`` switches and ``no_grad`` evaluation between
steps; tied weights; a module called twice; ``ReLU(inplace=True)``; a parameter renormed in
place in ``forward`` (and the version error eager raises for an earlier use of it); Embedding
with ``max_norm``; ``retain_graph=True`` twice and ``create_graph=True`` (loud, as documented).
CPU, on the simulated backend (``sim_rng``: a capture draws no random numbers).
GPU reproductions: ``.ci/review/hunt4/``.

Not here (the CPU double cannot answer it): ``torch.utils.checkpoint(use_reentrant=False)``
with ``preserve_rng_state=True`` around a Dropout differs from eager on the double (its
recompute's RNG restore, ``fork_rng``/``set_rng_state``, is host Python a replay does not
repeat); on CUDA the stash (``torch.cuda.get_rng_state``) raises inside a capture
("Cannot call CUDAGeneratorImpl::current_seed"), so the call should run eagerly.
``.ci/review/hunt4/b_controls.py`` checks it (and the other three checkpoint variants) on a GPU.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudagraphify as cg

pytestmark = pytest.mark.usefixtures("quiet")


def _counts(g):
    s = cg.stats(g)
    return s.captures, s.replays, s.eager


def _twins(make):
    torch.manual_seed(0)
    ref = make()
    return cg.graphify(copy.deepcopy(ref)), ref


def _run(make, step, steps=5, batch=3):
    """``step(model, x, state, i)`` on a graphed model and its eager twin, each with its own
    ``state`` (optimizer...), the same inputs and seeds; returns the graphed model after
    asserting everything eager has bitwise: what the steps return, parameters, ``.grad``,
    buffers."""
    g, ref = _twins(make)
    sg, sr = {}, {}
    for i in range(steps):
        torch.manual_seed(100 + i)
        x = torch.randn(batch, 4)
        torch.manual_seed(1000 + i)
        a = step(g, x, sg, i)
        torch.manual_seed(1000 + i)
        b = step(ref, x, sr, i)
        for k in b:
            assert torch.equal(a[k], b[k]), f"step {i}: {k} differs from eager's"
        for (n, p), q in zip(g.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), f"step {i}: parameter {n} differs from eager's"
            assert (p.grad is None) == (q.grad is None), f"step {i}: {n}.grad"
            if q.grad is not None:
                assert torch.equal(p.grad, q.grad), f"step {i}: {n}.grad differs from eager's"
        for (n, p), q in zip(g.named_buffers(), ref.buffers()):
            assert torch.equal(p, q), f"step {i}: buffer {n} differs from eager's"
    return g


def _opt(m, st, kind="sgd"):
    if "opt" not in st:
        ps = list(m.parameters())
        st["opt"] = {
            "sgd": lambda: torch.optim.SGD(ps, lr=0.1),
            "sgdm": lambda: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            "adam": lambda: torch.optim.Adam(ps, lr=0.01, foreach=False),
            "adamw_foreach": lambda: torch.optim.AdamW(ps, lr=0.01, foreach=True),
        }[kind]()
    return st["opt"]


def _opt_state(st):
    return {f"{i}.{k}": v for i, s in enumerate(st["opt"].state.values())
            for k, v in s.items() if isinstance(v, torch.Tensor)}


def _mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 4))


# -- F1: two parameters whose gradients are one tensor: their .grad share memory ---------------

class _Delta(nn.Module):
    """A weight and a learned delta added to it (diff fine-tuning, a LoRA merged at full rank):
    ``add``'s backward hands the same tensor to both."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.delta = nn.Parameter(torch.zeros(4, 4))

    def forward(self, x):
        return F.linear(x, self.weight + self.delta)


class _PosSeg(nn.Module):
    """Two learned embeddings summed before they are added to the input (positional +
    segment)."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(3, 4))
        self.seg = nn.Parameter(torch.randn(3, 4))
        self.out = nn.Linear(4, 4)

    def forward(self, x):
        return self.out(x + (self.pos + self.seg))


class _CatPlus(nn.Module):
    """``cat([a, b]) + c``: a's and b's gradients are views of c's."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(2, 4))
        self.b = nn.Parameter(torch.randn(2, 4))
        self.c = nn.Parameter(torch.zeros(4, 4))

    def forward(self, x):
        return F.linear(x, torch.cat([self.a, self.b]) + self.c)


def _clip_step(set_to_none=True):
    def step(m, x, st, i):
        opt = _opt(m, st, "sgdm")
        opt.zero_grad(set_to_none=set_to_none)
        loss = m(x).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
        grads = {f"grad {n}": p.grad.clone() for n, p in m.named_parameters()}
        opt.step()
        return {"loss": loss.detach(), **grads, **_opt_state(st)}
    return step


def _scaler_step(m, x, st, i):
    opt = _opt(m, st, "adam")
    scaler = st.setdefault("scaler", torch.amp.GradScaler("cpu", init_scale=8.0))
    opt.zero_grad()
    loss = m(x).square().mean()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    grads = {f"grad {n}": p.grad.clone() for n, p in m.named_parameters()}
    scaler.step(opt)
    scaler.update()
    return {"loss": loss.detach(), **grads}


def _average_step(m, x, st, i):
    opt = _opt(m, st)
    opt.zero_grad()
    loss = m(x).square().mean()
    loss.backward()
    for p in m.parameters():  # e.g. an average over workers or micro-batches, by hand
        p.grad /= 4
    grads = {f"grad {n}": p.grad.clone() for n, p in m.named_parameters()}
    opt.step()
    return {"loss": loss.detach(), **grads}


# F1 (fixed): two parameters whose gradients are one tensor got .grad on one memory (each
# adopted the same static buffer): in-place writes to .grad applied twice.


def test_f1_two_grads_on_one_memory_after_a_replay(sim_rng):
    g, ref = _twins(_Delta)
    for _ in range(3):  # the first call captures, the others replay
        x = torch.randn(3, 4)
        for m in (g, ref):
            m.zero_grad()
            m(x).square().mean().backward()
    assert _counts(g)[1] >= 1
    assert ref.weight.grad.untyped_storage().data_ptr() != \
        ref.delta.grad.untyped_storage().data_ptr()  # eager: two memories
    assert g.weight.grad.untyped_storage().data_ptr() != \
        g.delta.grad.untyped_storage().data_ptr(), "weight.grad and delta.grad share memory"


@pytest.mark.parametrize("make", [_Delta, _PosSeg, _CatPlus], ids=["delta", "pos_seg", "cat"])
def test_f1_clip_grad_norm_applies_twice(sim_rng, make):
    g = _run(make, _clip_step())
    assert _counts(g) == (1, 4, 0)


def test_f1_grad_scaler_unscales_twice(sim_rng):
    _run(_PosSeg, _scaler_step)


def test_f1_manual_gradient_average_divides_twice(sim_rng):
    _run(_Delta, _average_step)


def test_control_f1_models_plain_optimizer_step(sim_rng):
    def step(m, x, st, i):
        opt = _opt(m, st, "sgdm")
        opt.zero_grad()
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        return {"loss": loss.detach(), **_opt_state(st)}
    for make in (_Delta, _PosSeg, _CatPlus):
        g = _run(make, step)
        assert _counts(g) == (1, 4, 0)


def test_control_f1_models_clip_with_set_to_none_false(sim_rng):
    for make in (_Delta, _PosSeg, _CatPlus):
        g = _run(make, _clip_step(set_to_none=False))
        assert _counts(g) == (1, 4, 0)


def test_control_f1_model_accumulation_then_clip(sim_rng):
    def step(m, x, st, i):
        opt = _opt(m, st)
        if i % 2 == 0:
            opt.zero_grad()
        loss = m(x).square().mean() / 2
        loss.backward()
        if i % 2 == 1:  # the second micro-batch's replay moved each .grad to its own copy
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
            opt.step()
        return {"loss": loss.detach()}
    _run(_Delta, step, steps=6)


# -- controls: optimizers, zero_grad, accumulation --------------------------------------------

@pytest.mark.parametrize("kind", ["sgdm", "adam", "adamw_foreach"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_control_optimizer_steps(sim_rng, kind, set_to_none):
    def step(m, x, st, i):
        opt = _opt(m, st, kind)
        opt.zero_grad(set_to_none=set_to_none)
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        return {"loss": loss.detach(), **_opt_state(st)}
    g = _run(_mlp, step)
    assert _counts(g) == (1, 4, 0)


def test_control_accumulation_with_clip_grad_norm(sim_rng):
    def step(m, x, st, i):
        opt = _opt(m, st, "sgdm")
        if i % 2 == 0:
            opt.zero_grad()
        loss = m(x).square().mean() / 2
        loss.backward()
        if i % 2 == 1:
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            torch.nn.utils.clip_grad_value_(m.parameters(), 0.01)
            opt.step()
        return {"loss": loss.detach()}
    _run(_mlp, step, steps=8)


def test_control_two_micro_batches_backward_in_reverse_order(sim_rng):
    def step(m, x, st, i):
        opt = _opt(m, st, "sgdm")
        opt.zero_grad()
        l1 = m(x).square().mean()
        l2 = m(x * 2).pow(3).mean()
        l2.backward()
        l1.backward()
        opt.step()
        return {"l1": l1.detach(), "l2": l2.detach()}
    g = _run(_mlp, step, steps=6)
    assert _counts(g)[0] == 2  # a second graph for the call made while the first waits


# -- controls: autograd variants ---------------------------------------------------------------

def test_control_autograd_grad_of_a_subset_then_manual_update(sim_rng):
    def step(m, x, st, i):
        loss = m(x).square().mean()
        (gw,) = torch.autograd.grad(loss, [m[0].weight])
        with torch.no_grad():
            m[0].weight.sub_(0.1 * gw)
        return {"loss": loss.detach(), "gw": gw}
    _run(_mlp, step)


def test_control_backward_inputs_subset(sim_rng):
    def step(m, x, st, i):
        opt = _opt(m, st, "sgdm")
        opt.zero_grad()
        loss = m(x).square().mean()
        loss.backward(inputs=[m[2].weight, m[0].bias])
        opt.step()
        return {"loss": loss.detach()}
    _run(_mlp, step)


def test_control_input_grad_retain_grad_and_output_hook(sim_rng):
    def step(m, x, st, i):
        x = x.clone().requires_grad_(True)
        out = m(x)
        out.retain_grad()
        seen = []
        out.register_hook(lambda grad: seen.append(grad.clone()))
        (out * torch.arange(4.0)).sum().backward()
        got = {"x.grad": x.grad, "out.grad": out.grad, "hook": seen[0]}
        m.zero_grad()
        return got
    _run(_mlp, step)


def test_control_retain_graph_and_create_graph_are_loud(sim_rng):
    """A second backward through one call and double backward raise (documented); calls that
    do not raise (a signature's first calls run eagerly) give eager's gradients."""
    g, ref = _twins(_mlp)
    raised = {"retain": 0, "create": 0}
    for _ in range(4):
        x = torch.randn(3, 4)
        for m in (g, ref):
            m.zero_grad()
        ref(x).sum().backward(retain_graph=True)
        loss = g(x).sum()
        loss.backward(retain_graph=True)
        try:
            loss.backward()
        except cg.CudagraphifyError:
            raised["retain"] += 1
            continue
        finally:
            g.zero_grad()
        # (not raised: eager's twice)
    for _ in range(4):
        x = torch.randn(3, 4)
        grads = []
        for m in (ref, g):
            xr = x.clone().requires_grad_(True)
            m.zero_grad()
            try:
                (gx,) = torch.autograd.grad(m(xr).square().sum(), xr, create_graph=True)
                gx.square().sum().backward()
            except cg.CudagraphifyError:
                raised["create"] += 1
                break
            grads.append(m[0].weight.grad.clone())
        else:
            assert torch.equal(grads[0], grads[1])
    assert raised["retain"] >= 1 and raised["create"] >= 1, raised


# -- controls: model details -------------------------------------------------------------------

def test_control_freeze_and_unfreeze_between_steps(sim_rng):
    def step(m, x, st, i):
        opt = _opt(m, st, "sgdm")
        opt.zero_grad()
        m[0].requires_grad_(i % 3 != 1)
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        return {"loss": loss.detach()}
    _run(_mlp, step, steps=7)


class _BNDrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        return self.out(self.drop(torch.relu(self.bn(self.lin(x)))))


def test_control_batchnorm_dropout_train_eval_switches(sim_rng):
    def step(m, x, st, i):
        opt = _opt(m, st, "adam")
        opt.zero_grad()
        m.train(i % 3 != 2)
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        m.eval()
        with torch.no_grad():
            ev = m(x)
        m.train()
        return {"loss": loss.detach(), "eval": ev}
    _run(_BNDrop, step, steps=7)


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.inner(self.inner(x) * self.scale)


class _Renorm(nn.Module):
    """A max-norm constraint applied in forward, in place on a trainable weight."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.renorm_(2, 0, 0.5)
        return self.out(torch.tanh(self.lin(x)))


class _EmbMax(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, max_norm=0.7)
        self.out = nn.Linear(4, 4)

    def forward(self, idx):
        return self.out(self.emb(idx))


@pytest.mark.parametrize("make", [_Tied, _Twice, _Renorm], ids=["tied", "twice", "renorm"])
def test_control_parameter_sharing_and_writes_in_forward(sim_rng, make):
    g = _run(make, _clip_step())
    assert _counts(g) == (1, 4, 0)


def test_control_embedding_max_norm(sim_rng):
    def step(m, x, st, i):
        opt = _opt(m, st, "sgdm")
        opt.zero_grad()
        loss = m((x.abs() * 3).long().clamp(0, 9)).square().mean()
        loss.backward()
        opt.step()
        return {"loss": loss.detach()}
    _run(_EmbMax, step)


def test_control_earlier_use_of_a_weight_forward_renorms_raises_as_eager(sim_rng):
    g, ref = _twins(_Renorm)
    for _ in range(4):
        x = torch.randn(3, 4)
        raised = []
        for m in (g, ref):
            aux = m.lin.weight.square().sum()  # saves the weight before forward writes it
            loss = m(x).square().mean() + aux
            with pytest.raises(RuntimeError, match="inplace") as e:
                loss.backward()
            raised.append(e)
            m.zero_grad()
        assert len(raised) == 2
    assert _counts(g)[1] >= 1
