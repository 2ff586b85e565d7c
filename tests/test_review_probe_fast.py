"""Review of 090dc87 (the probe's per-op path made cheaper): equivalence with its parent.

``ParentProbe`` carries the parent's ``record``, ``note_layouts`` and ``note_tensors``
verbatim (f5c9591); each scenario runs once under it (the mode's slow path: a subclass's
record) and once under the new ``Probe`` (the mode's inlined fast path), and every recorded
field is compared. The three divergences found (a patched record or untagged_call bypassed, a
meta or non-strided tensor's storage read before its layout check) are fixed in the commit after;
their tests are plain tests now.
"""

from __future__ import annotations

import collections
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from cudagraphify import _policy
from cudagraphify import _probe
from cudagraphify._policy import OpPolicy, _on_device, op_name, torch_op_tags
from cudagraphify._probe import Finding, Probe
from cudagraphify._signature import storage_of
from cudagraphify._writes import _swap_logs, holder, layout


# (compiled as if in cudagraphify's own file: the findings' user frame skips it, as the
# parent's own record was skipped)
_PARENT = '''
class ParentProbe(Probe):
    # the parent's (f5c9591) record, note_layouts and note_tensors, verbatim

    def record(self, func, args, kwargs, name=None):
        if name is None:
            name = op_name(func)
        seq = self._seq
        if seq is None:
            seq = self._seq = self.sequences[self.path]
        seq.append(name)
        if self._plain:
            if self.policy.untagged_call(func, kwargs):
                return
            tags = self.policy.tags(func, args, kwargs, accel=self.accel)
        else:
            key = None
            if self.thunder:
                key = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor)
                            else repr(a) for a in args)
            tags = self.policy.tags(func, args, kwargs, accel=self.accel,
                                    thunder=self.thunder, thunder_key=key)
        if not self.policy.can_graph(func, tags):
            self.findings.append(Finding.at_caller(self.path, name, tuple(sorted(tags))))

    def note_layouts(self, args, kwargs):
        layouts, produced, known = self.layouts, self.produced, self.known or ()
        swapped = bool(_swap_logs)
        for value in (*args, *kwargs.values()) if kwargs else args:
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if not isinstance(t, torch.Tensor):
                    continue
                h = holder(t) if swapped else t
                if id(h) not in layouts \
                        and t.layout is torch.strided and t.device.type != "meta":
                    ptr = storage_of(t)
                    if ptr and ptr not in produced and ptr not in known:
                        lay = layout(t)
                        if lay is not None:
                            layouts[id(h)] = (h, lay, None if t.is_inference()
                                              else t._version)

    def note_tensors(self, func, args, kwargs, out):
        produced, known, outside = self.produced, self.known, self.outside
        inputs = set()
        for value in (*args, *kwargs.values()) if kwargs else args:
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor):
                    inputs.add(id(t))
                    ptr = storage_of(t)
                    if ptr and ptr not in produced and ptr not in known and ptr not in outside:
                        self._read(func, t, ptr)
        for value in (out if isinstance(out, (list, tuple)) else (out,)):
            if isinstance(value, torch.Tensor):
                ptr = storage_of(value)
                if id(value) in inputs:
                    continue
                if self.written is not None:
                    self.made.add(id(value))
                if ptr and ptr not in known and ptr not in outside:
                    produced.add(ptr)
                elif not ptr and not value._is_view():
                    self.made_empty.add(id(value))
'''
_ns = dict(Probe=Probe, Finding=Finding, op_name=op_name, torch=torch, storage_of=storage_of,
           _swap_logs=_swap_logs, holder=holder, layout=layout)
exec(compile(_PARENT, _probe.__file__, "exec"), _ns)
ParentProbe = _ns["ParentProbe"]


# --- scenarios: (root, fn, env); env's "arg*" tensors are ``known``, the others outside ---

@torch.library.custom_op("review_pf::addto", mutates_args=("dst",))
def _addto(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.add_(src)


@torch.library.custom_op("review_pf::pair", mutates_args=())
def _pair(x: torch.Tensor) -> list[torch.Tensor]:
    return [x + 1, x.clone()]


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("buf", torch.zeros(4))

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # __bool__: a sync
            y = y + 1
        self.buf.add_(1)
        return F.relu(y)


def _model():
    m = nn.Sequential(_Block(), _Block(), nn.Dropout(0.1))
    x = torch.randn(3, 4)
    env = {"arg_x": x, **{f"p{n}": p for n, p in m.named_parameters()},
           **{f"b{n}": b for n, b in m.named_buffers()}}
    return m, lambda: (m(x), None)[1], env


def _ops():
    m = nn.Linear(4, 4)
    x, g, c = torch.randn(3, 4), torch.randn(4), torch.empty(3, 4)
    gl = [torch.randn(2), torch.randn(2)]
    e = torch.empty(0)
    with torch.inference_mode():
        inf = torch.ones(3)
    me = torch.empty(2, device="meta")
    sp = torch.randn(3, 3).to_sparse()
    env = {"arg_x": x, "g": g, "c": c, "gl0": gl[0], "gl1": gl[1], "e": e, "inf": inf,
           "pw": m.weight, "pb": m.bias, "me": me, "sp": sp}
    gen = torch.Generator().manual_seed(1)
    steps = [
        lambda: m(x), lambda: x.add_(1), lambda: torch.add(x, g, out=c), lambda: g[0].mul_(2),
        lambda: x.data.mul_(1), lambda: (x.shape, x.dtype, x.T), lambda: torch.cat(gl),
        lambda: torch.cat(tensors=(gl[0], gl[1])), lambda: torch.stack([gl[0], x[0, :2]], 0),
        lambda: torch.split(x, 2, dim=1), lambda: torch.chunk(x, 2), lambda: x.max(dim=1),
        lambda: x.tolist(), lambda: x.sum().item(), lambda: torch.empty(0).resize_(4),
        lambda: e.view(0), lambda: torch.ones(2, pin_memory=False), lambda: torch.ones(2, **{}),
        lambda: torch.rand(2, generator=gen), lambda: torch.randn(2),
        lambda: F.dropout(x, 0.5, training=True), lambda: torch.nonzero(x),
        lambda: x[x > 0], lambda: torch.where(x > 0), lambda: x.__setitem__(0, 3.0),
        lambda: x.unsqueeze_(0).squeeze_(0), lambda: inf + 1, lambda: me + 1,
        lambda: me.add_(1), lambda: torch.sparse.mm(sp, torch.ones(3, 2)),
        lambda: torch.ops.review_pf.addto(c, x), lambda: torch.ops.review_pf.pair(g),
        lambda: torch.ops.aten.add.Tensor(x, 1), lambda: x.to("cpu"), lambda: x.cpu(),
        lambda: e.resize_(2), lambda: x.detach(), lambda: x.grad_fn,
        lambda: torch.repeat_interleave(g, torch.tensor([1, 2, 1, 0])),
    ]

    def fn():
        errors = []
        for step in steps:
            try:
                step()
            except Exception as err:  # noqa: BLE001 - compared between the two probes
                errors.append(type(err).__name__)
        return errors
    return m, fn, env


def _swap():
    a = nn.Linear(3, 3)
    x, w2 = torch.randn(2, 3), torch.randn(3, 3)

    def fn():
        a(x)
        x.data = torch.randn(2, 3)
        a.weight.data = w2
        a(x)
    return a, fn, {"arg_x": x, "w": a.weight, "w2": w2}


def _refuse_relu():
    class Refuse(OpPolicy):
        def can_graph(self, func, tags):
            return func is not torch.relu and super().can_graph(func, tags)
    return Refuse()


def _tagged():
    p = OpPolicy()
    p.tag_op(torch.relu, "HOST_SYNC")
    p.tag_op(torch.Tensor.add_, "HOST_SYNC")
    p.mark_safe(torch.nonzero)
    return p


class _Keep(TorchFunctionMode):
    """Every op's result kept alive (ids in ``made`` are not reused within a run)."""

    def __init__(self):
        super().__init__()
        self.kept = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.kept.append(out)
        return out


def _run(cls, scenario, policy, accel, thunder, tracked):
    torch.manual_seed(0)
    root, fn, env = scenario()
    probe = cls(root, policy(), accel=accel, thunder=thunder)
    if tracked:
        probe.known = {storage_of(v) for k, v in env.items() if k.startswith("arg")} - {0}
        probe.written, probe.layouts, probe.versions = set(), {}, {}
    with _Keep(), probe:
        result = fn()
    ptrs, ids = {}, {}
    for k, v in env.items():
        if storage_of(v):
            ptrs.setdefault(storage_of(v), k)
        ids[id(v)] = k
    P = lambda p: ptrs.get(p, "new" if p else 0)  # noqa: E731
    I = lambda i: ids.get(i, "new")  # noqa: E731
    bag = lambda it: sorted(collections.Counter(it).items(), key=repr)  # noqa: E731
    out = {
        "result": result, "seq": dict(probe.sequences), "called": probe.called,
        "findings": [(f.path, str(f)) for f in probe.findings],
        "outside": bag((P(k), str(v)) for k, v in probe.outside.items()),
        "produced": bag(map(P, probe.produced)), "written": bag(map(P, probe.written or ())),
        "wbm": bag(map(P, probe.written_before_made)), "made": bag(map(I, probe.made)),
        "made_empty": len(probe.made_empty), "relaid": bag(map(P, probe.relaid)),
        "grad_on": probe.grad_on, "first_memory": [str(f) for f in probe.first_memory],
    }
    if tracked:
        out["layouts"] = bag((I(i), I(id(h)), P(lay[0].st.data_ptr()), lay[1:], v)
                             for i, (h, lay, v) in probe.layouts.items())
        out["versions"] = bag((I(i), v) for i, (h, v) in probe.versions.items())
    return out


POLICIES = {"default": OpPolicy, "refuse": _refuse_relu, "tagged": _tagged}


@pytest.mark.parametrize("scenario", [_model, _ops, _swap], ids=["model", "ops", "swap"])
@pytest.mark.parametrize("policy", list(POLICIES.values()), ids=list(POLICIES))
@pytest.mark.parametrize("accel", [frozenset({"cuda"}), frozenset({"cpu"})], ids=["cuda", "cpu"])
@pytest.mark.parametrize("tracked", [False, True], ids=["plain", "tracked"])
def test_probe_records_what_the_parent_recorded(scenario, policy, accel, tracked):
    new = _run(Probe, scenario, policy, accel, False, tracked)
    old = _run(ParentProbe, scenario, policy, accel, False, tracked)
    assert new == old
    if scenario is _ops and tracked:  # (the scenario reaches every field)
        assert new["findings"] and new["outside"] and new["layouts"] and new["made_empty"]


def test_thunder_probe_records_what_the_parent_recorded():
    assert _run(Probe, _model, OpPolicy, frozenset({"cpu"}), True, True) \
        == _run(ParentProbe, _model, OpPolicy, frozenset({"cpu"}), True, True)


def test_fast_path_only_for_the_default_record_and_policy():
    class Untagged(OpPolicy):
        def untagged_call(self, func, kwargs):
            return False

    assert Probe(None, OpPolicy())._fast
    assert not Probe(None, OpPolicy(), thunder=True)._fast
    assert not ParentProbe(None, OpPolicy())._fast
    assert not Probe(None, Untagged())._fast
    assert not Probe(None, _refuse_relu())._fast


def test_fast_path_screens_exactly_the_calls_record_screens():
    """The inlined condition against ``OpPolicy.untagged_call`` (record's): the fast path sends
    to ``_screen`` exactly the calls record does (overrides, generator=, pin_memory=, kwargs
    given empty or not at all)."""
    def ops(x, gen):
        torch.relu(x), x.add_(1), torch.nonzero(x), torch.ones(2, pin_memory=False)
        torch.ones(2, **{}), torch.rand(2, generator=gen), torch.rand(2, generator=None)
        x.sum(dim=0), x.sum().item(), torch.where(x > 0), x.cpu(), torch.zeros(2, dtype=None)
        torch.cat([x, x]), torch.cat(tensors=[x]), x.shape, x.data, torch.randn(2)

    def screened(slow):
        names = []

        class Spy(Probe):
            def _screen(self, func, args, kwargs, name):
                names.append(name)
                super()._screen(func, args, kwargs, name)

        class SlowSpy(Spy):
            def record(self, func, args, kwargs, name=None):
                super().record(func, args, kwargs, name)

        probe = (SlowSpy if slow else Spy)(None, _tagged(), accel=frozenset({"cpu"}))
        assert probe._fast is not slow
        with probe:
            ops(torch.randn(3), torch.Generator().manual_seed(0))
        return names, probe.sequences, [str(f) for f in probe.findings]

    fast, slow = screened(False), screened(True)
    assert fast == slow
    assert "Tensor.add_" in fast[0] and "torch.nonzero" in fast[0] and "torch.ones" in fast[0]
    assert "torch.cat" not in fast[0]


def test_own_code_cache_survives_reused_code_ids():
    """Code objects made and dropped in turn (ids reused): one whose file is cudagraphify's is
    never recorded, one of the user's always is."""
    own_name = _probe.__file__.replace("_probe.py", "_review_exec.py")
    x = torch.ones(2)
    for i in range(40):
        filename = own_name if i % 2 else "<user-code>"
        ns = {}
        exec(compile("def f(x):\n    return x.neg()\n", filename, "exec"), ns)
        probe = Probe(None, OpPolicy())
        with probe:
            ns["f"](x)
        assert probe.sequences.get("", []) == ([] if i % 2 else ["Tensor.neg"])
        del ns


def test_device_caches_match_uncached_answers():
    tensors = [torch.ones(1), torch.empty(1, device="meta"), torch.ones(1).to_sparse(), 3, None]
    for accel in (frozenset({"cuda"}), frozenset({"cpu"}), frozenset({"meta", "cpu"})):
        for t in tensors:
            assert _on_device(t, accel) == (isinstance(t, torch.Tensor)
                                            and t.device.type in accel)
    for func in (torch.nonzero, torch.Tensor.item, torch.rand, torch.Tensor.add, torch.unique,
                 torch.masked_select, torch.Tensor.nonzero, F.dropout, "torch.cuda.synchronize"):
        assert _policy._device_tags(func) == torch_op_tags(func) - {"RNG"}
        assert _policy._device_tags(func) is _policy._device_tags(func)


def test_probes_on_threads_at_once():
    def work():
        x = torch.randn(8)
        probe = Probe(None, OpPolicy(), accel=frozenset({"cpu"}))
        with probe:
            for _ in range(100):
                x = (x * 2).relu_()
                torch.nonzero(x)
        return dict(probe.sequences), [str(f).split(" at ")[0] for f in probe.findings]

    want = work()
    got, errors = [], []

    def run():
        try:
            got.append(work())
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and got == [want] * 4
    assert len(want[1]) == 100


# --- divergences ---

def test_a_patched_probe_record_still_sees_the_ops(monkeypatch):
    seen = []
    original = Probe.record

    def spy(self, func, args, kwargs, name=None):
        seen.append(name)
        return original(self, func, args, kwargs, name)

    monkeypatch.setattr(Probe, "record", spy)
    with Probe(None, OpPolicy()):
        torch.ones(2).neg()
    assert seen == ["torch.ones", "Tensor.neg"]  # (the parent called record for each op)


def test_a_patched_untagged_call_is_asked(monkeypatch):
    asked = []

    def untagged_call(self, func, kwargs):
        asked.append(func)
        return False  # (screen everything)

    monkeypatch.setattr(OpPolicy, "untagged_call", untagged_call)
    with Probe(None, OpPolicy()):
        torch.ones(2).neg()
    assert torch.Tensor.neg in asked


def test_meta_subclass_storage_is_not_read():
    class Partial(torch.Tensor):  # handles what it knows, a KeyError for the rest
        HANDLED = {torch.Tensor.add, torch.Tensor.layout.__get__, torch.Tensor.device.__get__}

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func not in cls.HANDLED and getattr(func, "__name__", "") != "__get__":
                raise KeyError(func)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))

    me = torch.empty(2, device="meta").as_subclass(Partial)
    probe = Probe(None, OpPolicy())
    probe.layouts = {}
    with probe:
        me.add(1)  # the parent: no error, no layout noted (a meta tensor)
    assert probe.layouts == {}
