"""``DirectCall``: a graphed module's call skips ``_call_impl`` and the wrapt proxy, but only while
``_call_impl`` would do nothing else than call the graphed forward."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify._wrap import DirectCall

pytestmark = pytest.mark.filterwarnings("ignore::cudagraphify.CudagraphifyWarning")


def _fresh(cls=nn.Linear) -> nn.Module:
    torch.manual_seed(0)
    return cls(4, 4)


def _python_calls(fn, *args) -> list[str]:
    """The names of the Python functions ``fn(*args)`` called."""
    names = []

    def profile(frame, event, arg):
        if event == "call":
            names.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return names


def _replays(m) -> int:
    return cg.stats(m).replays


def test_replays_skip_call_impl_and_match_eager(sim):
    ref = _fresh()
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(m(x), ref(x))
    assert isinstance(m.__dict__["_compiled_call_impl"].__self__, DirectCall)
    assert _replays(m) >= 2
    with torch.no_grad():
        replay = _python_calls(m, x)
        assert "_call_impl" in _python_calls(ref, x)
    assert "_call_impl" not in replay and "__call__" in replay, replay
    assert _replays(m) >= 3


def test_hooks_registered_after_capture_run_and_their_removal_replays_again(sim):
    m = cg.graphify(_fresh())
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            base = m(x)
        pre = m.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
        post = m.register_forward_hook(lambda mod, args, out: out + 1)
        assert torch.equal(m(x), m.__dict__["forward"].__wrapped__(x * 2) + 1)
        pre.remove()
        post.remove()
        before = _replays(m)
        assert torch.equal(m(x), base)
        assert _replays(m) == before + 1


def test_a_global_module_hook_runs(sim):
    m = cg.graphify(_fresh())
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            base = m(x)
        handle = nn.modules.module.register_module_forward_hook(
            lambda mod, args, out: out * 0 if mod is m else None)
        try:
            assert torch.equal(m(x), torch.zeros_like(base))
        finally:
            handle.remove()
        assert torch.equal(m(x), base)


def test_a_forward_of_the_instances_own_in_front_of_a_graphified_class_runs(sim):
    @cg.graphify
    class Lin(nn.Linear):
        pass

    m = Lin(4, 4)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            m(x)
        assert isinstance(m.__dict__["_compiled_call_impl"].__self__, DirectCall)
        m.forward = lambda inp: inp * 3
        assert torch.equal(m(x), x * 3)
    cg.ungraphify(Lin)


def test_ungraphify_of_the_instance_removes_it(sim):
    ref = _fresh()
    m = cg.graphify(copy.deepcopy(ref))
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            m(x)
        cg.ungraphify(m)
        assert "_compiled_call_impl" not in m.__dict__
        assert torch.equal(m(x), ref(x))


def test_ungraphify_of_the_class_makes_it_step_aside(sim):
    @cg.graphify
    class Lin(nn.Linear):
        def forward(self, x):
            return super().forward(x)

    m = Lin(4, 4)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            m(x)
        hook = m.__dict__["_compiled_call_impl"]
        assert isinstance(hook.__self__, DirectCall)
        Lin.forward = lambda self, inp: inp - 1  # replaced on the class: what runs now
        assert torch.equal(m(x), x - 1)
        cg.ungraphify(Lin) if cg._wrap.graphed_forward_of(Lin) else None
        assert "_compiled_call_impl" not in m.__dict__  # it removed itself


def test_not_installed_for_a_subclass_with_its_own_forward(sim):
    @cg.graphify
    class Base(nn.Linear):
        pass

    class Sub(Base):
        def forward(self, x):
            return super().forward(x) * 2

    m = Sub(4, 4)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            out = m(x)
        assert "_compiled_call_impl" not in m.__dict__
        assert torch.equal(out, nn.functional.linear(x, m.weight, m.bias) * 2)
    cg.ungraphify(Base)


class OwnCallImpl(nn.Linear):
    def _call_impl(self, *args, **kwargs):
        return super()._call_impl(*args, **kwargs) * 2


@pytest.mark.parametrize("how", ["subclass", "instance"])
def test_not_installed_where_call_impl_is_not_torchs(sim, how):
    torch.manual_seed(0)
    m = cg.graphify(OwnCallImpl(4, 4) if how == "subclass" else nn.Linear(4, 4))
    if how == "instance":
        m._call_impl = lambda *a, **k: nn.Module._call_impl(m, *a, **k) * 2
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(m(x), nn.functional.linear(x, m.weight, m.bias) * 2)
    assert "_compiled_call_impl" not in m.__dict__ and cg.stats(m).replays >= 1


def test_a_call_override_of_the_users_is_kept(sim):
    m = cg.graphify(_fresh())
    calls = []

    def mine(*args, **kwargs):
        calls.append(1)
        return m._call_impl(*args, **kwargs)

    m._compiled_call_impl = mine  # what module.compile() does, without compiling
    with torch.no_grad():
        for _ in range(3):
            m(torch.randn(2, 4))
    assert m.__dict__["_compiled_call_impl"] is mine and len(calls) == 3


def test_a_copy_gets_its_own(sim):
    m = cg.graphify(_fresh())
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            m(x)
        m2 = copy.deepcopy(m)
        assert "_compiled_call_impl" not in m2.__dict__
        for _ in range(3):
            assert torch.equal(m2(x), m(x))
        assert m2.__dict__["_compiled_call_impl"] is not m.__dict__["_compiled_call_impl"]
        assert cg.stats(m2).captures == 1


class Parent(nn.Module):
    def __init__(self):
        super().__init__()
        self.child = cg.graphify(nn.Linear(4, 4))

    def forward(self, x):
        return self.child(x) + 1


def test_a_parents_graph_ignores_the_childs_own_and_sees_a_users(sim):
    torch.manual_seed(0)
    p = cg.graphify(Parent())
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            base = p(x)
        p.child(x)  # the child's own state (and its DirectCall) now exist
        p.unrelated = 1  # moves the module-state epoch: the parent's guard looks again
        assert torch.equal(p(x), base) and cg.stats(p).captures == 1
        child = p.child
        child._compiled_call_impl = lambda *a, **k: child._call_impl(*a, **k) * 2
        want = nn.functional.linear(x, child.weight, child.bias) * 2 + 1
        assert torch.equal(p(x), want)
