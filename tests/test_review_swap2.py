"""Second review of swap_tensors in a forward (74edaf2, a95d120): the runs beyond the real call
note their swaps in a per-thread log (cudagraphify/_writes.py) and swap them back before every
put-back. CPU, on the ``sim`` double of conftest.py.

Findings were strict xfails on the reviewed code; F1, F2 and F4 are fixed (plain tests now), F3
stays a strict xfail (open: README, Limitations). Controls are plain tests.

GPU scenarios: .ci/review/swap2/run_all.sh."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _hooks, _writes

from test_warmups import _twins

_SWAP = torch._C._swap_tensor_impl
_G: dict = {}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture
def faithful(sim, monkeypatch):
    """The simulated capture, answering torch.cuda.is_current_stream_capturing() as a real one
    does (as tests/test_engine.py's fixture)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: sim.capturing)
    return sim


def _clean() -> None:
    """The patch is gone and no watch or swap log is left behind."""
    assert torch._C._swap_tensor_impl is _SWAP
    assert not _writes._swap_logs and not _hooks._active and _hooks._users == 0


# -- F1: a probe's records made while a swap is pending are put back on the other object -------

class CapturedPathSwaps(nn.Module):
    """Swaps two globals (and reads one) only while captured: an eager call never touches
    them."""

    def __init__(self, write: bool):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.write = write
        _G[id(self)] = (torch.zeros(4), torch.ones(4))

    def forward(self, x):
        y = self.lin(x)
        if torch.cuda.is_current_stream_capturing():
            g1, g2 = _G[id(self)]
            torch.utils.swap_tensors(g1, g2)
            if self.write:
                g1.add_(1)
            y = y + g1 * 0
        return y


# finding F1 (silent wrong value): the capture's probe records the layout and version of g1
# (Probe.layouts / Probe.versions: ``run_layouts``, ``run_versions``) when an op first takes it,
# after the swap: those of g2's contents. capture()'s put_seen_back / put_versions_back swap back
# first (a95d120) and then apply those records to g1, which holds its own contents again:
# ``g1.set_(g2's storage)``. g1 is not held (the real call never read it), so no outer
# layouts_kept repairs it: after the first call g1 aliases g2's memory (reads 1s, eager: 0s), and
# in the write variant g2's version keeps the capture's bump. The same records are taken by the
# extra warm-ups (``seen``, ``versions``) and the rehearsal (``rehearsal.versions``, see F2).
# (fixed: _writes.holder) finding F1: records taken on a swapped object are put back on it after
# the swap back: a global left aliasing another's memory
@pytest.mark.parametrize("write", [False, True])
def test_F1_a_tensor_swapped_on_the_captured_path_is_left_aliasing_the_other(faithful, write):
    m = cg.graphify(CapturedPathSwaps(write))
    g1, g2 = _G[id(m)]
    p1, p2 = g1.data_ptr(), g2.data_ptr()
    with torch.no_grad():
        m(torch.randn(3, 4))
    _clean()
    # eager never swaps them (no call of it is captured)
    assert (g1.data_ptr(), g2.data_ptr()) == (p1, p2), "g1 now views g2's memory"
    assert torch.equal(g1, torch.zeros(4)) and torch.equal(g2, torch.ones(4))
    assert (g1._version, g2._version) == (0, 0)


# -- F2: the rehearsal's versions ---------------------------------------------------------------

class PingPong(nn.Module):
    """Double buffering through plain tensor attributes: each call swaps ``a`` and ``b`` and
    counts ``a`` up in place. Asks whether it is captured (a host-syncing shortcut when not, as
    HF's mask code), so that a trusted policy rehearses its captured path."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.a, self.b = torch.zeros(4), torch.ones(4)

    def forward(self, x):
        y = self.lin(x)
        if not torch.cuda.is_current_stream_capturing():
            if bool((y > -1e9).all()):  # (a host sync: the warm-up's finding)
                pass
        torch.utils.swap_tensors(self.a, self.b)
        self.a.add_(1)
        return y * self.a


def _trusting() -> cg.OpPolicy:
    policy = cg.OpPolicy()
    policy.TRUSTED_CAPTURED_PATHS = (__name__,)
    return policy


# finding F2 (silent: version counter, as S2b): rehearse() ends with
# ``put_versions_back(rehearsal.versions)`` outside its contexts (no capture() around it to
# repair): the record (a, version) was taken when ``a`` held b's contents (after the swap, before
# its add_), and is applied to ``a`` after the swap back: the real call's counter of ``a`` is set
# to the other tensor's (1 -> 0 on the first call; eager 1, 1, 2 / cudagraphify 0, 1, 1). Where
# the values coincide with a version an earlier autograd graph saved, eager's "modified by an
# inplace operation" error can also pass silently.
# (fixed: _writes.holder) finding F2: the rehearsal's versions, taken on swapped objects, are put
# back after the swap back
def test_F2_the_rehearsals_versions_land_on_the_swapped_back_object(faithful):
    ref, g = _twins(PingPong, op_policy=_trusting())
    for i in range(3):
        x = torch.randn(3, 4)
        with torch.no_grad():
            want, got = ref(x), g(x)
        assert torch.equal(want, got) and torch.equal(ref.a, g.a) and torch.equal(ref.b, g.b)
        assert (g.a._version, g.b._version) == (ref.a._version, ref.b._version), i
    _clean()


# -- F3: a swap that cannot be swapped back ---------------------------------------------------

class Two(nn.Module):
    """Swaps two globals with fresh tensors on every call (the second records the run)."""

    runs = 0

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        _G[id(self)] = (torch.zeros(4), torch.zeros(4))

    def forward(self, x):
        h = self.lin(x)
        a, b = _G[id(self)]
        Two.runs += 1
        torch.utils.swap_tensors(a, (h[0] * 2).detach().clone())
        torch.utils.swap_tensors(b, torch.full((4,), float(Two.runs)))
        return h * 3


def _failing_once(monkeypatch, target):
    """``_writes._unswap`` raises once for the pair whose first tensor is ``target()``."""
    orig, failed = _writes._unswap, []

    def flaky(t1, t2):
        if t1 is target() and not failed:
            failed.append(1)
            raise RuntimeError("cannot swap back")
        return orig(t1, t2)
    monkeypatch.setattr(_writes, "_unswap", flaky)
    return failed


# finding F3 (loud): where swapping back fails at capture()'s put-backs (no extra warm-up: the
# capture's run swapped), the CudagraphifyError of _swap_back leaves capture()'s ExitStack and
# FirstCall.run: the user's call raises although its real call ran (its effects are applied, its
# result lost; calling again applies them twice). A failure during the extra warm-ups is caught
# ("capture failed", warned: see the control below). No real trigger was found (the C swap checks
# nothing; the Python steps mirror swap_tensors'), hence a monkeypatched _unswap.
@pytest.mark.xfail(strict=True, reason="finding F3: a failed swap back after the capture raises "
                   "from the user's call, the real call's result lost")
def test_F3_a_failed_swap_back_after_the_capture_raises_from_the_call(sim, monkeypatch):
    Two.runs = 0
    g = cg.graphify(Two())
    failed = _failing_once(monkeypatch, lambda: _G[id(g)][1])
    x = torch.randn(3, 4)
    with torch.no_grad():
        out = g(x)  # raises CudagraphifyError on the reviewed code
    assert failed
    assert torch.equal(out, g.lin(x) * 3)


def test_control_a_failed_swap_back_in_the_extra_warmups_is_warned_and_cleaned_up(
        sim, monkeypatch):
    Two.runs = 0
    g = cg.graphify(Two(), num_warmup_iters=2)
    a, b = _G[id(g)]
    failed = _failing_once(monkeypatch, lambda: b)
    x = torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with torch.no_grad():
            out = g(x)
    assert failed and torch.equal(out, g.lin(x) * 3)
    _clean()
    assert torch.allclose(a, g.lin(x)[0] * 2)  # (the other pair is swapped back all the same)
    # b keeps the extra run's tensor (2; the real call's is 1): said in a warning, not silent
    assert b[0].item() == 2.0
    assert any("could not be swapped back" in str(x.message) for x in w)


# -- F4: bucketed's padded check runs kept their swaps ------------------------------------------

class SwapsBatch(nn.Module):
    """Rows independent; each call swaps its global for a tensor holding its batch size."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        _G[id(self)] = torch.zeros(1)

    def forward(self, x):
        torch.utils.swap_tensors(_G[id(self)], torch.full((1,), float(x.shape[0])))
        return self.lin(x)


# finding F4 (silent wrong Python state; fixed): a bucket's first call checks the size with two
# padded runs of the target (_bucket._check), beyond the user's call. Their attribute and
# container changes refused the bucket and were put back; their swaps were neither seen nor
# swapped back: after b(x) with 3 rows the global held 4.0 (the padded run's), eager 3.0. Now the
# runs are under a blocking watch: swapped back, and the bucket refused (every call swaps).
def test_F4_bucketed_padded_runs_leave_their_swaps(sim):
    torch.manual_seed(0)
    ref = SwapsBatch()
    g = cg.graphify(SwapsBatch())
    g.load_state_dict(ref.state_dict())
    b = cg.bucketed(g, [4])
    with torch.no_grad():
        for i in range(2):
            x = torch.randn(3, 4)
            out, want = b(x), ref(x)
            assert torch.allclose(out, want)
            assert _G[id(g)].item() == _G[id(ref)].item(), (i, _G[id(g)].item())


# -- controls -----------------------------------------------------------------------------------

class BufferPingPong(nn.Module):
    """Double buffering through registered buffers (no capture-aware branch): swap, count up,
    read."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("front", torch.zeros(4))
        self.register_buffer("back", torch.ones(4))

    def forward(self, x):
        torch.utils.swap_tensors(self.front, self.back)
        self.front.add_(1)
        return self.lin(x) * self.front


@pytest.mark.parametrize("probe", ["auto", False])
@pytest.mark.parametrize("iters", [1, 3])
@pytest.mark.parametrize("grad", [False, True])
def test_control_buffer_ping_pong_records_repaired_by_the_outer_put_backs(sim, probe, iters,
                                                                          grad):
    # (the extra warm-ups' and the capture's records of front/back are taken on swapped objects
    # too, but capture()'s layouts_kept over the statics, entered before any run, puts layouts
    # and versions back last)
    ref, g = _twins(BufferPingPong, probe=probe, num_warmup_iters=iters)
    for i in range(3):
        x = torch.randn(3, 4)
        with torch.set_grad_enabled(grad):
            want, got = ref(x), g(x)
            if grad:
                want.sum().backward()
                got.sum().backward()
        assert torch.equal(want, got), i
        for n in ("front", "back"):
            r, t = getattr(ref, n), getattr(g, n)
            assert torch.equal(r, t) and r._version == t._version, (i, n)
        assert g.front.data_ptr() != g.back.data_ptr()
    _clean()


class RenewsThroughAList(nn.Module):
    """Renews its weight (a fresh leaf swapped in) through a plain list that holds it (not the
    stand-in the training runs put in ``_parameters``), then uses it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.ref = [self.w]

    def forward(self, x):
        p = self.ref[0]
        torch.utils.swap_tensors(p, nn.Parameter(p.detach().clone()))
        return x @ p


@pytest.mark.parametrize("probe", ["auto", False])
def test_control_a_later_run_cannot_poison_the_real_calls_accumulate_grad(sim, probe):
    # (swap_tensors on a leaf whose AccumulateGrad the real call's graph holds would register a
    # poisoning pre-hook: the extra warm-up's swap raises first (_hooks._swap_checked; before,
    # only a reference the probe happened to hold made torch raise), the capture fails, and the
    # user's backward runs as eager's)
    ref, g = _twins(RenewsThroughAList, probe=probe)
    for i in range(3):
        x = torch.randn(3, 4)
        want, got = ref(x), g(x)
        want.sum().backward()
        got.sum().backward()
        assert torch.equal(want, got) and torch.equal(ref.w.grad, g.w.grad), i
    _clean()


def test_control_two_threads_first_calls_swap_into_their_own_logs(sim):
    class Paired(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            _G[id(self)] = torch.zeros(4)

        def forward(self, x):
            h = self.lin(x)
            torch.utils.swap_tensors(_G[id(self)], (h[0] * 2).detach().clone())
            try:
                barrier.wait(5)  # (both threads inside a run at once, each in a watch)
            except threading.BrokenBarrierError:
                pass
            return h * 3

    barrier = threading.Barrier(2)
    torch.manual_seed(0)
    ms = [cg.graphify(Paired()) for _ in range(2)]
    xs = [torch.randn(3, 4) for _ in range(2)]
    err = []

    def call(k):
        try:
            with torch.no_grad():
                ms[k](xs[k])
        except BaseException as e:  # noqa: BLE001
            err.append(e)

    ths = [threading.Thread(target=call, args=(k,)) for k in range(2)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(30)
    assert not err, err
    for m, x in zip(ms, xs):
        assert torch.allclose(_G[id(m)], m.lin(x)[0] * 2)
    _clean()
