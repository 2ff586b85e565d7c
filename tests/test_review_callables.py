"""Review of d3132f3 (callables kept as module attributes watched; a forward's own reads of its
module's ``__dict__`` recorded): silent differences from eager that remain, and loud
regressions (false refusals, recaptures on every call) the new watching causes.

Findings (strict xfails; silent ones assert eager's result, loud ones graphed-ness). Fixed, plain
tests now: S1, S2, L1, L2 (but a partial reaching 300 objects), L3, L5. Kept, documented in the
README (strict xfails): S3, L4, and L2's 300 objects (as for a module attribute holding them):

- S1 (silent): a function's DEFAULT ARGUMENTS are not watched. ``lambda t, cfg=cfg: t /
  cfg["temperature"]`` (the default-argument binding idiom of a loop), a mutable default
  (``def post(t, _state={...})``), ``__kwdefaults__``: the dict they hold changes, the graph
  replays the old value. ``_guards._watch_callable`` (FunctionType branch) watches
  ``__closure__`` and ``__dict__``, not ``__defaults__``/``__kwdefaults__``.
- S2 (silent): a bound method's FUNCTION is not watched, only its ``__self__``: a method whose
  function closes over a dict (a class made in a factory, a decorated method) replays stale.
  ``_watch_callable`` (MethodType branch: ``fn.__func__`` never reaches ``_watch_value``).
- S3 (silent): reads of the module's ``__dict__`` that bypass the patched
  ``nn.Module.__getattribute__`` (``object.__getattribute__(self, "__dict__")``) or happen in
  torch's files (``self.__getstate__()["scale"]``: the ``__dict__`` read is
  ``nn.Module.__getstate__``'s, excluded by ``_watch._OWN_DIRS``) are not recorded; F2 of hunt5
  holds for them.
- L1 (loud, new): a ``weakref.WeakMethod`` kept as an attribute (``self.cb()(t)``) runs eagerly
  on every call (was graphed) with a misleading reason ("forward changes a container ... on
  every call"): ``_watch_callable``'s weakref branch checks ``fn() is target``, and a
  WeakMethod makes a new bound method on every dereference.
- L2 (loud, new): a callable attribute whose reach is deep or wide is refused (eager every
  call; was graphed): ``functools.partial(f, cfg=cfg)`` with ``cfg`` a dict nested 4 deep
  ("nested more than 4 deep": the partial's keywords and the callable itself cost two levels;
  the same dict kept as ``self.cfg`` is graphed), a bound method of an object holding a nested
  config, a partial or bound method reaching 300 plain objects ("256+ mutable objects": a
  label list, a dataset, a tokenizer's added tokens), though the function reads none of it.
- L3 (loud, new): a bound method whose object holds a tensor it does not read (a trainer's
  optimizer state, an EMA) replaced every step: a recapture on every call (was one capture).
- L5 (loud, new; the documented policy for numpy attributes, now reached through callables):
  a numpy array in a callable attribute's closure (``len(mean)``, a preprocessing table) makes
  the forward run eagerly ("is a ndarray: it can change in place"); it was graphed.
- L4 (loud, new): a forward reading ``vars(self)["scale"]`` (``self.__dict__.get``) recaptures
  on every call when any other attribute of the module is set every call (``model.step = i``):
  the whole dict is guarded (``_DictCheck`` of it plus every attribute); ``self.scale`` read
  the ordinary way with the same counter keeps one graph (control).

Controls (plain): functools.wraps-decorated function and lru_cache over a closed-over dict,
nested closures rebound, a closure holding an unregistered module, numpy scalars and arrays in
closures and partials, a logger and a lock in a closure, a dict of functions and a list of
callables kept as attributes (item swapped), ``getattr(self, "__dict__")``,
``super().__getattribute__("__dict__")``, a user helper reading ``m.__dict__``,
``dict(vars(self))``, ``vars(self).get`` of a missing attribute then added, ``vars(child)``;
a tiny HF Llama graphed as before (skipped without transformers).
"""
from __future__ import annotations

import functools
import itertools
import logging
import threading
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cudagraphify as cg

pytestmark = pytest.mark.usefixtures("quiet", "sim")

torch.manual_seed(4321)
X = [torch.randn(3, 4) for _ in range(12)]


class _Post(nn.Module):
    def __init__(self, post):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.post = post

    def forward(self, x):
        return self.post(self.lin(x))


def _twin_run(make, change=None, n=6, at=3, every=False):
    """Graphs ``make()`` and runs it against an eager twin; ``change(model, i)`` applied to
    both at call ``at`` (and later ones with ``every``). Asserts eager's result, returns the
    graphed model."""
    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)
    g = cg.graphify(make())
    with torch.no_grad():
        for i in range(n):
            if change is not None and (i == at or (every and i > at)):
                change(ref, i)
                change(g, i)
            assert torch.equal(g(X[i]), ref(X[i])), f"call {i}: differs from eager's"
    return g


def _graphed_once(g, captures=1):
    s = cg.stats(g)
    assert s.eager == 0 and s.captures == captures, (
        f"captures={s.captures} replays={s.replays} eager={s.eager} {list(s.eager_calls)[:1]}")


def _post(make_fn):
    return lambda: _Post(make_fn())


def _set(attr_path, value):
    def change(m, i):
        obj = m
        *head, last = attr_path
        for step in head:
            obj = step(obj)
        if isinstance(obj, dict):
            obj[last] = value
        else:
            setattr(obj, last, value)
    return change


# -- S1: default arguments -------------------------------------------------------------------

def _default_arg_lambda():
    cfg = {"temperature": 1.0}
    return lambda t, cfg=cfg: t / cfg["temperature"]


def _mutable_default():
    def post(t, _state={"temperature": 1.0}):  # noqa: B006 (the idiom under test)
        return t / _state["temperature"]
    return post


def _kwdefaults():
    def post(t, *, temperature=1.0):
        return t / temperature
    return post


@pytest.mark.parametrize("kind", ["lambda_default_binding", "mutable_default", "kwdefaults"])
def test_s1_default_arguments_stale(kind):
    if kind == "lambda_default_binding":
        make, change = _default_arg_lambda, _set(
            [lambda m: m.post.__defaults__[0], "temperature"], 0.25)
    elif kind == "mutable_default":
        make, change = _mutable_default, _set(
            [lambda m: m.post.__defaults__[0], "temperature"], 0.25)
    else:
        make, change = _kwdefaults, _set([lambda m: m.post.__kwdefaults__, "temperature"], 0.25)
    _twin_run(_post(make), change)


def test_s1_control_same_dict_in_a_closure():
    def make():
        cfg = {"temperature": 1.0}
        return lambda t: t / cfg["temperature"]
    _twin_run(_post(make), _set([lambda m: m.post.__closure__[0].cell_contents,
                                 "temperature"], 0.25))


# -- S2: a bound method's function -----------------------------------------------------------

def _factory_method():
    state = {"temperature": 1.0}

    class Sched:
        def scale(self, t):
            return t / state["temperature"]
    return Sched().scale


def test_s2_bound_method_function_closure_stale():
    _twin_run(_post(_factory_method), _set(
        [lambda m: m.post.__func__.__closure__[0].cell_contents, "temperature"], 0.25))


def test_s2_control_plain_function_closure():
    def make():
        state = {"temperature": 1.0}

        def scale(t):
            return t / state["temperature"]
        return scale
    _twin_run(_post(make), _set([lambda m: m.post.__closure__[0].cell_contents,
                                 "temperature"], 0.25))


# -- S3 / F2 variants: reads of the module's __dict__ ----------------------------------------

def _helper_reads_dict(m):
    return m.__dict__["scale"]


class _DictRead(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = 1.0
        self.step = 0
        self.how = how
        self.c = nn.Module()
        self.c.scale = 1.0

    def forward(self, x):
        h = self.how
        if h == "object_getattribute":
            s = object.__getattribute__(self, "__dict__")["scale"]
        elif h == "getstate":
            s = self.__getstate__()["scale"]
        elif h == "getattr":
            s = getattr(self, "__dict__")["scale"]
        elif h == "super":
            s = super().__getattribute__("__dict__")["scale"]
        elif h == "helper":
            s = _helper_reads_dict(self)
        elif h == "copy_vars":
            s = dict(vars(self))["scale"]
        elif h == "vars_get_missing":
            s = vars(self).get("extra", 1.0)
        elif h == "child":
            s = vars(self.c)["scale"]
        elif h == "vars":
            s = vars(self)["scale"]
        else:  # "plain"
            s = self.scale
        return self.lin(x) * s


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="documented (README): a __dict__ read bypassing the patched "
                          "__getattribute__, or in torch's files (__getstate__), is not recorded")
@pytest.mark.parametrize("how", ["object_getattribute", "getstate"])
def test_s3_dict_read_not_recorded(how):
    _twin_run(lambda: _DictRead(how), _set(["scale"], 0.25))


@pytest.mark.parametrize("how", ["getattr", "super", "helper", "copy_vars", "vars"])
def test_s3_control_dict_reads_recorded(how):
    _twin_run(lambda: _DictRead(how), _set(["scale"], 0.25))


def test_s3_control_vars_get_missing_then_added_and_child():
    _twin_run(lambda: _DictRead("vars_get_missing"), _set(["extra"], 0.25))
    _twin_run(lambda: _DictRead("child"), _set([lambda m: m.c, "scale"], 0.25))


# -- L1: WeakMethod --------------------------------------------------------------------------

class _Sched:
    def __init__(self):
        self.temperature = 1.0

    def scale(self, t):
        return t / self.temperature


class _WeakMethodPost(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.sched = _Sched()
        self.cb = weakref.WeakMethod(self.sched.scale)

    def forward(self, x):
        return self.cb()(self.lin(x))


def test_l1_weakmethod_attribute_refused():
    g = _twin_run(_WeakMethodPost)
    _graphed_once(g)


def test_l1_control_weakref_to_object():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.sched = _Sched()
            self.ref = weakref.ref(self.sched)

        def forward(self, x):
            return self.ref().scale(self.lin(x))
    g = _twin_run(M, _set([lambda m: m.sched, "temperature"], 0.25))
    _graphed_once(g, captures=2)


# -- L2: deep or wide reach ------------------------------------------------------------------

def _read_d(t, cfg):
    return t / cfg["a"]["b"]["c"]["d"]


def _nested():
    return {"a": {"b": {"c": {"d": 1.0}}}}


class _Labels:
    def __init__(self, i):
        self.name = f"label{i}"


class _DeepOwner:
    def __init__(self):
        self.cfg = {"model": {"head": {"opts": {"x": [1]}}}}
        self.temperature = 1.0

    def scale(self, t):
        return t / self.temperature


class _WideOwner(_DeepOwner):
    def __init__(self):
        super().__init__()
        self.cfg = None
        self.samples = [_Labels(i) for i in range(300)]


def _ignore_labels(t, labels):
    return t * 2


@pytest.mark.parametrize("kind", [
    "partial_nested_cfg", "bound_method_nested_cfg", "bound_method_300_objects",
    pytest.param("partial_300_objects", marks=pytest.mark.xfail(
        strict=True, raises=AssertionError,
        reason="kept by design: a partial's keyword holding 300 objects is watched as a module "
               "attribute holding them is, past the 256 a graph watches: refused (README)"))])
def test_l2_deep_or_wide_callable_refused(kind):
    make = {
        "partial_nested_cfg": lambda: functools.partial(_read_d, cfg=_nested()),
        "bound_method_nested_cfg": lambda: _DeepOwner().scale,
        "partial_300_objects": lambda: functools.partial(
            _ignore_labels, labels=[_Labels(i) for i in range(300)]),
        "bound_method_300_objects": lambda: _WideOwner().scale,
    }[kind]
    _graphed_once(_twin_run(_post(make)))


def test_l2_control_same_dict_read_as_attribute():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.cfg = _nested()

        def forward(self, x):
            return _read_d(self.lin(x), self.cfg)
    _graphed_once(_twin_run(M))


# -- L3: an unread tensor of a bound method's object replaced every step ----------------------

class _Trainer:
    def __init__(self):
        self.opt_state = {"exp_avg": torch.zeros(4)}
        self.temperature = 1.0

    def scale(self, t):
        return t / self.temperature


def _new_state(m, i):
    m.post.__self__.opt_state["exp_avg"] = torch.full((4,), float(i))


def test_l3_unread_tensor_replaced_recaptures_every_call():
    g = _twin_run(_post(lambda: _Trainer().scale), _new_state, n=10, every=True)
    _graphed_once(g)


def test_l3_control_temperature_change_seen():
    g = _twin_run(_post(lambda: _Trainer().scale),
                  _set([lambda m: m.post.__self__, "temperature"], 0.25))
    _graphed_once(g, captures=2)


# -- L4: vars(self) read, another attribute set every call -----------------------------------

def _step(m, i):
    m.step = i


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="kept by design (README): vars(self) guards the whole dict: an unrelated "
                          "attribute set every call recaptures every call")
def test_l4_vars_read_unrelated_attribute_recaptures_every_call():
    _graphed_once(_twin_run(lambda: _DictRead("vars"), _step, n=10, every=True))


def test_l4_control_plain_read_unrelated_attribute():
    _graphed_once(_twin_run(lambda: _DictRead("plain"), _step, n=10, every=True))


# -- L5: a numpy array in a callable's closure -----------------------------------------------

def test_l5_numpy_array_in_closure_refused():
    def make():
        mean = np.ones(4, dtype=np.float32)  # (used for its length only)
        return lambda t: t * 2.0 + 0 * len(mean)
    _graphed_once(_twin_run(_post(make)))


# -- controls: other callables ---------------------------------------------------------------

def _wraps():
    st = {"t": 1.0}

    def inner(t):
        return t / st["t"]

    @functools.wraps(inner)
    def outer(t):
        return inner(t)
    return outer


def _lru():
    st = {"t": 1.0}

    @functools.lru_cache(None)
    def factor():
        return st["t"]
    f = lambda t: t / factor()  # noqa: E731
    f.factor = factor
    return f


def _nested_rebound():
    box = {}
    t = 1.0

    def mk():
        def inner(x):
            return x / t
        return inner
    inner = mk()

    def set_t(v):
        nonlocal t
        t = v
    f = lambda x: inner(x)  # noqa: E731
    f.set_t = set_t
    del box
    return f


class _Sub(nn.Module):
    def __init__(self):
        super().__init__()
        self.t = 1.0


def _cell_module():
    sub = _Sub()
    f = lambda x: x / sub.t  # noqa: E731
    f.sub = sub
    return f


def _st_of(m):
    return m.post.__wrapped__.__closure__[0].cell_contents


def _chg_wraps(m, i):
    m.post.__closure__[0].cell_contents.__closure__[0].cell_contents["t"] = 0.25


def _chg_lru(m, i):
    m.post.factor.__wrapped__.__closure__[0].cell_contents["t"] = 0.25
    m.post.factor.cache_clear()


@pytest.mark.parametrize("kind", ["wraps", "lru_cache", "nested_rebound", "cell_module"])
def test_control_other_callables_changes_seen(kind):
    make, change = {
        "wraps": (_wraps, _chg_wraps),
        "lru_cache": (_lru, _chg_lru),
        "nested_rebound": (_nested_rebound, lambda m, i: m.post.set_t(0.25)),
        "cell_module": (_cell_module, lambda m, i: setattr(m.post.sub, "t", 0.25)),
    }[kind]
    _twin_run(_post(make), change)


@pytest.mark.parametrize("kind", ["np_scalar", "partial_np_kw", "logger_lock", "torch_partial"])
def test_control_graphed_once(kind):
    def np_scalar():
        s = np.float32(2.0)
        return lambda t: t * float(s)

    def np_array():
        a = np.ones(4, dtype=np.float32)
        return lambda t: t * 2.0 + 0 * len(a)

    def logger_lock():
        log, lock = logging.getLogger("cg-review"), threading.Lock()
        return lambda t: t if (log and lock) else -t
    make = {"np_scalar": np_scalar, "np_array": np_array,
            "partial_np_kw": lambda: functools.partial(F.leaky_relu,
                                                       negative_slope=np.float64(0.2)),
            "logger_lock": logger_lock,
            "torch_partial": lambda: functools.partial(F.gelu, approximate="tanh")}[kind]
    _graphed_once(_twin_run(_post(make)))


class _Table(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.acts = {"act": F.relu}
        self.chain = [torch.tanh, F.relu]

    def forward(self, x):
        y = self.acts["act"](self.lin(x))
        for f in self.chain:
            y = f(y)
        return y


def test_control_dict_and_list_of_callables_swapped():
    _twin_run(_Table, _set([lambda m: m.acts, "act"], F.silu))

    def swap(m, i):
        m.chain[1] = torch.sigmoid
    _twin_run(_Table, swap)


def test_control_iterator_in_closure_is_a_python_side_effect():
    """Not from this change (a note): ``next(it)`` in the forward runs at capture only; the
    graph replays the first value. Pinned as it behaves (no claim about correctness)."""
    it = itertools.cycle([1.0, 0.5])
    torch.manual_seed(0)
    g = cg.graphify(_Post(lambda t: t * next(it)))
    with torch.no_grad():
        for i in range(4):
            g(X[i])
    assert cg.stats(g).eager == 0


def test_control_hf_llama_graphed_as_before():
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    m = T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).eval()
    g = cg.graphify(m)
    ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        want = m(ids, use_cache=False)[0]
        for _ in range(4):
            got = g(ids, use_cache=False)[0]
    assert torch.equal(got, want)
    s = cg.stats(g)
    # (before d3132f3 the same: 12 piecewise captures, 48 replays over 4 calls; 18 and 72 with
    # transformers 5.17: each piece captured once and replayed on every call)
    assert s.captures >= 12 and s.replays == 4 * s.captures, \
        (s.captures, s.replays, list(s.eager_calls)[:1])
