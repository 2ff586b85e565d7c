"""Review of 9b4a4e5 (``_watch._noting``: ``nn.Module.register_buffer``/``register_parameter``
called by a forward under a recorder note the write, as the patched ``__setattr__`` does,
unless the direct caller is torch's own ``nn.Module.__setattr__``). CPU, simulated backend.

Findings (were strict xfails; fixed in the commit after the review: a recorder notes the
module whose patched ``__setattr__`` runs, ``Recorder.setting``, and the wrapper skips it; the
wrapper takes ``(self, *args, **kwargs)``; it tests watched as ``__setattr__`` does):

- R1 (silent, regression): a subclass that overrides ``register_buffer``/``register_parameter``
  and calls ``super()`` gets every ``self.b = ...`` noted TWICE (patched ``__setattr__``, then
  the wrapper, whose caller is the override, not torch's ``__setattr__``). A swap-and-restore
  forward (``orig = self.b; self.b = orig * 2; ...; self.b = orig``): the restore's first note
  cancels the entry, the second (made before the write, registry still ``orig * 2``) appends a
  bogus ``orig*2 -> orig`` write; refused, and ``Recorder.undo`` puts ``orig * 2`` back: the
  buffer/parameter doubles on every call. Parent: 1 capture, 5 replays, all equal to eager.
- R2 (loud, regression, process-wide): the wrapper's signature ``(self, name, value, ...)``
  rejects the keyword forms ``register_buffer(name=..., tensor=...)``,
  ``register_parameter("p", param=...)`` once ``install()`` ran (any graphify call), anywhere
  in the process, torch's own ``torch.ao.pruning`` data sparsifier included.
- R3 (silent, fix incomplete): a module whose ``_parameters`` is kept elsewhere (KEPT_MARK,
  a plain dict: ``self.ps = self._parameters``) is watched, and its ``__setattr__`` writes are
  noted, but the wrapper checks ``type(_parameters) is _WatchedDict`` only: S2 (the module
  left holding the capture's static copy) stays for it.
"""
from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _statics, _watch

from test_review_lk3 import X, _calls, _st, _twins

pytestmark = pytest.mark.usefixtures("quiet")



def _state_same(g, r, a, b):
    sg, sr = g.state_dict(keep_vars=True), r.state_dict(keep_vars=True)
    return sg.keys() == sr.keys() and all(torch.equal(sg[k], sr[k]) for k in sg)


def _install(sim):
    g = cg.graphify(nn.Linear(2, 2))
    with torch.no_grad():
        g(torch.randn(1, 2))
    assert _watch._installed


# ============================== R1 overriding subclass: double note, undo corrupts ==========

class _SwapBuf(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))
        self.register_buffer("b", torch.randn(8))

    def forward(self, x):
        orig = self.b
        self.b = orig * 2
        y = x * self.w + self.b
        self.b = orig
        return y


class _SubSwapBuf(_SwapBuf):
    def register_buffer(self, name, tensor, persistent=True):
        return super().register_buffer(name, tensor, persistent)


class _SwapParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))

    def forward(self, x):
        orig = self.w
        self.w = nn.Parameter(orig.detach() * 2, requires_grad=False)
        y = x * self.w
        self.w = orig
        return y


class _SubSwapParam(_SwapParam):
    def register_parameter(self, name, param):
        return super().register_parameter(name, param)


@pytest.mark.parametrize("cls", [_SubSwapBuf, _SubSwapParam], ids=["buffer", "parameter"])
def test_r1_override_calling_super_swap_restore_corrupts_state(sim, cls):
    g, ref = _twins(cls)
    with torch.no_grad():
        res = _calls(g, ref, X, check=_state_same)
    # (9b4a4e5: all False, the buffer/parameter x2 per call; parent: captures=1 replays=5)
    assert all(res), f"silent: swapped value put back by undo: {res} {_st(g)}"


@pytest.mark.parametrize("cls", [_SwapBuf, _SwapParam], ids=["buffer", "parameter"])
def test_r1_control_no_override_swap_restore_graphs(sim, cls):
    g, ref = _twins(cls)
    with torch.no_grad():
        res = _calls(g, ref, X, check=_state_same)
    assert all(res), (res, _st(g))
    assert cg.stats(g).replays >= 4, _st(g)


class _SubRunStat(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))
        self.register_buffer("rm", torch.zeros(8))

    def register_buffer(self, name, tensor, persistent=True):
        return super().register_buffer(name, tensor, persistent)

    def forward(self, x):
        self.rm = 0.9 * self.rm + 0.1 * x.mean(0)
        return x * self.w - self.rm


def test_r1_control_override_running_stat_matches_eager(sim):
    g, ref = _twins(_SubRunStat)
    with torch.no_grad():
        res = _calls(g, ref, X, check=_state_same)
    assert all(res), (res, _st(g))


# ============================== R2 keyword forms rejected ==================================

@pytest.mark.parametrize("call", [
    lambda m: m.register_buffer("a", tensor=torch.ones(1)),
    lambda m: m.register_buffer(name="a", tensor=torch.ones(1), persistent=False),
    lambda m: m.register_parameter("p", param=nn.Parameter(torch.ones(1))),
    lambda m: m.register_parameter(name="p", param=None),
], ids=["buffer_tensor_kw", "buffer_all_kw", "param_kw", "param_all_kw"])
def test_r2_keyword_register_forms_after_install(sim, call):
    _install(sim)
    call(nn.Module())


def test_r2_torch_data_sparsifier_after_install(sim):
    from torch.ao.pruning._experimental.data_sparsifier import DataNormSparsifier
    _install(sim)
    DataNormSparsifier().add_data("x", torch.randn(4, 4))


def test_r2_control_positional_and_persistent_kw(sim):
    _install(sim)
    m = nn.Module()
    m.register_buffer("a", torch.ones(1), persistent=False)
    m.register_buffer("n", None)
    m.register_parameter("p", nn.Parameter(torch.ones(1)))
    assert "a" not in m.state_dict() and m.n is None and isinstance(m.p, nn.Parameter)


# ============================== R3 kept registries (KEPT_MARK) =============================

class _KeptBuf(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))
        self.register_buffer("seen", torch.zeros(4, 8), persistent=False)
        self.ps = self._parameters  # (kept under a second name: KEPT_MARK, not watched in place)

    def forward(self, x):
        self.register_buffer("seen", x, persistent=False)
        return x * self.w


class _KeptParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))
        self.seen = nn.Parameter(torch.zeros(4, 8), requires_grad=False)
        self.ps = self._parameters

    def forward(self, x):
        self.register_parameter("seen", nn.Parameter(x, requires_grad=False))
        return x * self.w


def _holds_arg(g, r, a, b):
    return g.seen.data_ptr() == a[0].data_ptr()


@pytest.mark.parametrize("cls", [_KeptBuf, _KeptParam], ids=["buffer", "parameter"])
def test_r3_kept_registries_register_keeps_static_copy(sim, cls):
    g, ref = _twins(cls)
    with torch.no_grad():
        res = _calls(g, ref, X, check=_holds_arg)
    assert _watch.KEPT_MARK in g.__dict__ or _statics.KEPT_MARK in g.__dict__
    assert all(res), f"silent: module holds the capture's static copy: {res} {_st(g)}"


class _Watched(_KeptBuf):
    def __init__(self):
        super().__init__()
        del self.ps


def test_r3_control_watched_register_noted(sim):
    g, ref = _twins(_Watched)
    with torch.no_grad():
        res = _calls(g, ref, X, check=_holds_arg)
    assert all(res), (res, _st(g))


# ============================== controls: other registration paths =========================

class _Body(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8))
        self.register_buffer("b", torch.ones(8))
        self.body = body

    def forward(self, x):
        return self.body(self, x)


def _none_buf(m, x):
    m.register_buffer("b", None)
    return x * m.w


def _nn_buffer(m, x):
    m.b = nn.Buffer(x[0] * 2, persistent=False)
    return x * m.w + m.b


def _same_buf(m, x):
    m.register_buffer("b", m.b)
    return x * m.w + m.b


def _swap_restore_register(m, x):
    orig = m.b
    m.register_buffer("b", orig * 3)
    y = x * m.w + m.b
    m.register_buffer("b", orig)
    return y


@pytest.mark.parametrize("body", [_none_buf, _nn_buffer, _same_buf, _swap_restore_register],
                         ids=["none", "nn_Buffer", "same_value", "swap_restore"])
def test_control_register_forms_in_forward_match_eager(sim, body):
    g, ref = _twins(_Body, body)
    with torch.no_grad():
        res = _calls(g, ref, X, check=_state_same)
    assert all(res), (res, _st(g))
    if body in (_same_buf, _swap_restore_register):
        assert cg.stats(g).replays >= 4, _st(g)


@pytest.mark.parametrize("make", [
    lambda: nn.Sequential(nn.LazyLinear(8), nn.ReLU()),
    lambda: nn.utils.spectral_norm(nn.Linear(8, 8)),
    lambda: nn.utils.weight_norm(nn.Linear(8, 8)),
    lambda: nn.utils.parametrizations.orthogonal(nn.Linear(8, 8)),
], ids=["lazy", "spectral_norm", "weight_norm", "parametrize"])
def test_control_torch_internals_match_eager(sim, make):
    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)
    g = cg.graphify(make())
    with torch.no_grad():
        res = _calls(g, ref, X, check=_state_same)
    assert all(res), (res, _st(g))


def test_control_copy_pickle_after_install(sim):
    _install(sim)
    m = _SubRunStat()
    m2 = copy.deepcopy(m)
    m3 = pickle.loads(pickle.dumps(m))
    assert torch.equal(m2.rm, m.rm) and torch.equal(m3.w, m.w)
    assert pickle.loads(pickle.dumps(nn.Module.register_buffer)) is nn.Module.register_buffer


def test_control_other_threads_recorder_not_consulted(sim):
    _install(sim)
    m = _Watched()
    assert _statics.watch(m) is None and _statics.watched(m)
    rec, entered, done = _watch.Recorder(), threading.Event(), threading.Event()

    def other():
        with _watch.recording(rec, ran=False):
            entered.set()
            done.wait(5)

    t = threading.Thread(target=other)
    t.start()
    try:
        assert entered.wait(5)
        m.register_buffer("seen", torch.ones(4, 8))
    finally:
        done.set()
        t.join()
    assert rec.writes == [] and torch.equal(m.seen, torch.ones(4, 8))


def test_control_torch_compile_register_in_forward(sim):
    _install(sim)
    m = _Body(lambda m, x: (m.register_buffer("b", x[0] * 2), x + m.b)[1])
    out = torch.compile(m, backend="eager")(torch.ones(2, 8))
    assert torch.equal(out, torch.full((2, 8), 3.0)) and torch.equal(m.b, torch.full((8,), 2.0))
