"""The statics guard: parameters and buffers moved, replaced or removed are seen; updates in place are not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cudagraphify._statics import StaticState


def make():
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    return m, StaticState(m)


def test_unchanged_and_in_place_updates_keep_the_guard():
    m, s = make()
    assert s.changed() is None
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1)
    m[1].running_mean.mul_(2)
    assert s.changed() is None


def test_static_detection_finds_every_parameter_and_buffer_once():
    m, s = make()
    tied = nn.Sequential(m, nn.Linear(4, 4))
    tied[1].weight = m[0].weight  # tied: counted once
    st = StaticState(tied)
    names = {id(t) for t in st.tensors}
    assert len(names) == len(st.tensors) == 2 + 5 + 1  # lin + bn(w, b, mean, var, count) + bias
    assert st.grad_params()


def test_to_dtype_is_detected():
    m, s = make()
    m.to(torch.float64)
    assert "moved" in s.changed()
    assert s.changed() is None  # re-scanned


def test_p_data_assignment_is_detected():
    m, s = make()
    m[0].weight.data = torch.randn(4, 4)
    assert "'weight'" in s.changed()


@pytest.mark.parametrize("n", [1, 2, 8, 9, 12])
def test_every_address_is_checked_few_statics_or_many(n):
    # up to _FEW statics are checked one by one, more in one call: the last one's move is seen
    # either way, by ``same`` (the fast path's check) as by ``changed``
    from cudagraphify import _statics

    m = nn.Module()
    for k in range(n):
        m.register_parameter(f"p{k}", nn.Parameter(torch.randn(3)))
    s = StaticState(m)
    assert (s._pairs is not None) == (n <= _statics._FEW)
    assert s.same() and s.changed() is None
    getattr(m, f"p{n - 1}").data = torch.randn(3)
    assert not s.same()
    assert f"'p{n - 1}'" in s.changed()
    assert s.same()  # rescanned


def test_load_state_dict_assign_is_detected():
    m, s = make()
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    m.load_state_dict(sd, assign=True)
    assert s.changed() is not None


def test_load_state_dict_copy_is_in_place():
    m, s = make()
    m.load_state_dict({k: torch.zeros_like(v) for k, v in m.state_dict().items()})
    assert s.changed() is None


def test_replaced_buffer_and_submodule_are_detected():
    m, s = make()
    m[1].running_mean = torch.zeros(4)
    assert s.changed() is not None
    m[0] = nn.Linear(4, 4)
    assert "replaced" in s.changed()


def test_buffer_set_to_none_is_detected():
    m, s = make()
    m[1].running_var = None
    assert s.changed() is not None


def test_freed_old_memory_cannot_alias_a_new_tensor():
    # The guard holds the scanned storages: a tensor assigned later never reuses their address.
    m, s = make()
    old_ptr = m[0].weight.data_ptr()
    m[0].weight.data = torch.empty(4, 4)
    for _ in range(50):
        assert torch.empty(4, 4).data_ptr() != old_ptr


def test_function_state_has_no_statics():
    s = StaticState(None)
    assert s.tensors == [] and s.changed() is None and s.devices() == set()


def test_replacing_a_submodule_without_parameters_is_detected():
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    s = StaticState(m)
    m[1] = nn.Tanh()
    assert s.changed() == "a submodule was replaced"
    assert s.changed() is None


def test_watched_dicts_pickle_and_copy_as_plain_dicts():
    import copy
    import pickle

    m, s = make()
    assert type(m._buffers).__name__ == "_WatchedDict"
    assert type(pickle.loads(pickle.dumps(m._buffers))) is dict
    m2 = copy.deepcopy(m)
    torch.testing.assert_close(m2(torch.ones(2, 4)), m(torch.ones(2, 4)))
    m._buffers["running_mean"] = torch.zeros(4)  # a direct write, as Module._apply does
    assert s.changed() is not None
