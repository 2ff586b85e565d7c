"""GPU tests of training through graphs: gradients, optimizers, dropout, autocast, refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify.bench.models import GPT

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("quiet_gpu")]

DEV = "cuda"
TOL = dict(rtol=2e-5, atol=2e-6)



def _gpt(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return GPT(256, 4, 4, dropout=dropout).to(DEV)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_ten_training_steps_match_eager(opt):
    ref = _gpt()
    g = cg.graphify(copy.deepcopy(ref))
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3)}[opt]
    o_ref, o_g = make(ref.parameters()), make(g.parameters())
    gen = torch.Generator(device=DEV).manual_seed(1)
    for _ in range(10):
        x = torch.randn(2, 16, 256, device=DEV, generator=gen)
        for model, o in ((ref, o_ref), (g, o_g)):
            o.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            o.step()
    for (name, p), q in zip(ref.named_parameters(), g.parameters()):
        torch.testing.assert_close(q, p, **TOL, msg=name)
    s = cg.stats(g)
    assert (s.captures, s.replays, s.eager) == (1, 9, 0), s


def test_gradient_accumulation_and_input_grads_match_eager():
    ref = _gpt()
    g = cg.graphify(copy.deepcopy(ref))
    for model in (ref, g):
        torch.manual_seed(3)
        for _ in range(4):
            x = torch.randn(2, 8, 256, device=DEV, requires_grad=True)
            model(x).sum().backward()
            model._last_x_grad = x.grad
    for p, q in zip(ref.parameters(), g.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **TOL)
    torch.testing.assert_close(g._last_x_grad, ref._last_x_grad, **TOL)
    assert cg.stats(g).replays == 3, cg.stats(g).eager_calls
    # The three replays add the static gradient buffers into .grad without a copy.
    assert _aliased(g) == 3 * len(list(g.parameters()))


def _aliased(model, what="grads_aliased") -> int:
    state = model.__dict__["_cudagraphify_state"]
    return sum(getattr(e, what) for e in state.cache.graphs(state))


def test_gradients_a_hook_keeps_and_set_to_none_grads_are_never_the_static_buffers():
    ref = _gpt()
    g = cg.graphify(copy.deepcopy(ref))
    kept = {}
    for model in (ref, g):
        w = model.ln_f.weight
        seen = kept.setdefault(id(model), [])
        w.register_hook(lambda grad, seen=seen: seen.append(grad))
        torch.manual_seed(4)
        for step in range(4):
            if step == 2:
                model.zero_grad(set_to_none=True)
            model(torch.randn(2, 8, 256, device=DEV)).sum().backward()
    for a, b in zip(kept[id(g)], kept[id(ref)]):
        torch.testing.assert_close(a, b, **TOL)
    for p, q in zip(ref.parameters(), g.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **TOL)
    # Replays 1 and 3 add the static buffers into .grad (all parameters but the hooked one);
    # replay 2 follows zero_grad: autograd adopts those buffers themselves as .grad (they are
    # moved to copies before replay 3 overwrites them).
    n = len(list(g.parameters()))
    assert (_aliased(g), _aliased(g, "grads_adopted")) == (2 * (n - 1), n - 1)
    assert cg.stats(g).replays == 3


def test_dropout_masks_are_fresh_and_gradients_follow_them():
    torch.manual_seed(0)
    lin = nn.Linear(512, 512).to(DEV)
    model = nn.Sequential(lin, nn.Dropout(0.25)).to(DEV).train()
    g = cg.graphify(model)
    x = torch.randn(64, 512, device=DEV)
    masks = []
    for _ in range(4):
        lin.zero_grad(set_to_none=True)
        y = g(x)
        y.sum().backward()
        mask = y != 0
        masks.append(mask)
        # the gradient must follow this call's mask: dL/db = sum over rows of mask / keep
        torch.testing.assert_close(lin.bias.grad, mask.float().sum(0) / 0.75, rtol=1e-5, atol=1e-5)
    assert cg.stats(g).replays == 3
    for a, b in zip(masks, masks[1:]):
        assert not torch.equal(a, b)
    keep = torch.stack(masks).float().mean().item()
    assert 0.73 < keep < 0.77
    model.eval()  # eval: dropout off, another graph
    with torch.no_grad():
        torch.testing.assert_close(g(x), lin(x), rtol=0, atol=0)


def test_autocast_bf16_training_matches_eager():
    ref = _gpt()
    g = cg.graphify(copy.deepcopy(ref))
    for _ in range(3):
        x = torch.randn(2, 16, 256, device=DEV)
        for model in (ref, g):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x)
            out.float().square().mean().backward()
            if model is ref:
                want = out
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        torch.testing.assert_close(g.blocks[0].attn.qkv.weight.grad, ref.blocks[0].attn.qkv.weight.grad,
                                   rtol=1e-2, atol=1e-4)
    assert cg.stats(g).replays == 2


def test_unsupported_backward_patterns_fail_clearly_or_run_eagerly():
    ref = _gpt()
    g = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(1, 8, 256, device=DEV)
    g(x).sum().backward()  # warm-up + capture
    assert cg.stats(g).captures == 1, cg.stats(g).eager_calls
    # retain_graph re-use: a clear error, not a wrong gradient
    y = g(x).sum()
    y.backward(retain_graph=True)
    with pytest.raises(cg.CudagraphifyError, match="retain_graph"):
        y.backward()
    del y  # its autograd graph would make the next capture wait (see the test below)
    # double backward: refused
    xr = x.clone().requires_grad_()
    g(xr).sum().backward()  # another signature (x requires grad): warm-up + capture
    assert cg.stats(g).captures == 2, list(cg.stats(g).eager_calls)
    with pytest.raises(cg.CudagraphifyError, match="create_graph"):
        torch.autograd.grad(g(xr).sum(), xr, create_graph=True)
    # two forwards, then one backward: the second call gets a graph of its own (the first's
    # activations wait for the backward), gradients stay right
    g.zero_grad(set_to_none=True), ref.zero_grad(set_to_none=True)
    x2 = torch.randn(1, 8, 256, device=DEV)
    captures = cg.stats(g).captures
    (g(x).sum() + g(x2).sum()).backward()
    (ref(x).sum() + ref(x2).sum()).backward()
    for p, q in zip(ref.parameters(), g.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **TOL)
    assert cg.stats(g).captures == captures + 1, cg.stats(g)


def test_three_forwards_per_backward_two_graphs_in_flight_the_third_eager():
    # Gradient accumulation over three micro-batches: the first two forwards of a step replay a
    # graph each (each with its own pool: the first's saved activations survive the second's
    # replay), the third runs eagerly while both wait for the backward.
    ref = _gpt()
    g = cg.graphify(copy.deepcopy(ref))
    gen = torch.Generator(device=DEV).manual_seed(2)
    opt_g = torch.optim.SGD(g.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(5):
        lg = lr = 0
        for _ in range(3):
            x = torch.randn(2, 8, 256, device=DEV, generator=gen)
            o, w = g(x), ref(x)
            assert torch.equal(o, w), step  # (the forward graph runs eager's kernels)
            lg, lr = lg + o.square().mean(), lr + w.square().mean()
        lg.backward(), lr.backward()
        for p, q in zip(ref.parameters(), g.parameters()):
            torch.testing.assert_close(q.grad, p.grad, **TOL)
        opt_g.step(), opt_r.step(), opt_g.zero_grad(), opt_r.zero_grad()
    s = cg.stats(g)
    pending = sum(n for r, n in s.eager_calls.items() if "has not run yet" in r)
    assert (s.captures, s.replays, pending) == (2, 9, 4), s


def test_capture_while_an_earlier_graph_is_alive_succeeds():
    # It used to fail (and be deferred): the alive autograd graph holds the parameters'
    # AccumulateGrad nodes, made on another stream, and the capture's backward reached them.
    # Captures now differentiate aliases of the parameters and never touch those nodes.
    ref = _gpt()
    g = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(1, 8, 256, device=DEV)
    g(x).sum().backward()  # warm-up + capture
    keep = g(x)  # a replay whose autograd graph stays alive (not yet backwarded)
    x2 = torch.randn(1, 16, 256, device=DEV)  # a new signature: warm-up + capture now
    torch.testing.assert_close(g(x2), ref(x2), **TOL)
    s = cg.stats(g)
    assert (s.captures, s.replays, s.eager) == (2, 1, 0), s
    g.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    keep.sum().backward()  # the earlier call's backward still runs, through its graph
    ref(x).sum().backward()
    for p, q in zip(ref.parameters(), g.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **TOL)


def test_gradients_kept_from_autograd_grad_survive_the_next_backward():
    ref = _gpt()
    g = cg.graphify(copy.deepcopy(ref))
    pg, pr = list(g.parameters()), list(ref.parameters())
    x1, x2 = (torch.randn(1, 8, 256, device=DEV) for _ in range(2))
    g(x1).sum().backward()  # warm-up + capture
    ga = torch.autograd.grad(g(x1).sum(), pg)  # replay: aliases of the static buffers
    gb = torch.autograd.grad(g(x2).sum(), pg)  # the next replay must not change ga
    ra = torch.autograd.grad(ref(x1).sum(), pr)
    rb = torch.autograd.grad(ref(x2).sum(), pr)
    for a, b, want_a, want_b in zip(ga, gb, ra, rb):
        torch.testing.assert_close(a, want_a, **TOL)
        torch.testing.assert_close(b, want_b, **TOL)
    assert cg.stats(g).replays == 2


def test_batchnorm_running_statistics_match_eager_after_training_steps():
    # BatchNorm's kernels update running statistics without bumping their version counter: the
    # training capture's extra warm-up once advanced them a second time, silently.
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                        nn.LazyLinear(4)).to(DEV)
    ref(torch.randn(2, 3, 8, 8, device=DEV))  # materialise the lazy layer
    g = cg.graphify(copy.deepcopy(ref))
    o_ref, o_g = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, g))
    for _ in range(4):
        x = torch.randn(4, 3, 8, 8, device=DEV)
        for model, o in ((ref, o_ref), (g, o_g)):
            model(x).square().mean().backward()
            o.step()
            o.zero_grad(set_to_none=True)
    for (name, b), c in zip(ref.named_buffers(), g.buffers()):
        torch.testing.assert_close(c, b, **TOL, msg=name)
    for (name, p), q in zip(ref.named_parameters(), g.parameters()):
        torch.testing.assert_close(q, p, **TOL, msg=name)
    s = cg.stats(g)
    assert (s.captures, s.replays) == (1, 3), s


def test_a_kept_view_of_an_adopted_gradient_makes_the_next_call_eager():
    torch.manual_seed(0)
    lin = nn.Linear(3, 2).to(DEV)
    g = cg.graphify(copy.deepcopy(lin))
    xs = [torch.randn(4, 3, device=DEV) for _ in range(5)]
    for x in xs[:3]:  # warm-up call, then replays adopting the buffers as .grad
        g.zero_grad(set_to_none=True)
        g(x).square().sum().backward()
    kept = g.weight.grad.view(-1)  # outlives zero_grad: a replay must not overwrite it
    want = kept.clone()
    g.zero_grad(set_to_none=True)
    g(xs[3]).square().sum().backward()
    assert torch.equal(kept, want)
    (reason,) = cg.stats(g).eager_calls
    assert "still referenced" in reason
    lin.zero_grad(set_to_none=True)
    lin(xs[3]).square().sum().backward()
    torch.testing.assert_close(g.weight.grad, lin.weight.grad, **TOL)
    del kept
    g.zero_grad(set_to_none=True)
    replays = cg.stats(g).replays
    g(xs[4]).square().sum().backward()  # nothing held any more: replayed
    assert cg.stats(g).replays == replays + 1


def test_kept_grad_tensors_keep_their_values():
    # Accumulating without zeroing: a kept .grad (the same tensor object) moves to a copy with
    # .grad before a replay, and replays go on. Kept across zero_grad(set_to_none=True), it can
    # no longer be found and moved: those calls run eagerly rather than overwrite it.
    torch.manual_seed(0)
    ref = _gpt()
    g = cg.graphify(copy.deepcopy(ref))
    for zero in (False, True):
        kept, kept_ref = [], []
        for step in range(4):
            x = torch.randn(2, 8, 256, device=DEV)
            for model, keep in ((g, kept), (ref, kept_ref)):
                if zero or step < 2:  # steps 2 and 3 accumulate onto step 1's adopted .grad
                    model.zero_grad(set_to_none=True)
                model(x).square().mean().backward()
                keep.append(model.blocks[0].mlp.fc.weight.grad)
        for a, b in zip(kept, kept_ref):  # none was overwritten by a later replay
            torch.testing.assert_close(a, b, **TOL)
        s = cg.stats(g)
        if not zero:
            assert (s.captures, s.replays, s.eager) == (1, 3, 0), s
        else:
            assert s.eager == 3 and all("still referenced" in r for r in s.eager_calls), s


_GPU_SCALE = torch.ones(())  # rebound by the test below (a CPU 0-dim tensor; moved in backward)


def _gpu_scale(grad):
    return grad * _GPU_SCALE.to(grad.device)


class _HelperScaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return _gpu_scale(grad)  # (reads the global through a helper)


class _HelperNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        return _HelperScaled.apply(self.lin(x)).relu()


def test_a_backward_reading_a_rebound_global_through_a_helper_keeps_eagers_gradients():
    global _GPU_SCALE
    _GPU_SCALE = torch.ones(())
    torch.manual_seed(0)
    ref = _HelperNet().to(DEV)
    g = cg.graphify(copy.deepcopy(ref))
    for call in range(4):
        if call == 2:
            _GPU_SCALE = torch.full((), 3.0)
        x = torch.randn(8, 64, device=DEV)
        for m in (ref, g):
            m.zero_grad(set_to_none=True)
            m(x).sum().backward()
        assert torch.equal(ref.lin.weight.grad, g.lin.weight.grad), call
    s = cg.stats(g)
    (why,) = s.eager_calls
    assert "_HelperScaled.backward [PYTHON_STATE]" in why and "'_GPU_SCALE'" in why, why
    assert s.captures >= 1 and s.replays >= 1, s  # (its Linear is a graphed piece)


def test_no_accumulategrad_stream_warning_on_the_first_replays():
    # (the first call's real call runs on the caller's stream, so each parameter's
    # AccumulateGrad node is the caller's from the start: no "stream does not match" warning)
    import warnings
    ref = _gpt()
    g = cg.graphify(copy.deepcopy(ref))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            x = torch.randn(2, 16, 256, device=DEV)
            for m in (ref, g):
                m.zero_grad(set_to_none=True)
                m(x).square().mean().backward()
        torch.cuda.synchronize()
    s = cg.stats(g)
    assert s.captures >= 1 and s.replays >= 2, s
    for (name, p), q in zip(ref.named_parameters(), g.parameters()):
        torch.testing.assert_close(q.grad, p.grad, **TOL, msg=name)
    stream = [str(w.message) for w in caught if "AccumulateGrad" in str(w.message)]
    assert not stream, stream


class _DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(256, 256)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.lin(x))


@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference, 3 warm-ups"])
def test_the_random_stream_after_each_call_is_eagers(grad):
    # (the extra warm-ups draw: their draws are put back, so seeded runs draw eager's masks)
    torch.manual_seed(0)
    ref = _DropNet().to(DEV)
    g = cg.graphify(copy.deepcopy(ref), **({} if grad else {"num_warmup_iters": 3}))
    xs = [torch.randn(8, 256, generator=torch.Generator().manual_seed(i)).to(DEV)
          for i in range(5)]
    runs = []
    for m in (ref, g):
        torch.manual_seed(7)
        out = []
        for x in xs:
            with torch.set_grad_enabled(grad):
                y = m(x)
                if grad:
                    y.sum().backward()
            out.append((y.detach().clone(), torch.cuda.get_rng_state().clone()))
        runs.append(out)
    for i, ((a, ra), (b, rb)) in enumerate(zip(*runs)):
        assert torch.equal(a, b), f"call {i}: output differs from eager's"
        assert torch.equal(ra, rb), f"call {i}: the random state after it differs from eager's"
    s = cg.stats(g)
    assert s.captures == 1 and s.replays == 4, s


class _SharedGrad(nn.Module):
    """``weight + delta``: autograd gives both parameters one gradient tensor."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 64) * 0.1)
        self.delta = nn.Parameter(torch.zeros(64, 64))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight + self.delta)


def test_two_parameters_given_one_gradient_keep_their_own_grad_memory():
    # (each adopted the same static buffer as .grad: a clip's in-place scale applied twice)
    torch.manual_seed(0)
    ref = _SharedGrad().to(DEV)
    g = cg.graphify(copy.deepcopy(ref))
    o_ref, o_g = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, g))
    for step in range(5):
        x = torch.randn(8, 64, device=DEV)
        for model, o in ((ref, o_ref), (g, o_g)):
            o.zero_grad()
            model(x).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        assert g.weight.grad.data_ptr() != g.delta.grad.data_ptr(), step
        for name, p in ref.named_parameters():  # (a clip applied twice: coef squared)
            torch.testing.assert_close(getattr(g, name).grad, p.grad, **TOL,
                                       msg=f"step {step}: {name}.grad")
        o_ref.step(), o_g.step()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(getattr(g, name), p, **TOL, msg=name)
    s = cg.stats(g)
    assert (s.captures, s.replays, s.eager) == (1, 4, 0), s
