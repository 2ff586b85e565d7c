"""Global flags: the replay path reads them again only after a setter of one of them ran, so
every public way to set one must move ``_guards.flags_epoch``."""

from __future__ import annotations

import contextlib
import types
import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _guards

_cuda = torch.backends.cuda
_cudnn = torch.backends.cudnn


def _prop(obj, name: str, value):
    @contextlib.contextmanager
    def change():
        old = getattr(obj, name)
        setattr(obj, name, value(old))
        try:
            yield
        finally:
            setattr(obj, name, old)
    return change


def _call(get, set_, value):
    @contextlib.contextmanager
    def change():
        old = get()
        set_(value(old))
        try:
            yield
        finally:
            set_(old)
    return change


def _priority():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.MATH, SDPBackend.FLASH_ATTENTION], set_priority=True)


# every public way to change one of the flags the guard reads (torch.backends and its context
# managers, torch.nn.attention): (name, context manager factory)
_CHANGES = {
    "cudnn.enabled": _prop(_cudnn, "enabled", lambda v: not v),
    "cudnn.benchmark": _prop(_cudnn, "benchmark", lambda v: not v),
    "cudnn.deterministic": _prop(_cudnn, "deterministic", lambda v: not v),
    "cudnn.allow_tf32": _prop(_cudnn, "allow_tf32", lambda v: not v),
    "cudnn.flags()": lambda: _cudnn.flags(enabled=not _cudnn.enabled),
    "cudnn.conv.fp32_precision": lambda: _prop(
        _cudnn.conv, "fp32_precision", lambda v: "ieee" if v != "ieee" else "tf32")(),
    "cudnn.rnn.fp32_precision": lambda: _prop(
        _cudnn.rnn, "fp32_precision", lambda v: "ieee" if v != "ieee" else "tf32")(),
    "enable_flash_sdp": _call(_cuda.flash_sdp_enabled, _cuda.enable_flash_sdp, lambda v: not v),
    "enable_mem_efficient_sdp": _call(_cuda.mem_efficient_sdp_enabled,
                                      _cuda.enable_mem_efficient_sdp, lambda v: not v),
    "enable_math_sdp": _call(_cuda.math_sdp_enabled, _cuda.enable_math_sdp, lambda v: not v),
    "enable_cudnn_sdp": _call(_cuda.cudnn_sdp_enabled, _cuda.enable_cudnn_sdp, lambda v: not v),
    "allow_fp16_bf16_reduction_math_sdp": _call(
        _cuda.fp16_bf16_reduction_math_sdp_allowed, _cuda.allow_fp16_bf16_reduction_math_sdp,
        lambda v: not v),
    "sdpa_kernel(set_priority=True)": _priority,
    "matmul.allow_fp16_accumulation": _prop(_cuda.matmul, "allow_fp16_accumulation",
                                            lambda v: not v),
    "preferred_blas_library": _call(_cuda.preferred_blas_library, _cuda.preferred_blas_library,
                                    lambda v: "cublaslt" if "Lt" not in str(v) else "cublas"),
    "preferred_linalg_library": _call(
        _cuda.preferred_linalg_library, _cuda.preferred_linalg_library,
        lambda v: "magma" if "Magma" not in str(v) else "cusolver"),
}


@pytest.mark.parametrize("name", list(_CHANGES))
def test_every_public_setter_moves_the_flags_epoch(name):
    _guards.watch_flag_setters()
    before_flags, before_epoch = _guards._read_flags(), _guards.flags_epoch
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ctx = _CHANGES[name]()
            ctx.__enter__()
    except (RuntimeError, AttributeError, ValueError) as e:  # not on this build
        pytest.skip(f"{name} cannot be set here: {e}")
    try:
        changed = _guards._read_flags()
        moved = _guards.flags_epoch
    finally:
        ctx.__exit__(None, None, None)
    if changed == before_flags:
        pytest.skip(f"{name} does not change what this build reads")
    assert moved != before_epoch, f"{name} changed the flags without moving the epoch"
    assert _guards._read_flags() == before_flags  # restored


def test_the_setters_are_wrapped_where_torch_holds_them():
    _guards.watch_flag_setters()
    for name in _guards._SETTERS:
        setter = getattr(torch._C, name, None)
        assert setter is None or hasattr(setter, "__wrapped__"), name
    props = [p for p in vars(type(_cudnn)).values()
             if isinstance(p, torch.backends.ContextProp)]
    assert props
    for prop in props:
        if getattr(prop.setter, "__name__", "") in _guards._SETTERS:
            assert hasattr(prop.setter, "__wrapped__"), prop.setter


class _Lin(nn.Linear):
    pass


@pytest.mark.filterwarnings("ignore::cudagraphify.CudagraphifyWarning")
def _replaying_linear():
    """A graphified ``Linear(4, 4)`` after three calls (warm-up, capture, replay), each equal
    to eager's: (eager module, graphified module, input)."""
    torch.manual_seed(0)
    ref = nn.Linear(4, 4)
    g = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(g(x), ref(x))
    return ref, g, x


def test_a_flag_changed_between_replays_is_seen_by_the_next_call(sim):
    ref, g, x = _replaying_linear()
    with torch.no_grad():
        assert cg.stats(g).captures == 1
        replays = cg.stats(g).replays
        with _CHANGES["cudnn.benchmark"]():
            assert torch.equal(g(x), ref(x))
            assert cg.stats(g).captures == 2  # not the first graph: a capture of its own
        assert torch.equal(g(x), ref(x))
        assert cg.stats(g).captures == 2 and cg.stats(g).replays == replays + 1


@pytest.mark.filterwarnings("ignore::cudagraphify.CudagraphifyWarning")
def test_graphed_calls_work_with_different_conv_and_rnn_precisions(sim):
    # (reading the legacy cudnn.allow_tf32 raises then: the guard must not read it)
    torch.manual_seed(0)
    ref = nn.Linear(4, 4)
    g = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(2, 4)
    with _CHANGES["cudnn.conv.fp32_precision"](), torch.no_grad():
        for _ in range(3):
            assert torch.equal(g(x), ref(x))
    assert cg.stats(g).replays >= 1


@pytest.mark.filterwarnings("ignore::cudagraphify.CudagraphifyWarning")
@pytest.mark.parametrize("gpus", [1, 2])
def test_the_replay_path_reads_the_current_device_where_several_gpus_make_it_changeable(
        sim, monkeypatch, gpus):
    # (a CUDA that is up, faked: the flags and the replay path read the device through it)
    current = [0]
    monkeypatch.setattr(_guards, "_device", lambda: current[0])
    monkeypatch.setattr(_guards, "_cuda", types.SimpleNamespace(_initialized=True,
                                                                device_count=lambda: gpus))
    assert (_guards.device_reader() is None) == (gpus == 1)
    ref, g, x = _replaying_linear()
    with torch.no_grad():
        assert g._cudagraphify_state._fast is not None and cg.stats(g).captures == 1
        if gpus == 1:
            return  # (no other device can become current)
        current[0] = 1  # torch.cuda.set_device(1): the graph of device 0 must not replay
        assert torch.equal(g(x), ref(x))
        assert cg.stats(g).captures == 2
