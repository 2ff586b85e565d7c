"""Review of the sweep fixes (32a10f1 held tensors restored after the extra warm-ups,
a2aaf13 closure cells guarded whatever they hold, 38d0ade bucketed's StateGuard and relative
closeness), on the simulated backend.

All five findings were fixed after the review (each marked where its strict xfail was); the
rest are controls.
"""

from __future__ import annotations

import copy
import functools
import time

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _writes

from test_review_sweep import St
from test_review_sweep import eq
from test_review_sweep import pair

pytestmark = pytest.mark.usefixtures("quiet")


# -- 32a10f1: _writes.undone after the extra warm-ups ----------------------------------------


class AccMul(nn.Module):
    """A plain tensor attribute written by forward and saved by autograd (a mul)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.acc = torch.ones(4)

    def forward(self, x):
        with torch.no_grad():
            self.acc.add_(1)
        return self.lin(x) * self.acc


# (fixed: the versions of the tensors it reads from outside are restored after the extra
# warm-ups and the capture, as their values are)
def test_training_saved_held_tensor_backward_of_first_call(sim):
    torch.manual_seed(0)
    ref = AccMul().train()
    g = cg.graphify(copy.deepcopy(ref))
    for i in range(4):
        x = torch.randn(2, 4)
        want = ref(x)
        want.sum().backward()
        out = g(x)
        assert eq(g.acc, ref.acc), i
        assert eq(out.detach(), want.detach()), i
        out.sum().backward()
        assert eq(g.lin.weight.grad, ref.lin.weight.grad), i


def _spy_undone(monkeypatch):
    seen = []
    real = _writes.undone

    def spy(tensors):
        seen.append(sum(t.untyped_storage().nbytes() for t in tensors))
        return real(tensors)

    monkeypatch.setattr(_writes, "undone", spy)
    return seen


@pytest.mark.xfail(
    strict=True,
    reason="documented (README, the guard model): the tensors a forward reads from outside are "
    "copied whole for the extra warm-ups and a rehearsal, read-only ones too: the probe does "
    "not see every write (a functional batch norm's statistics, test_review_versions)",
)
def test_undone_clones_read_only_held_tensors(sim, monkeypatch):
    seen = _spy_undone(monkeypatch)
    table = torch.randn(1024, 1024)

    def f(x):
        return x @ table[:4, :4]

    g = cg.graphify(f, num_warmup_iters=2)
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 4)
            assert eq(g(x), f(x)), i
    assert seen, "no extra warm-up ran"
    assert max(seen) < table.untyped_storage().nbytes(), seen


@pytest.mark.parametrize("w", [1, 3])
def test_held_view_of_parameter_written_control(sim, w):
    class ViewOfParam(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.v = self.lin.bias.data  # (its own version counter)

        def forward(self, x):
            self.v.add_(1)
            return self.lin(x)

    ref, g = pair(ViewOfParam, num_warmup_iters=w)
    g.v = g.lin.bias.data
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert eq(g(x), ref(x)), i
            assert eq(g.lin.bias, ref.lin.bias), i


@pytest.mark.parametrize("w", [1, 3])
def test_held_view_of_buffer_written_control(sim, w):
    class ViewOfBuf(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("b", torch.zeros(100))
            self.v = self.b.data[:50]

        def forward(self, x):
            self.v.add_(1)
            return self.lin(x) + self.b.sum()

    ref, g = pair(ViewOfBuf, num_warmup_iters=w)
    g.v = g.b.data[:50]
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert eq(g(x), ref(x)), i
            assert eq(g.b, ref.b), i


class Box:
    def __init__(self):
        self.buf = torch.zeros(100)


class UsesBox(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, cache):
        cache.buf.add_(1)
        return self.lin(x) + cache.buf.sum()


@pytest.mark.parametrize("w", [1, 3])
def test_static_object_cache_keeps_real_call_writes_control(sim, w):
    ref, g = pair(UsesBox, static_argnames=("cache",), num_warmup_iters=w)
    c, r = Box(), Box()
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert eq(g(x, c), ref(x, r)), i
            assert eq(c.buf, r.buf), i
    assert cg.stats(g).replays > 0


@pytest.mark.parametrize("w", [1, 3])
def test_static_tensor_cache_keeps_real_call_writes_control(sim, w):
    ref, g = pair(St, static_argnames=("cache",), num_warmup_iters=w)
    c, r = torch.zeros(100), torch.zeros(100)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert eq(g(x, c), ref(x, r)), i
            assert eq(c, r), i


ACC = torch.zeros(100)
RUNS = []


def test_extra_warmup_raises_restores_control(sim):
    ACC.zero_()
    RUNS.clear()
    racc = torch.zeros(100)

    def f(x):
        ACC.add_(1)
        RUNS.append(1)
        if len(RUNS) == 2:  # the first extra warm-up
            raise RuntimeError("boom")
        return x + ACC[:4]

    g = cg.graphify(f, num_warmup_iters=3)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            racc.add_(1)
            assert eq(g(x), x + racc[:4]), i
            assert eq(ACC, racc), i


def test_inference_tensor_held_control(sim):
    with torch.inference_mode():
        acc = torch.zeros(100)
        racc = torch.zeros(100)

        def f(x):
            acc.add_(1)
            return x + acc[:4]

        g = cg.graphify(f, num_warmup_iters=3)
        for i in range(4):
            x = torch.randn(2, 4)
            racc.add_(1)
            assert eq(g(x), x + racc[:4]), i
            assert eq(acc, racc), i
    assert cg.stats(g).replays > 0


# -- a2aaf13: closure cells guarded whatever they hold ---------------------------------------


def _per_call_us(g, x, n=300):
    for _ in range(3):
        g(x)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            g(x)
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


# (a2aaf13 compared a closed-over list item by item on every call: 4.7 ms per call for
# 100k ints; 2d11bfd guards closure cells by identity only: a control now)
def test_closure_big_list_per_call_cost(sim):
    ids = list(range(100_000))

    def f(x):
        return x * 2

    def h(x):
        return x * len(ids)

    x = torch.randn(2, 4)
    with torch.no_grad():
        base = _per_call_us(cg.graphify(f), x)
        g = cg.graphify(h)
        cost = _per_call_us(g, x)
    assert cg.stats(g).replays > 0
    assert cost < 5 * base + 50, (cost, base)


# (fixed: a closure cell the capture's run rebound is put back, as a module attribute is)
def test_closure_nonlocal_counter_runs_once_too_often(sim):
    def make():
        step = 0

        def f(x):
            nonlocal step
            step += 1
            return x * step

        return f

    f, ref = make(), make()
    g = cg.graphify(f)
    with torch.no_grad():
        for i in range(6):
            x = torch.randn(2, 4)
            assert eq(g(x), ref(x)), i


def test_decorator_without_wraps_counter_runs_eagerly_note(sim):
    """(Behaviour change: a call-counting decorator without functools.wraps makes it eager.)"""

    def counted(fn):
        calls = 0

        def wrapper(*a):
            nonlocal calls
            calls += 1
            return fn(*a)

        return wrapper

    g = cg.graphify(counted(lambda x: x * 2))
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert eq(g(x), x * 2)
    assert cg.stats(g).replays == 0


def test_decorator_with_wraps_counter_control(sim):
    def counted(fn):
        calls = 0

        @functools.wraps(fn)
        def wrapper(*a):
            nonlocal calls
            calls += 1
            return fn(*a)

        return wrapper

    @counted
    def f(x):
        return x * 2

    g = cg.graphify(f)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert eq(g(x), x * 2)
    assert cg.stats(g).replays == 3


def test_closure_over_module_and_self_control(sim):
    torch.manual_seed(0)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def step_fn(self):
            def step(x):
                return self.lin(x) * 2

            return step

    m = Outer().eval()
    g = cg.graphify(m.step_fn())
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert eq(g(x), m.lin(x) * 2), i
    assert cg.stats(g).replays == 3


def test_lambdas_in_loop_and_bound_method_control(sim):
    class WithSuper(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return super().__call__  # (never called: forward below)

        def run(self, x):
            super().named_modules()
            return self.lin(x)

    torch.manual_seed(0)
    m = WithSuper().eval()
    gs = [cg.graphify(lambda x, s=s: x * s) for s in (1.0, 2.0)]
    gm = cg.graphify(m.run)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            for s, g in zip((1.0, 2.0), gs):
                assert eq(g(x), x * s)
            assert eq(gm(x), m.lin(x))
    assert all(cg.stats(g).replays == 3 for g in gs)


def test_torch_compiled_callable_control(sim):
    def f(x):
        return x * 2

    g = cg.graphify(torch.compile(f, backend="eager"))
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 4)
            assert eq(g(x), x * 2)
    assert cg.stats(g).replays == 3


# -- 38d0ade: bucketed's StateGuard ----------------------------------------------------------


class Pos(nn.Module):
    """Reads a module attribute the caller moves on every call (a position counter)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.pos = 0

    def forward(self, x):
        return self.lin(x) + 0 * self.pos


class Calls(nn.Module):
    """Counts its own calls in a module attribute (statistics)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x)


# (fixed: what the check read changing from call to call refuses the size once four states
# were checked, unpadded from then on; before, every call ran the three-run check)
def test_bucketed_counter_attribute_rechecks_every_call(sim):
    torch.manual_seed(0)
    m = Pos().eval()
    b = cg.bucketed(m, [4])
    with torch.no_grad():
        for i in range(6):
            m.pos = i
            x = torch.randn(3, 4)
            assert eq(b(x), m(x)), i
    (why,) = b.refused.values()
    assert "changes from call to call" in why and "Pos.pos" in why, why
    assert b.padded_calls == 2 * 4  # the check in four states, then unpadded


# (fixed as above: a forward that counts its own calls is refused after four checks)
def test_bucketed_self_counter_reruns_forward(sim):
    torch.manual_seed(0)
    m = Calls().eval()
    b = cg.bucketed(m, [4])
    with torch.no_grad():
        for i in range(10):
            b(torch.randn(3, 4))
    assert b.refused
    assert m.calls <= 3 * 4 + 10, m.calls  # four checks of three runs at most, one run a call


def test_bucketed_params_read_not_volatile_control(sim):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)).eval()
    b = cg.bucketed(m, [4])
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(3, 4)
            assert torch.allclose(b(x), m(x), atol=1e-6), i
    assert b.padded_calls == 2 + 4
    assert not any(st.guard.volatile for r in b.verified.values() for st in r.states)


def test_undone_copies_the_bytes_its_views_cover_not_their_whole_storage(monkeypatch):
    """A plain attribute that views part of a large tensor (a layer's slice of a cache): its
    own bytes are copied and put back, with its version, not the whole storage."""
    base = torch.zeros(1000)
    v, w = base[10:20], base[30:40:2]
    before = (v._version, w._version)
    sizes = []
    real = torch.Tensor.clone

    def clone(self, *a, **k):
        sizes.append(self.nbytes)
        return real(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "clone", clone)
    with _writes.undone([v, w]):
        v.fill_(1)
        w.fill_(2)
    assert sizes == [(38 + 1 - 10) * 4], sizes  # from v's first element to w's last
    assert not base.any()
    assert (v._version, w._version) == before


def test_a_cuda_capture_copies_only_the_host_tensors_read_from_outside():
    """A capture that runs no kernel (CUDA) copies only the CPU tensors read from outside
    (its run is real for them); one that does (the CPU double), or where a share_graph group
    or a static-state family checks its graph by running kernels, copies all."""
    import types

    from cudagraphify._capturing import Capturing

    def runs(kernels, share=None, states=()):
        me = types.SimpleNamespace(backend=types.SimpleNamespace(capture_runs_kernels=kernels),
                                   state=types.SimpleNamespace(share=share),
                                   sig=types.SimpleNamespace(static_states=states))
        return Capturing._runs_kernels(me)

    assert not runs(False)
    assert runs(True) and runs(False, share=object()) and runs(False, states=(1,))


def test_undone_host_only_puts_back_bytes_of_cpu_tensors_and_layouts_and_versions_of_all(
        monkeypatch):
    """Around a capture that runs no kernel: the CPU tensors' bytes are copied; every tensor's
    layout (a ``t_()`` runs on the host) and version are put back."""
    host, dev = torch.zeros(6), torch.zeros(2, 3)
    monkeypatch.setattr(torch.Tensor, "device", property(
        lambda t: torch.device("cuda") if t is dev else torch.device("cpu")))
    before = (host._version, dev._version)
    with _writes.undone([host, dev], host_only=True):
        host.add_(1)
        dev.add_(1)  # (recorded, not run, by a real capture: not put back here)
        dev.t_()
    assert not host.any() and bool((dev == 1).all())
    assert dev.shape == (2, 3) and dev.stride() == (3, 1)
    assert (host._version, dev._version) == before
