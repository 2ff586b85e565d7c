"""Which reads of a tensor's memory and autograd bookkeeping the probe refuses
(``_probe.Probe.read_metadata``): those made by code outside torch on a copied argument's
memory (the copy keeps none of it: its own storage, offset 0, aligned, no base, no node, a
version counter of its own), and a version read on a parameter or buffer (an in-place write
keeps the graph). Not refused: the same reads on parameters (guarded by address), on tensors
the forward made, and those torch's own code makes (an RNN's ``data_ptr`` of its weights, a
full backward hook's ``grad_fn``). CPU, simulated backend; each graphified model runs beside an
eager twin, compared bitwise.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg

pytestmark = pytest.mark.usefixtures("quiet")


class Reads(nn.Module):
    """``inner`` graphs; the root's ``read(self, x)`` decides a branch."""

    def __init__(self, read):
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.register_buffer("b", torch.zeros(8))
        self.read = read

    def forward(self, x, *rest, **kw):
        h = self.inner(x)
        if self.read(self, x, *rest, **kw):
            return h * 2 + self.b
        return h + 1


def _twins(read):
    torch.manual_seed(0)
    base = Reads(read)  # (both copies: a deepcopy moves its tensors' versions)
    return cg.graphify(copy.deepcopy(base)), copy.deepcopy(base)


def _calls(g, ref, make, n=4):
    with torch.no_grad():
        for i in range(n):
            torch.manual_seed(i)
            args, kw = make()
            assert torch.equal(g(*args, **kw), ref(*args, **kw)), (i, cg.stats(g))


def _reasons(g) -> str:
    return " | ".join(cg.stats(g).eager_calls)


def _x():
    return (torch.randn(4, 8),), {}


def _with_meta():
    x = torch.randn(4, 8)
    x.meta = 1  # (not read)
    return (x,), {}


REFUSED = {
    # a view of the argument: the same memory, so the same reads go stale
    "view_offset": (lambda m, x: x[:, 1:].storage_offset() > 0, _x, "Tensor.storage_offset"),
    "storage": (lambda m, x: x.storage().size() > 32, _x, "Tensor.storage"),
    "typed_storage": (lambda m, x: x._typed_storage().size() > 32, _x,
                      "Tensor.untyped_storage"),
    "keyword": (lambda m, x, y=None: y.data_ptr() % 16 == 0,
                lambda: ((torch.randn(4, 8),), {"y": torch.randn(8)}), "Tensor.data_ptr"),
    "in_a_list": (lambda m, x, ys: ys[1]._version > 0,
                  lambda: ((torch.randn(4, 8), [torch.randn(2), torch.randn(2)]), {}),
                  "Tensor._version"),
    "buffer_version": (lambda m, x: m.b._version > 0, _x, "Tensor._version"),
    # an argument carrying a Python attribute: its other reads go through the patched
    # Tensor.__getattribute__, and are still the user's
    "attributed_version": (lambda m, x: x._version > 0, lambda: _with_meta(), "Tensor._version"),
    "attributed_grad_fn": (lambda m, x: x.grad_fn is None, lambda: _with_meta(),
                           "Tensor.grad_fn"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_read_a_copy_or_a_guard_does_not_keep_is_refused(sim, case):
    read, make, op = REFUSED[case]
    g, ref = _twins(read)
    _calls(g, ref, make)
    assert f"{op} [PYTHON_STATE]" in _reasons(g), _reasons(g)
    assert cg.stats(g).replays >= 1, cg.stats(g)  # (the Linear piece still replays)


KEPT = {
    # a parameter's memory is guarded by address: its reads are the same on every call
    "param_data_ptr": lambda m, x: m.inner.weight.data_ptr() % 16 == 0,
    "param_offset": lambda m, x: m.inner.weight.storage_offset() == 0,
    "param_is_view": lambda m, x: m.inner.weight._is_view(),
    # a tensor the forward made: its read is made again at capture, on its own memory
    "made_data_ptr": lambda m, x: (x * 2).data_ptr() % 16 == 0,
    "made_version": lambda m, x: (x * 2)._version == 0,
    # metadata the key holds
    "shape": lambda m, x: x.shape[0] > 2,
    "stride": lambda m, x: x.stride(0) == 8,
}


@pytest.mark.parametrize("case", list(KEPT))
def test_reads_a_replay_keeps_stay_graphed(sim, case):
    g, ref = _twins(KEPT[case])
    _calls(g, ref, _x)
    s = cg.stats(g)
    assert s.eager_calls == {} and s.replays == 3 and s.captures == 1, s


def test_an_rnns_own_reads_of_its_weights_stay_graphed(sim):
    # (RNNBase.flatten_parameters reads its weights' data_ptr on every forward: torch's code)
    torch.manual_seed(0)
    ref = nn.GRU(8, 8, batch_first=True)
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(3):
            x = torch.randn(2, 5, 8)
            a, b = g(x), ref(x)
            assert all(torch.equal(p, q) for p, q in zip(a, b))
    s = cg.stats(g)
    assert s.eager_calls == {} and s.replays == 2, s


def test_a_full_backward_hooks_grad_fn_reads_are_torchs_own(sim):
    torch.manual_seed(0)
    seen = []
    ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    g = cg.graphify(copy.deepcopy(ref))
    for m in (ref, g):
        m.register_full_backward_hook(lambda mod, gi, go: seen.append(1))
    for i in range(3):
        x = torch.randn(4, 8, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        a, b = g(x), ref(x2)
        a.sum().backward()
        b.sum().backward()
        assert torch.equal(a.detach(), b.detach()) and torch.equal(x.grad, x2.grad)
    assert not any("PYTHON_STATE" in k for k in cg.stats(g).eager_calls), _reasons(g)


def test_explain_refuses_such_a_read_as_the_first_call_does():
    torch.manual_seed(0)
    model = Reads(lambda m, x: x.storage_offset() > 0)
    data = cg.explain(model, torch.randn(4, 8)).to_dict()
    statuses = {m["path"]: m["status"] for m in data["modules"]}
    assert statuses[""] == "eager" and statuses["inner"] == "graphed", statuses
    (reason,) = data["modules"][0]["reasons"]
    assert reason["op"] == "Tensor.storage_offset" and reason["tags"] == ["PYTHON_STATE"]
    assert reason["file"] == "tests/test_probe_metadata.py", reason


class Scaled(nn.Module):
    """The attribute picks a scalar, not an op: the op sequence is the same either way."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x):
        return self.inner(x) * (2.0 if getattr(x, "tag", None) == "a" else 3.0)


@pytest.mark.parametrize("tagged_first", [False, True])
def test_a_python_attribute_of_an_argument_either_way(sim, tagged_first):
    torch.manual_seed(0)
    base = Scaled()
    g, ref = cg.graphify(copy.deepcopy(base)), copy.deepcopy(base)
    with torch.no_grad():
        for i in range(6):
            x = torch.randn(4, 8)
            if (i < 3) == tagged_first:
                x.tag = "a"
            assert torch.equal(g(x), ref(x)), (i, cg.stats(g))
    # (the read is seen either way: of a missing attribute by the patched Tensor.__getattr__,
    # of one that is there by Tensor.__getattribute__, patched while such an argument's probe
    # runs): the root runs piecewise, inner's piece replays
    assert "Tensor.tag [PYTHON_STATE]" in _reasons(g) and cg.stats(g).replays >= 1, _reasons(g)
    assert "__getattribute__" not in vars(torch.Tensor)
    assert "__getattr__" not in vars(torch.Tensor)


@pytest.mark.parametrize("read", ["vars", "dict_get"])
def test_a_read_of_an_arguments_dict_is_refused(sim, read):
    how = {"vars": lambda x: vars(x).get("tag"), "dict_get": lambda x: x.__dict__.get("tag")}
    g, ref = _twins(lambda m, x: how[read](x) == "a")

    def tagged():
        x = torch.randn(4, 8)
        x.tag = "a"
        return (x,), {}
    _calls(g, ref, tagged, n=2)
    _calls(g, ref, _x, n=2)
    assert "Tensor.__dict__ [PYTHON_STATE]" in _reasons(g), _reasons(g)


def test_an_attribute_the_forward_does_not_read_keeps_the_graph(sim):
    def tagged():
        x = torch.randn(4, 8)
        x.meta = {"a": 1}
        return (x,), {}
    g, ref = _twins(lambda m, x: x.shape[0] > 2)
    _calls(g, ref, tagged)
    s = cg.stats(g)
    assert s.eager_calls == {} and s.replays == 3, s


_LAUNCHER = '''
def launch(x):
    # (as Triton's launcher does: code made at run time binds the arguments, reading their
    # data_ptr to pick the kernel specialised for that alignment)
    ns = {}
    exec(compile("def bind(x):\\n    return x.data_ptr() % 16\\n", "<string>", "exec"), ns)
    return ns["bind"](x)
'''


@pytest.mark.parametrize("trusted", [True, False])
def test_code_made_at_run_time_is_trusted_where_triton_calls_it(sim, tmp_path, monkeypatch,
                                                                 trusted):
    import importlib.util
    from cudagraphify import _probe
    folder = tmp_path / "triton_like"
    folder.mkdir()
    (folder / "launcher.py").write_text(_LAUNCHER)
    spec = importlib.util.spec_from_file_location("triton_like_launcher", folder / "launcher.py")
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    if trusted:
        monkeypatch.setattr(_probe, "_TRITON", str(folder) + "/")

    def read(m, x):
        launcher.launch(x)
        return True

    g, ref = _twins(read)
    _calls(g, ref, _x)
    s = cg.stats(g)
    if trusted:
        assert s.eager_calls == {} and s.replays == 3, s
    else:  # (called from anywhere else, the run-time code is the user's)
        assert "Tensor.data_ptr [PYTHON_STATE]" in _reasons(g), _reasons(g)
