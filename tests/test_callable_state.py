"""A graphed callable object: which of its attributes guard the graph (``_guards._self_reads``:
those its ``__call__`` reads as ``self.<name>``, through the methods it calls on ``self``; the
object whole where ``self`` goes anywhere else), and that a change of a read one is seen while an
unread one costs nothing. CPU, on the simulated backend (``sim``)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify._guards import _self_reads, callable_state


class _Reads:
    def __init__(self):
        self.lin, self.t, self.k, self.n, self.unread = nn.Linear(4, 4), 1.0, 2.0, 0, []

    def __call__(self, x):
        self.n += 1  # (read and set)
        return self._scaled(self.lin(x)) + sum(self.k for _ in range(1))

    def _scaled(self, y):
        return y / self.t


class _Dynamic(_Reads):
    def __call__(self, x):
        return self.lin(x) / getattr(self, "t")


class _Passed(_Reads):
    def __call__(self, x):
        return _outside(self, x)


def _outside(obj, x):
    return obj.lin(x) / obj.t


class _Super(_Reads):
    def __call__(self, x):
        return super().__call__(x)


class _Property(_Reads):
    @property
    def scale(self):
        return self.t

    def __call__(self, x):
        return self.lin(x) / self.scale


class _Static(_Reads):
    @staticmethod
    def _half(y):
        return y / 2

    def __call__(self, x):
        return self._half(self.lin(x))


def test_the_names_read_through_methods_comprehensions_and_augmented_assignments():
    assert _self_reads(_Reads, _Reads.__call__) == {"n", "_scaled", "lin", "t", "k"}
    assert _self_reads(_Static, _Static.__call__) == {"_half", "lin"}


@pytest.mark.parametrize("cls", [_Dynamic, _Passed, _Super, _Property],
                         ids=["getattr(self)", "self passed on", "super()", "a property"])
def test_self_used_otherwise_watches_the_object_whole(cls):
    assert _self_reads(cls, cls.__call__) is None
    _, objects, bindings = callable_state(cls())
    assert [w for w, _ in objects] == [f"the callable {cls.__name__} object"] and not bindings


def test_only_the_read_attributes_are_bound():
    obj = _Static()
    _, objects, bindings = callable_state(obj)
    names = [b[0] for b in bindings]
    assert names == ["the attribute _Static._half of the callable object",
                     "the attribute _Static.lin of the callable object",
                     "the __dict__ of the callable _Static object",
                     "the class of the callable _Static object"], names
    assert not objects  # (lin is a module: the module tree guards it; _half is on the class)


def _calls(g, n, before=None):
    torch.manual_seed(1)
    for i in range(n):
        if before is not None:
            before(i)
        with torch.no_grad():
            g(torch.randn(3, 4))
    return cg.stats(g)


class _Step:
    def __init__(self):
        self.lin, self.t, self.calls = nn.Linear(4, 4), 1.0, 0

    def __call__(self, x):
        return self.lin(x) / self.t


@pytest.mark.parametrize("cls", [_Step, type("_DynStep", (_Step,), {
    "__call__": lambda self, x: self.lin(x) / getattr(self, "t")})], ids=["read", "dynamic"])
def test_a_read_attribute_changed_is_seen_an_unread_one_costs_nothing(sim, cls):
    obj = cls()
    g = cg.graphify(obj)
    s = _calls(g, 6, lambda i: setattr(obj, "calls", i) if cls is _Step else None)
    assert (s.captures, s.replays) == (1, 5), s  # (calls is not read: no recapture)
    obj.t = 0.5
    x = torch.randn(3, 4)
    with torch.no_grad():
        assert torch.equal(g(x), obj.lin(x) / 0.5)
    assert cg.stats(g).captures == 2


def test_an_equal_constant_set_again_keeps_the_graph(sim):
    obj = _Step()
    g = cg.graphify(obj)
    s = _calls(g, 4, lambda i: setattr(obj, "t", float("1.0")))  # (a new, equal float)
    assert (s.captures, s.replays) == (1, 3), s


class _AttrDict(dict):
    """A config-style callable: attributes are its items; an unknown one raises KeyError."""

    def __getattr__(self, k):
        return self[k]

    def __call__(self, x):
        return x * self["scale"]


class _SlotsRaising:
    """No ``__dict__``; its ``__getattr__`` raises KeyError for what it lacks."""

    __slots__ = ("scale",)

    def __init__(self):
        self.scale = 2.0

    def __getattr__(self, k):
        raise KeyError(k)

    def __call__(self, x):
        return x * self.scale


@pytest.mark.parametrize("cls", [_AttrDict, _SlotsRaising], ids=["attrdict", "slots"])
def test_a_getattr_raising_keyerror_is_not_asked_for_a_name_or_dict(sim, cls):
    # (the first call asked ``getattr(obj, "__qualname__")`` and ``getattr(obj, "__dict__")``,
    # and the object's ``__getattr__`` raised KeyError out of the call)
    obj = cls(scale=2.0) if cls is _AttrDict else cls()
    g = cg.graphify(obj)
    x = torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(g(x), x * 2.0)
        assert (cg.stats(g).captures, cg.stats(g).replays) == (1, 2)
        if cls is _AttrDict:
            obj["scale"] = 3.0
        else:
            obj.scale = 3.0
        assert torch.equal(g(x), x * 3.0)  # (a change is still seen)
    assert cg.stats(g).captures == 2
    assert cg.explain(g).name == cls.__qualname__  # (its class names it)


def test_a_library_is_told_from_the_users_code_by_the_metadata_beside_it(tmp_path, monkeypatch):
    # (a library installed with ``pip install --target`` outside site-packages, as Thunder is on
    # the GPU machine, keeps its functions' closures its own: held by identity; the user's own
    # code, a source checkout, has no .dist-info beside it: what its closures hold is watched)
    import importlib
    import sys

    from cudagraphify import _guards

    for name, meta in (("libpkg_x", True), ("userpkg_x", False)):
        root = tmp_path / ("site" if meta else "checkout")
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text(
            "import functools\n\ndef user(x):\n    return x\n\n"
            "def make(g):\n    @functools.wraps(g)\n    def f(x):\n        return g(x)\n    return f\n"
            "\nf = make(user)\n")
        if meta:
            (root / f"{name}-1.0.dist-info").mkdir()
        monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(_guards, "_installed", {})
    lib, user = (importlib.import_module(n) for n in ("libpkg_x", "userpkg_x"))

    def wrapped_users(x):  # (a library's wrapper of the user's function: its __module__ theirs)
        return x

    thunder_like = lib.make(wrapped_users)
    try:
        assert _guards._library_function(lib.f) and not _guards._library_function(user.f)
        assert thunder_like.__module__ == __name__ and _guards._library_function(thunder_like)
        assert _guards._library_function(torch.nn.functional.relu.__wrapped__
                                         if hasattr(torch.nn.functional.relu, "__wrapped__")
                                         else torch.nn.functional.relu)
    finally:
        sys.modules.pop("libpkg_x", None), sys.modules.pop("userpkg_x", None)


@pytest.mark.parametrize("fn", [torch.sin, torch.nn.functional.gelu, torch.Tensor.exp],
                         ids=["torch.sin", "F.gelu", "Tensor.exp"])
def test_a_torch_function_graphified_itself_is_captured(sim, fn):
    # (its call was made from cudagraphify's own frame, whose torch calls the probe leaves
    # out: the output looked made outside the call, and every call ran eagerly)
    g = cg.graphify(fn)
    x = torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(g(x), fn(x))
    s = cg.stats(g)
    assert (s.captures, s.replays, dict(s.eager_calls)) == (1, 2, {}), s
    assert cg.ungraphify(g) is fn


def test_a_partial_of_a_torch_function_sees_its_keywords_change(sim):
    add = functools.partial(torch.add, alpha=2.0)
    g = cg.graphify(add)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(g(x, y), torch.add(x, y, alpha=2.0))
        assert (cg.stats(g).captures, cg.stats(g).replays) == (1, 2)
        add.keywords["alpha"] = 3.0  # (the graph's kernels have 2.0 in them)
        assert torch.equal(g(x, y), torch.add(x, y, alpha=3.0))
    assert cg.ungraphify(g) is add


def test_only_a_torch_function_gets_a_call_of_the_users():
    from cudagraphify._wrap import user_call

    def plain(x):
        return x

    assert user_call(plain) is None and user_call(functools.partial(plain, 1)) is None
    call = user_call(torch.sin)
    assert call.__cudagraphify_calls__ is torch.sin and callable_state(call)[0] is torch.sin
    p = functools.partial(torch.add, alpha=2)
    fn, objects, _ = callable_state(user_call(p))
    assert fn is torch.add and [w for w, _ in objects] == [
        "the functools.partial's bound arguments", "the functools.partial's bound keywords"]
