"""Review hunt 5: silent differences from eager around a model's LIFECYCLE and HOOKS, as users
write them (an eager twin made with ``copy.deepcopy`` before ``graphify`` or built from the same
seed, several calls with changes between, outputs compared bitwise).

Findings (silent: no error, no warning, no eager call; were strict xfails asserting eager's
result, fixed: plain tests now):

- F1: a CALLABLE KEPT AS A MODULE ATTRIBUTE (``self.post = sched.scale`` a bound method of a
  plain object, ``self.post = lambda t: t / cfg["temperature"]``, a lambda over a rebound local,
  ``self.act = functools.partial(F.leaky_relu, negative_slope=0.2)``, a function with an
  attribute) is held by identity only: the non-tensor values it reads when the forward calls it
  (the bound object's attributes, closure cells and what a closed-over dict holds, the partial's
  keywords, the function's attributes) are baked into the graph as kernel scalars or control
  flow, and a later change of them replays the old value. The same for a ``weakref.ref`` /
  ``weakref.proxy`` to a plain object kept as an attribute (``self._owner().temperature``):
  ``weakref`` is in ``_guards._INFRASTRUCTURE``, held by identity, the object it reaches not
  watched (a weakref to a *module* is fine: the module's attribute read is recorded; control). The same object held as an attribute
  and called as ``self.sched.scale(t)`` is watched (control), and so is a callable object
  (``__call__``) kept as an attribute, and a ``functools.partial`` that is itself graphified
  (README: "a functools.partial's bound arguments and keywords ... are watched"); the guard
  model's table promises "callable objects" among the module attributes it watches.
  Tensors read this way are refused (OUTSIDE_TENSOR, eager: controls), so only non-tensor
  values are silently stale.
  Where: ``_guards._watch_value``: ``_IDENTITY_TYPES`` (FunctionType, MethodType,
  functools.partial) return before anything they reach is watched; a bound method's
  ``__self__`` (as ``_guards`` does for a graphed callable: ``_watch_object``), a function's
  closure cells and ``__dict__`` and a partial's ``args``/``keywords`` could be watched as the
  graphed target's are.

- F2: a forward that reads its own attributes through ``self.__dict__`` (``self.__dict__.get(
  "scale", 1.0)``, ``vars(self)["scale"]``): the read is not recorded (``__dict__`` is in
  ``_watch.INTERNAL_ATTRS``, and the value read from the dict passes no ``__getattribute__``),
  so ``m.scale = 2.0`` (an ordinary ``setattr``, which moves the epoch) finds no guard that read
  ``scale``, and the graph replays the old scale. README documents *writes* into ``__dict__`` as
  unguarded, not reads of attributes that are set the ordinary way.
  Where: ``_watch.Recorder`` (``nn.Module.__getattribute__`` of ``"__dict__"``): a forward that
  reads a module's ``__dict__`` could guard that dict's version (``dict_version``) per call, or
  be refused.

Loud, not silent (plain tests pin it): ``cg.ungraphify(model)`` between a training forward and
its ``backward()`` raises ``CudagraphifyError`` ("backward of a graphed call whose graph was
released") where eager's backward works; the message lists eviction, invalidation and regions,
not ``ungraphify``.

Controls (plain tests, all pass): ``ungraphify`` then ``graphify`` with other options; nested
graphify (child then root, root then child, a hook on the child, ungraphify of either);
``copy.deepcopy`` of a graphified model and of a plain model holding a graphified child;
``load_state_dict`` copying and ``assign=True``; ``apply(init)``; ``reset_parameters``;
``to_empty`` + load; ``half()``/``double()`` and back; ``requires_grad_(False)`` then on;
parameters replaced by new ``nn.Parameter`` (also a strided one); ``vector_to_parameters``;
``torch.func.functional_call``; pruning (before and after capture, mask and orig changed,
``prune.remove``); ``spectral_norm`` in training; old-style ``weight_norm`` with SGD;
``set_submodule``/``register_module``/``append``/``del``; ParameterList/ParameterDict changes;
``graphify(Class)`` with recursive instances, a subclass calling ``super().forward``, copies,
``ungraphify(Class)``; hooks added after capture on the root, a child and a grandchild
(pre/post, ``with_kwargs``, ``always_call``, ``prepend``, in-place input/output changes, a hook
whose closure value changes, removal), hook call counts, activations kept by a hook without
clone, a feature hook registered and removed every other call with weight changes, global
module hooks (before/after capture, counts), full backward hooks and backward pre-hooks in
training, ``register_post_accumulate_grad_hook`` optimizer-in-backward, a parameter tensor hook
whose closure changes; unregistered modules (a plain list) and global modules whose parameter
is replaced or that get a hook; a graphed function running a module (graphed or not) whose
hooks, parameters, submodules and mode change; two graphified modules sharing a parameter
(accumulation, clipping, both ``zero_grad`` modes); batch sizes interleaved with weight
updates beyond ``max_graphs``; BatchNorm training with eval calls between; outputs (dict,
dataclass) mutated by the user; outputs kept and written in place; functions with defaults,
keyword-only arguments, ``*args``/``**kwargs``, a closed-over list appended to, a global tensor
changed and rebound, ``graphify(model.encode)`` with attribute, submodule and parameter
changes, ``functools.partial`` of a graphed function, the same tensor as two arguments.

CPU, on the simulated backend. GPU reproductions: ``.ci/review/hunt5/``.
"""
from __future__ import annotations

import copy
import functools
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _M
from torch.nn.utils import prune

import cudagraphify as cg

pytestmark = pytest.mark.usefixtures("quiet", "sim")

torch.manual_seed(1234)
X = [torch.randn(3, 4) for _ in range(10)]


def _eq(a, b, what=""):
    assert torch.equal(a, b), f"{what}: differs from eager's"


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
                         nn.Linear(8, 4))


def _twins(make=_mlp, **kw):
    ref = make()
    return cg.graphify(copy.deepcopy(ref), **kw), ref


def _calls(g, ref, xs=X[:3], what=""):
    with torch.no_grad():
        for i, x in enumerate(xs):
            _eq(g(x), ref(x), f"{what} call {i}")


# -- F1: a callable kept as a module attribute: what it reads is held by identity -------------

class _Post(nn.Module):
    """A linear layer and a post-processing callable kept as an attribute."""

    def __init__(self, post):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.post = post

    def forward(self, x):
        return self.post(self.lin(x))


class _Sched:
    """A plain object (a temperature schedule, a quantizer's calibration) with a method."""

    def __init__(self):
        self.temperature = 1.0

    def scale(self, t):
        return t / self.temperature


class _Holds(nn.Module):
    """Control: the same object kept as an attribute, its method called through it."""

    def __init__(self, sched):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.sched = sched

    def forward(self, x):
        return self.sched.scale(self.lin(x))


class _CallObj:
    def __init__(self):
        self.temperature = 1.0

    def __call__(self, t):
        return t / self.temperature


def _post_case(kind):
    """(graphed, eager, change): twins of _Post around two equal callables of ``kind``, and a
    change of what they read (the same change applied to both)."""
    if kind == "bound_method":
        a, b = _Sched(), _Sched()

        def change(v):
            a.temperature = b.temperature = v
        return a.scale, b.scale, change
    if kind == "lambda_over_dict":
        cfg = {"temperature": 1.0}

        def change(v):
            cfg["temperature"] = v
        return (lambda t: t / cfg["temperature"]), (lambda t: t / cfg["temperature"]), change
    if kind == "lambda_over_rebound_local":
        temperature = 1.0

        def change(v):
            nonlocal temperature
            temperature = v
        return (lambda t: t / temperature), (lambda t: t / temperature), change
    if kind == "partial_keywords":
        a = functools.partial(F.leaky_relu, negative_slope=1.0)
        b = functools.partial(F.leaky_relu, negative_slope=1.0)

        def change(v):
            a.keywords["negative_slope"] = b.keywords["negative_slope"] = v
        return a, b, change
    if kind == "function_attribute":
        def fa(t):
            return t / fa.temperature

        def fb(t):
            return t / fb.temperature
        fa.temperature = fb.temperature = 1.0

        def change(v):
            fa.temperature = fb.temperature = v
        return fa, fb, change
    if kind == "callable_object":  # control
        a, b = _CallObj(), _CallObj()

        def change(v):
            a.temperature = b.temperature = v
        return a, b, change
    raise ValueError(kind)


def _run_post(kind):
    pa, pb, change = _post_case(kind)
    torch.manual_seed(0)
    ref = _Post(pb)
    torch.manual_seed(0)
    g = cg.graphify(_Post(pa))
    with torch.no_grad():
        for i in range(6):
            if i == 3:
                change(0.25)
            _eq(g(X[i]), ref(X[i]), f"{kind}: call {i}")
    return g


# F1 (fixed): a callable kept as a module attribute was held by identity; what it reads
# (non-tensor) replayed stale.


@pytest.mark.parametrize("kind", ["bound_method", "lambda_over_dict", "lambda_over_rebound_local",
                                  "partial_keywords", "function_attribute"])
def test_f1_callable_attribute_reads_stale(kind):
    _run_post(kind)


def test_f1_graphs_were_replayed_before_the_change():
    """The F1 twins replay a graph: one capture, replays; the change is seen (it was not: the
    call after it replayed the old graph), the call after it captures again."""
    pa, pb, change = _post_case("bound_method")
    torch.manual_seed(0)
    g = cg.graphify(_Post(pa))
    with torch.no_grad():
        for i in range(4):
            g(X[i])
        change(0.25)
        g(X[4])
    s = cg.stats(g)
    assert s.captures == 2 and s.replays == 3 and s.eager == 0, s


class _Weak(nn.Module):
    """A weak reference to a plain object (an owner, a schedule) kept as an attribute."""

    def __init__(self, obj, proxy):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.proxy = proxy
        self.owner = weakref.proxy(obj) if proxy else weakref.ref(obj)

    def forward(self, x):
        o = self.owner if self.proxy else self.owner()
        return self.lin(x) / o.temperature


@pytest.mark.parametrize("proxy", [False, True], ids=["weakref.ref", "weakref.proxy"])
def test_f1_weakref_attribute_reads_stale(proxy):
    a, b = _Sched(), _Sched()
    torch.manual_seed(0)
    ref = _Weak(b, proxy)
    torch.manual_seed(0)
    g = cg.graphify(_Weak(a, proxy))
    with torch.no_grad():
        for i in range(6):
            if i == 3:
                a.temperature = b.temperature = 0.25
            _eq(g(X[i]), ref(X[i]), f"call {i}")


class _Owner(nn.Module):
    def __init__(self):
        super().__init__()
        self.temperature = 1.0
        self.child = _Child(self)

    def forward(self, x):
        return self.child(x)


class _Child(nn.Module):
    def __init__(self, owner):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self._owner = weakref.ref(owner)

    def forward(self, x):
        return self.lin(x) / self._owner().temperature


def test_f1_control_weakref_to_a_module():
    torch.manual_seed(0)
    ref = _Owner()
    torch.manual_seed(0)
    o = _Owner()
    cg.graphify(o.child)
    with torch.no_grad():
        for i in range(6):
            if i == 3:
                o.temperature = ref.temperature = 0.25
            _eq(o(X[i]), ref(X[i]), f"call {i}")


def test_f1_control_callable_object_attribute():
    _run_post("callable_object")


def test_f1_control_object_attribute_method_called_through_it():
    a, b = _Sched(), _Sched()
    torch.manual_seed(0)
    ref = _Holds(b)
    torch.manual_seed(0)
    g = cg.graphify(_Holds(a))
    with torch.no_grad():
        for i in range(6):
            if i == 3:
                a.temperature = b.temperature = 0.25
            _eq(g(X[i]), ref(X[i]), f"call {i}")


def test_f1_control_graphed_partial_keywords():
    def f(x, scale=1.0):
        return x * scale
    p = functools.partial(f, scale=1.0)
    g = cg.graphify(p)
    for i in range(6):
        if i == 3:
            p.keywords["scale"] = 0.25
        _eq(g(X[i]), p(X[i]), f"call {i}")


def test_f1_control_callable_attribute_reading_a_tensor_is_refused():
    """A tensor the attribute's callable reads (closure, bound object) is refused: eager."""
    q = {"bias": torch.zeros(4)}
    torch.manual_seed(0)
    ref = _Post(lambda t: t + q["bias"])
    torch.manual_seed(0)
    g = cg.graphify(_Post(lambda t: t + q["bias"]))
    with torch.no_grad():
        for i in range(6):
            if i == 3:
                q["bias"] = torch.ones(4)
            _eq(g(X[i]), ref(X[i]), f"call {i}")


# -- F2: attributes read through self.__dict__ ------------------------------------------------

class _DictRead(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = 1.0
        self.how = how

    def forward(self, x):
        if self.how == "dict_get":
            s = self.__dict__.get("scale", 1.0)
        elif self.how == "vars":
            s = vars(self)["scale"]
        else:  # control
            s = getattr(self, "scale", 1.0)
        return self.lin(x) * s


def _run_dict_read(how):
    torch.manual_seed(0)
    ref = _DictRead(how)
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(6):
            if i == 3:
                g.scale = ref.scale = 0.25  # ordinary setattr
            _eq(g(X[i]), ref(X[i]), f"{how}: call {i}")
    return g


# F2 (fixed): a forward's reads through self.__dict__ were not recorded.
@pytest.mark.parametrize("how", ["dict_get", "vars"])
def test_f2_attribute_read_through_dict(how):
    _run_dict_read(how)


def test_f2_control_getattr():
    _run_dict_read("getattr")


# -- loud: ungraphify between a training forward and its backward ----------------------------

def test_loud_ungraphify_between_forward_and_backward():
    g, ref = _twins()
    for i in range(3):
        a = g(X[i])
        a.sum().backward()
    a = g(X[3])
    cg.ungraphify(g)
    with pytest.raises(cg.CudagraphifyError, match="released"):
        a.sum().backward()


# -- controls: lifecycle ----------------------------------------------------------------------

def test_control_ungraphify_regraphify_other_options():
    g, ref = _twins()
    _calls(g, ref)
    cg.ungraphify(g)
    _calls(g, ref, what="ungraphified")
    with torch.no_grad():
        g[0].weight.mul_(2)
        ref[0].weight.mul_(2)
    cg.graphify(g, max_graphs=2)
    _calls(g, ref, what="regraphified")
    with torch.no_grad():
        g[3].bias.add_(1)
        ref[3].bias.add_(1)
    _calls(g, ref, what="after a change")


def test_control_nested_graphify():
    ref = _mlp()
    g = copy.deepcopy(ref)
    cg.graphify(g[0])
    cg.graphify(g)
    _calls(g, ref)
    for m in (g, ref):
        m[0].weight = nn.Parameter(m[0].weight.detach() * 2)
    _calls(g, ref, what="inner parameter replaced")
    hs = [m[0].register_forward_hook(lambda mod, a, o: o * 3) for m in (g, ref)]
    _calls(g, ref, what="hook on inner")
    cg.ungraphify(g[0])
    _calls(g, ref, what="inner ungraphified")
    for h in hs:
        h.remove()
    cg.ungraphify(g)
    _calls(g, ref, what="both ungraphified")


def test_control_deepcopy_of_graphified_and_of_holder():
    g, ref = _twins()
    _calls(g, ref)
    g2, r2 = copy.deepcopy(g), copy.deepcopy(ref)
    with torch.no_grad():
        g2[0].weight.mul_(2)
        r2[0].weight.mul_(2)
    _calls(g2, r2, what="copy")
    _calls(g, ref, what="original")
    ref3 = _mlp()
    g3 = copy.deepcopy(ref3)
    cg.graphify(g3[2])
    _calls(g3, ref3)
    o, ro = copy.deepcopy(nn.Sequential(g3, nn.Tanh())), nn.Sequential(copy.deepcopy(ref3), nn.Tanh())
    with torch.no_grad():
        o[0][2][0].weight.mul_(3)
        ro[0][2][0].weight.mul_(3)
    _calls(o, ro, what="holder copy")
    _calls(g3, ref3, what="holder original")


def test_control_load_state_dict_copy_and_assign():
    g, ref = _twins()
    _calls(g, ref)
    sd = {k: v * 2 for k, v in ref.state_dict().items()}
    g.load_state_dict(sd, assign=True)
    ref.load_state_dict(sd, assign=True)
    _calls(g, ref, what="assign")
    sd = {k: v + 1 for k, v in ref.state_dict().items()}
    g.load_state_dict(sd)
    ref.load_state_dict(sd)
    _calls(g, ref, what="copy")


def test_control_reinit_dtype_roundtrip_and_param_replacement():
    g, ref = _twins()
    _calls(g, ref)

    def init(m):
        if isinstance(m, nn.Linear):
            torch.manual_seed(5)
            nn.init.xavier_uniform_(m.weight)
            nn.init.zeros_(m.bias)
    g.apply(init)
    ref.apply(init)
    _calls(g, ref, what="apply(init)")
    g.half()
    ref.half()
    _calls(g, ref, [x.half() for x in X[:2]], what="half")
    g.float()
    ref.float()
    _calls(g, ref, what="float again")
    v = torch.nn.utils.parameters_to_vector(ref.parameters()) * 2
    torch.nn.utils.vector_to_parameters(v.clone(), g.parameters())
    torch.nn.utils.vector_to_parameters(v.clone(), ref.parameters())
    _calls(g, ref, what="vector_to_parameters")
    w = torch.randn(4, 8)
    for m in (g, ref):
        m[0].weight = nn.Parameter(w.t())  # a strided parameter
    _calls(g, ref, what="strided parameter")


def test_control_functional_call():
    g, ref = _twins()
    _calls(g, ref)
    params = {k: v * 2 for k, v in ref.named_parameters()}
    with torch.no_grad():
        for i, x in enumerate(X[:3]):
            _eq(torch.func.functional_call(g, params, (x,)),
                torch.func.functional_call(ref, params, (x,)), f"functional_call {i}")
    _calls(g, ref, what="after functional_call")


def test_control_prune_lifecycle():
    g, ref = _twins()
    _calls(g, ref)
    for m in (g, ref):
        prune.l1_unstructured(m[0], "weight", amount=0.5)
    _calls(g, ref, what="pruned")
    with torch.no_grad():
        g[0].weight_orig.mul_(2)
        ref[0].weight_orig.mul_(2)
    _calls(g, ref, what="orig changed")
    for m in (g, ref):
        prune.remove(m[0], "weight")
    _calls(g, ref, what="removed")


def test_control_spectral_norm_training():
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.utils.spectral_norm(nn.Linear(4, 8)), nn.ReLU(), nn.Linear(8, 4))
    ref, g = make(), cg.graphify(make())
    for i in range(4):
        a, b = g(X[i]), ref(X[i])
        _eq(a, b, f"step {i}")
        a.sum().backward()
        b.sum().backward()
        for (n, p), q in zip(g.named_parameters(), ref.parameters()):
            _eq(p.grad, q.grad, f"step {i} {n}.grad")
        for (n, p), q in zip(g.named_buffers(), ref.buffers()):
            _eq(p, q, f"step {i} buffer {n}")


class _Block(nn.Module):
    def __init__(self, depth=0):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.child = _Block(depth - 1) if depth > 0 else None
        self.scale = 1.0

    def forward(self, x):
        y = self.lin(x).relu() * self.scale
        return self.child(y) if self.child is not None else y


class _SubBlock(_Block):
    def forward(self, x):
        return super().forward(x) * 2 + 1


def test_control_graphify_class_recursive_and_subclass():
    torch.manual_seed(0)
    refs = [_Block(2), _Block(0), _SubBlock(1)]
    cg.graphify(_Block)
    try:
        torch.manual_seed(0)
        gs = [_Block(2), _Block(0), _SubBlock(1)]
        with torch.no_grad():
            for _ in range(3):
                for g, r in zip(gs, refs):
                    _eq(g(X[0]), r(X[0]), type(g).__name__)
            gs[0].child.scale = refs[0].child.scale = 3.0
            gs[2].lin.weight.mul_(2)
            refs[2].lin.weight.mul_(2)
            c, rc = copy.deepcopy(gs[0]), copy.deepcopy(refs[0])
            c.child.lin.weight.mul_(-1)
            rc.child.lin.weight.mul_(-1)
            for _ in range(2):
                for g, r in zip(gs + [c], refs + [rc]):
                    _eq(g(X[1]), r(X[1]), "after changes")
    finally:
        cg.ungraphify(_Block)
    with torch.no_grad():
        for g, r in zip(gs, refs):
            _eq(g(X[2]), r(X[2]), "after ungraphify(class)")


def test_control_sizes_beyond_max_graphs_with_weight_updates():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    g = cg.graphify(copy.deepcopy(ref), max_graphs=2)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for i, n in enumerate([1, 2, 3, 1, 4, 2, 5, 1, 3] * 2):
            x = torch.randn(n, 4, generator=gen)
            _eq(g(x), ref(x), f"call {i} n={n}")
            if i % 3 == 2:
                g[0].weight.add_(0.5)
                ref[0].weight.add_(0.5)
            if i % 5 == 4:
                w = torch.randn(4, 8, generator=gen)
                g[2].weight = nn.Parameter(w.clone())
                ref[2].weight = nn.Parameter(w.clone())


# -- controls: hooks --------------------------------------------------------------------------

class _Counter:
    def __init__(self):
        self.n = 0

    def post(self, m, args, out):
        self.n += 1
        return out + self.n

    def pre(self, m, args):
        self.n += 1
        return (args[0] * (1 + self.n / 10),)


@pytest.mark.parametrize("where", [(), (0,), (2, 0)], ids=["root", "child", "grandchild"])
@pytest.mark.parametrize("kind", ["post", "pre"])
@pytest.mark.parametrize("when", [0, 2])
def test_control_hook_values_and_counts(where, kind, when):
    g, ref = _twins()
    cgc, crc = _Counter(), _Counter()

    def pick(m):
        for k in where:
            m = m[k]
        return m
    with torch.no_grad():
        for i, x in enumerate(X[:6]):
            if i == when:
                for m, c in ((g, cgc), (ref, crc)):
                    reg = pick(m).register_forward_hook if kind == "post" \
                        else pick(m).register_forward_pre_hook
                    reg(getattr(c, kind))
            _eq(g(x), ref(x), f"call {i}")
            assert cgc.n == crc.n, (i, cgc.n, crc.n)


def test_control_root_hook_variants_after_capture():
    g, ref = _twins()
    _calls(g, ref)
    state = {"k": 1.0}

    def pre(m, args, kwargs):
        return (args[0] * state["k"],), kwargs

    def post(m, args, out):
        out.add_(state["k"])

    def post2(m, args, kwargs, out):
        return out * 2
    hs = []
    for m in (g, ref):
        hs.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        hs.append(m.register_forward_hook(post, always_call=True))
        hs.append(m.register_forward_hook(post2, with_kwargs=True, prepend=True))
    _calls(g, ref, what="hooks")
    state["k"] = 3.0
    _calls(g, ref, what="closure changed")
    for h in hs:
        h.remove()
    _calls(g, ref, what="removed")


@pytest.mark.parametrize("where", [(0,), (2,), (2, 0)])
def test_control_feature_hook_toggled_with_weight_changes(where):
    g, ref = _twins()

    def pick(m):
        for k in where:
            m = m[k]
        return m
    with torch.no_grad():
        for i, x in enumerate(X[:8]):
            kg, kr = [], []
            if i % 2 == 0:
                hs = [pick(g).register_forward_hook(lambda m, a, o: kg.append(o)),
                      pick(ref).register_forward_hook(lambda m, a, o: kr.append(o))]
            a, b = g(x), ref(x)
            if i % 2 == 0:
                for h in hs:
                    h.remove()
                _eq(kg[0], kr[0], f"feature {i}")
            _eq(a, b, f"call {i}")
            g[0].weight.add_(0.1)
            ref[0].weight.add_(0.1)


def test_control_global_hooks():
    g, ref = _twins()
    _calls(g, ref)
    cnt, cur = {"g": 0, "r": 0}, {"k": "g"}

    def hook(m, args, out):
        if isinstance(m, nn.Tanh):
            cnt[cur["k"]] += 1
            return out + cnt[cur["k"]]
    with torch.no_grad():
        for i, x in enumerate(X[:5]):
            h = _M.register_module_forward_hook(hook) if i >= 2 else None
            try:
                cur["k"] = "g"
                a = g(x)
                cur["k"] = "r"
                b = ref(x)
            finally:
                if h is not None:
                    h.remove()
            _eq(a, b, f"call {i}")
            assert cnt["g"] == cnt["r"], (i, cnt)


def test_control_backward_hooks_and_optimizer_in_backward():
    g, ref = _twins()
    state = {"k": 1.0}

    def bh(m, gin, gout):
        return (gin[0] * state["k"],)

    def attach(m):
        opts = {p: torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in m.parameters()}

        def hook(p):
            opts[p].step()
            opts[p].zero_grad()
        for p in m.parameters():
            p.register_post_accumulate_grad_hook(hook)
    for i, x in enumerate(X[:5]):
        if i == 1:
            g[3].register_full_backward_hook(bh)
            ref[3].register_full_backward_hook(bh)
        if i == 2:
            state["k"] = 0.5
            attach(g)
            attach(ref)
        a, b = g(x), ref(x)
        _eq(a, b, f"step {i}")
        a.square().sum().backward()
        b.square().sum().backward()
        for p, q in zip(g.parameters(), ref.parameters()):
            _eq(p, q, f"step {i} parameter")
            assert (p.grad is None) == (q.grad is None)
            if q.grad is not None:
                _eq(p.grad, q.grad, f"step {i} grad")


class _Hidden(nn.Module):
    def __init__(self, shared):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.shared = [shared]  # not registered

    def forward(self, x):
        return self.shared[0](self.lin(x))


def test_control_unregistered_module_param_replaced_and_hooked():
    torch.manual_seed(0)
    s = nn.Linear(4, 4)
    ref = _Hidden(s)
    s2 = copy.deepcopy(s)
    g = _Hidden(s2)
    g.load_state_dict(ref.state_dict())
    cg.graphify(g)
    _calls(g, ref)
    w = torch.randn(4, 4)
    s2.weight, s.weight = nn.Parameter(w.clone()), nn.Parameter(w.clone())
    _calls(g, ref, what="parameter replaced")
    for m in (s, s2):
        m.register_forward_hook(lambda mod, a, o: o * 3)
    _calls(g, ref, what="hooked")


@pytest.mark.parametrize("inner_graphified", [False, True])
def test_control_function_over_module_changes(inner_graphified):
    ref = _mlp()
    m = copy.deepcopy(ref)
    if inner_graphified:
        cg.graphify(m)
    g = cg.graphify(lambda x: m(x).softmax(-1))
    st = {"k": 1.0}
    with torch.no_grad():
        for i in range(7):
            _eq(g(X[i]), ref(X[i]).softmax(-1), f"call {i}")
            if i == 1:
                for mm in (m, ref):
                    mm[2][0].register_forward_hook(lambda mod, a, o: o * st["k"])
            if i == 2:
                st["k"] = 3.0
            if i == 3:
                for mm in (m, ref):
                    mm[3].weight = nn.Parameter(mm[3].weight * 2)
            if i == 4:
                for mm in (m, ref):
                    mm[2][1] = nn.Sigmoid()


def test_control_two_graphified_modules_share_a_parameter():
    torch.manual_seed(0)
    emb = nn.Linear(4, 4)
    ref = nn.ModuleList([nn.Sequential(emb, nn.ReLU()), nn.Sequential(emb, nn.Tanh())])
    got = copy.deepcopy(ref)
    ge, gd = cg.graphify(got[0]), cg.graphify(got[1])
    og = torch.optim.SGD(got.parameters(), lr=0.1, momentum=0.9)
    orr = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for i in range(4):
        for micro in range(2):
            x = X[i + micro]
            lg = ge(x).square().sum() + gd(x * 2).sum()
            lr = ref[0](x).square().sum() + ref[1](x * 2).sum()
            _eq(lg, lr, f"loss {i}")
            lg.backward()
            lr.backward()
        torch.nn.utils.clip_grad_norm_(got.parameters(), 0.5)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        for p, q in zip(got.parameters(), ref.parameters()):
            _eq(p.grad, q.grad, f"grad {i}")
        og.step()
        orr.step()
        og.zero_grad(set_to_none=(i % 2 == 0))
        orr.zero_grad(set_to_none=(i % 2 == 0))


# -- controls: functions and calls --------------------------------------------------------------

_GT = torch.randn(4)


def test_control_function_signatures_closures_globals():
    global _GT
    b = torch.randn(4)

    def f(x, bias=b, *, s=2.0):
        return x * s + bias
    g = cg.graphify(f)
    for x in X[:3]:
        _eq(g(x), f(x), "defaults")
    b.add_(1)
    _eq(g(X[0]), f(X[0]), "default tensor changed in place")
    _eq(g(X[0], s=3.0), f(X[0], s=3.0), "keyword-only")
    lst = [torch.randn(4)]

    def h(x):
        for t in lst:
            x = x + t
        return x + _GT
    gh = cg.graphify(h)
    for x in X[:3]:
        _eq(gh(x), h(x), "closure list")
    lst.append(torch.randn(4))
    _eq(gh(X[0]), h(X[0]), "appended")
    _GT = torch.randn(4)
    _eq(gh(X[0]), h(X[0]), "global rebound")


def test_control_graphify_bound_method():
    class Enc(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.scale = 1.0

        def encode(self, x):
            return (self.lin(x) * self.scale).relu()
    torch.manual_seed(0)
    ref = Enc()
    m = copy.deepcopy(ref)
    g = cg.graphify(m.encode)
    with torch.no_grad():
        for x in X[:3]:
            _eq(g(x), ref.encode(x), "encode")
        m.scale = ref.scale = 2.0
        _eq(g(X[0]), ref.encode(X[0]), "scale")
        m.lin = nn.Linear(4, 4)
        ref.lin = copy.deepcopy(m.lin)
        _eq(g(X[0]), ref.encode(X[0]), "submodule replaced")


def test_control_outputs_mutated_and_kept():
    class DictOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            return {"logits": h, "aux": [h.sum(), {"n": 3}], "view": h[0]}
    torch.manual_seed(0)
    ref = DictOut()
    g = cg.graphify(copy.deepcopy(ref))
    kept = []
    with torch.no_grad():
        for i, x in enumerate(X[:5]):
            a, b = g(x), ref(x)
            _eq(a["logits"], b["logits"], f"call {i}")
            assert a["aux"][1] == b["aux"][1] and len(a["aux"]) == len(b["aux"]), i
            for o in (a, b):
                o["logits"].mul_(2)
                o["aux"].append(7)
                o["aux"][1]["n"] += 1
            _eq(a["view"], b["view"], f"view after in-place {i}")
            kept.append((a, b))
    for a, b in kept:
        _eq(a["logits"], b["logits"], "kept")


def test_control_same_tensor_as_two_arguments():
    def f(a, b):
        a.add_(1)
        return a * b
    g = cg.graphify(f)
    for x in X[:3]:
        a, b = x.clone(), x.clone() + 1
        a2, b2 = a.clone(), b.clone()
        _eq(g(a, b), f(a2, b2), "distinct")
        _eq(a, a2, "argument")
    for x in X[:3]:
        a = x.clone()
        a2 = a.clone()
        _eq(g(a, a), f(a2, a2), "same tensor twice")
        _eq(a, a2, "argument")
    gc.collect()
