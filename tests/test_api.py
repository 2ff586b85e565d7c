"""The public API: decorator forms, detaching, options, errors, stats and explain."""

from __future__ import annotations

import copy
import inspect
import pickle
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import CudagraphifyError


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, scale: float = 1.0):
        return self.lin(x) * scale


def test_public_api():
    for name in ("graphify", "graph_region", "share_graph", "explain", "mark_static", "stats",
                 "CudagraphifyError"):
        assert name in cg.__all__ and hasattr(cg, name)


def test_instance_form_wraps_in_place_and_detaches():
    m = Net()
    original = inspect.signature(m.forward)
    assert cg.graphify(m) is m
    assert m.forward.__name__ == "forward"
    assert inspect.signature(m.forward) == original
    assert "forward" in m.__dict__
    cg.ungraphify(m)
    assert "forward" not in m.__dict__ and "_cudagraphify_state" not in m.__dict__
    assert m.forward.__func__ is Net.forward


def test_class_form_bare_and_with_options_and_detach():
    class A(Net):
        pass

    class B(Net):
        pass

    assert cg.graphify(A) is A
    cg.graphify(max_graphs=3)(B)
    a, b = A(), B()
    assert a.forward.__name__ == "forward"
    assert inspect.signature(a.forward) == inspect.signature(Net().forward)
    x = torch.randn(2, 4)
    with pytest.warns(cg.CudagraphifyWarning, match="not on a CUDA device"):
        torch.testing.assert_close(a(x), a.lin(x))
    assert cg.stats(a).eager == 1 and cg.stats(b).eager == 0
    assert b.__dict__.get("_cudagraphify_state") is None
    cg.ungraphify(A), cg.ungraphify(B)
    assert "forward" not in A.__dict__ and A.forward is Net.forward


def test_class_with_its_own_forward_gets_it_back():
    class C(nn.Module):
        def forward(self, x):
            return x + 1

    f = C.__dict__["forward"]
    cg.graphify(C)
    assert C.__dict__["forward"] is not f
    cg.ungraphify(C)
    assert C.__dict__["forward"] is f


def test_function_form_bare_and_with_options():
    def f(x, y):
        return x + y

    g = cg.graphify(f)
    h = cg.graphify(enabled=False)(f)
    assert g.__name__ == "f" and inspect.signature(g) == inspect.signature(f)
    x = torch.ones(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(g(x, x), x + x) and torch.equal(h(x, x), x + x)
    assert cg.stats(h).eager_calls == {"disabled (enabled=False)": 1}
    assert cg.ungraphify(g) is f


def test_decorated_forward_method_is_per_instance():
    class D(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        @cg.graphify(static_argnames=("cache",))
        def forward(self, x, cache):
            return x * self.w

    d1, d2 = D(), D()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d1(torch.ones(2), None), d1(torch.ones(2), None), d2(torch.ones(2), None)
    assert cg.stats(d1).eager == 2 and cg.stats(d2).eager == 1


def test_usage_errors_are_clear():
    with pytest.raises(CudagraphifyError, match="Module subclass"):
        cg.graphify(int)
    with pytest.raises(CudagraphifyError, match="expects"):
        cg.graphify(3)
    with pytest.raises(CudagraphifyError, match="num_warmup_iters"):
        cg.graphify(num_warmup_iters=0)
    with pytest.raises(CudagraphifyError, match="enabled"):
        cg.graphify(enabled="yes")
    with pytest.raises(CudagraphifyError, match=r"static_argnames names \['nope'\].*\['x', 'scale'\]"):
        cg.graphify(Net(), static_argnames=("nope",))
    with pytest.raises(CudagraphifyError, match="cache_policy or key_fn"):
        cg.graphify(cache_policy=cg.CachePolicy(), key_fn=lambda s: s)
    m = cg.graphify(Net())
    with pytest.raises(CudagraphifyError, match="already graphified"):
        cg.graphify(m)
    with pytest.raises(CudagraphifyError, match="not graphified"):
        cg.ungraphify(Net())
    with pytest.raises(CudagraphifyError, match="not graphified"):
        cg.stats(Net())
    with pytest.raises(CudagraphifyError, match="probe"):
        cg.graphify(probe="sometimes")
    with pytest.raises(CudagraphifyError, match="OpPolicy"):
        cg.graphify(op_policy=object())


@pytest.mark.parametrize("value", [None, 0, 1, "no"])
def test_copy_outputs_takes_only_a_bool(value):
    with pytest.raises(cg.CudagraphifyUsageError,
                       match=rf"copy_outputs must be True or False, got {value!r}: True"):
        cg.graphify(Net(), copy_outputs=value)
    assert issubclass(cg.CudagraphifyUsageError, CudagraphifyError)


def test_static_argnames_must_be_names():
    with pytest.raises(cg.CudagraphifyUsageError,
                       match=r"static_argnames must be an argument name or a tuple of names, "
                             r"got 3; e.g. static_argnames=\('cache',\)"):
        cg.graphify(Net(), static_argnames=3)
    with pytest.raises(cg.CudagraphifyUsageError, match=r"got \('x', 2\)"):
        cg.graphify(Net(), static_argnames=("x", 2))
    cg.graphify(Net(), static_argnames="scale")  # one name


def test_max_graphs_and_a_cache_policy_must_agree():
    with pytest.raises(cg.CudagraphifyUsageError,
                       match=r"max_graphs=4 and a cache_policy with max_graphs=2: .*"
                             r"CachePolicy\(max_graphs=4, \.\.\.\)"):
        cg.graphify(lambda x: x, cache_policy=cg.CachePolicy(max_graphs=2), max_graphs=4)
    f = cg.graphify(lambda x: x, cache_policy=cg.CachePolicy(max_graphs=2), max_graphs=2)
    assert f._self_dispatch.options.max_graphs == 2
    f = cg.graphify(lambda x: x, cache_policy=cg.CachePolicy(max_graphs=2))
    assert f._self_dispatch.options.max_graphs == 2
    assert cg.graphify(lambda x: x)._self_dispatch.options.max_graphs == 16
    assert cg.graphify(lambda x: x, key_fn=hash, max_graphs=3)._self_dispatch.options \
        .cache_policy.max_graphs == 3


def test_share_graph_names_itself_for_an_unknown_option():
    layers = [Net(), Net()]
    with pytest.raises(cg.CudagraphifyUsageError,
                       match=r"share_graph\(\) got unknown option\(s\) bogus; its options are "
                             r"num_warmup_iters, .*op_policy"):
        cg.share_graph(layers, bogus=1)
    with pytest.raises(cg.CudagraphifyUsageError, match="copy_outputs must be True or False"):
        cg.share_graph(layers, copy_outputs=0)
    assert all("forward" not in m.__dict__ for m in layers)  # nothing was installed


def test_instance_of_graphified_class_cannot_be_graphified_again():
    class E(Net):
        pass

    cg.graphify(E)
    try:
        with pytest.raises(CudagraphifyError, match="as a class"):
            cg.graphify(E())
        with pytest.raises(CudagraphifyError, match="ungraphify\\(type"):
            cg.ungraphify(E())
    finally:
        cg.ungraphify(E)


def test_deepcopy_gives_a_fresh_graphified_module_and_pickle_is_refused():
    m = cg.graphify(Net())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m(torch.ones(1, 4))
        m2 = copy.deepcopy(m)
        m2(torch.ones(1, 4))
    assert cg.stats(m2).eager == 1 and cg.stats(m).eager == 1
    assert m2.forward.__self__ is m2 if hasattr(m2.forward, "__self__") else True
    with pytest.raises(CudagraphifyError, match="ungraphify"):
        pickle.dumps(m)


def test_module_hooks_still_run_around_the_graphed_forward():
    m = cg.graphify(Net())
    seen = []
    m.register_forward_pre_hook(lambda mod, args: seen.append("pre"))
    m.register_forward_hook(lambda mod, args, out: seen.append("post"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m(torch.ones(1, 4))
    assert seen == ["pre", "post"]


@pytest.mark.filterwarnings("ignore::cudagraphify.CudagraphifyWarning")
def test_user_exception_reaches_the_caller_unchanged():
    class Boom(Exception):
        pass

    @cg.graphify
    def f(x):
        raise Boom("mine")

    with pytest.raises(Boom, match="mine"):
        f(torch.ones(1))


def test_eager_fallback_warns_once_per_reason_and_is_counted():
    m = cg.graphify(Net())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            m(torch.ones(1, 4))
    msgs = [str(x.message) for x in w if issubclass(x.category, cg.CudagraphifyWarning)]
    assert len(msgs) == 1 and "Net.forward runs eagerly" in msgs[0]
    assert w[0].filename == __file__  # points at the caller, not at cudagraphify
    assert cg.stats(m).eager_calls == {"tensors are on cpu, not on a CUDA device": 3}
    report = cg.explain(m)
    assert "eager" in str(report) and report.to_dict()["stats"]["captures"] == 0


def test_a_graphified_forward_does_not_pass_for_a_function_or_a_method():
    # A proxy reporting its wrapped's class made torch.compile (torch 2.11, wrapt 2.5) trace
    # the original forward through ``__func__``: the graphs were bypassed without a word.
    import types

    @cg.graphify
    class Lin(nn.Linear):
        pass

    inst = cg.graphify(nn.Linear(2, 2))
    for fwd in (inst.forward, Lin(2, 2).forward, inspect.getattr_static(Lin, "forward")):
        assert not isinstance(fwd, (types.FunctionType, types.MethodType)), type(fwd)
    for fwd in (inst.forward, Lin(2, 2).forward):
        assert list(inspect.signature(fwd).parameters) == ["input"]  # still introspectable
    cg.ungraphify(Lin)
