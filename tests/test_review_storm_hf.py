"""tests/test_review_storm.py's cases with HF transformers models and caches (skipped where
transformers is not installed: kept apart so that the others run without it)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import cudagraphify as cg  # noqa: E402
from cudagraphify import _state  # noqa: E402
import test_review_hfcache as H  # noqa: E402
from test_review_hfcache import device_counter  # noqa: E402,F401 (a fixture)
from test_review_storm import _limit_of_eight, _storm_calls  # noqa: E402,F401 (a fixture)


# -- HF transformers (real models and caches) -----------------------------------------------------



def test_control_hf_generate_static_growing_prompts(sim, device_counter):
    ref, g, _ = H._pair()
    with torch.no_grad():
        for length in range(3, 14):
            ids = torch.randint(1, 64, (1, length))
            want = ref.generate(ids, cache_implementation="static", disable_compile=True,
                                **H._GEN)
            got = g.generate(ids, cache_implementation="static", **H._GEN)
            assert H._same_generate(got, want), length
    assert _storm_calls(g) == 0 and cg.stats(g).replays >= 20, H._stats(g)


def test_control_set_ups_under_the_storm_run_eagerly_on_the_set_up_cache(sim, device_counter):
    """Two steps per sequence, a new lazily allocated HF StaticCache each (kept alive: new
    addresses): the prefill's set-up (a SetUpEntry applied, then ``_call(set_up=True)``) and
    the decode step (captured: never replayed) bring the storm; then a set-up call's
    recursion runs eagerly on the cache it set up (here the prefill is piecewise, not a
    capture), bitwise as eager (logits and caches)."""
    ref, g, config = H._pair()
    kept = []
    with torch.no_grad():
        for k in range(12):
            rc, c = H._static(config), H._static(config)
            kept.append((rc, c))
            H._decode(ref, g, rc, c, torch.randint(1, 64, (1, 4)), steps=2, what=f"seq {k}")
    s = cg.stats(g)
    assert _storm_calls(g) > 0 and s.set_ups >= 5, H._stats(g)


# -- state_key: 4096 values, the C address check ---------------------------------------------------

def _py_ptrs_equal(tensors, ptrs, indices):
    """torch._C._tensors_data_ptrs_at_indices_equal as CUDA builds define it
    (torch/csrc/cuda/Module.cpp): ``tensors[i].data_ptr() == ptrs[i]`` for i in indices."""
    assert type(tensors) is list and type(ptrs) is list and type(indices) is list  # py::list&
    return all(tensors[i].data_ptr() == int(ptrs[i]) for i in indices)


@pytest.mark.parametrize("c_check", [False, True], ids=["cpu-build", "cuda-build-semantics"])
def test_control_state_key_of_an_80_layer_static_cache_and_moves(monkeypatch, c_check):
    if c_check:
        monkeypatch.setattr(_state, "ptrs_equal", _py_ptrs_equal)
    config = H._config(num_hidden_layers=80)
    cache = H._early(H._static(config), config)
    _state._memo.clear()
    k1 = _state.state_key(cache)
    assert _state.state_key(cache) is k1  # memo hit
    layer = cache.layers[57]
    layer.values.set_(torch.zeros_like(layer.values).untyped_storage())  # same object, moved
    k2 = _state.state_key(cache)
    assert k2 != k1
    layer.keys.resize_(layer.keys.shape)  # nothing moved
    assert _state.state_key(cache) is k2
