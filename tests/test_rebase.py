"""Families of static-state graphs (see cudagraphify/_rebase.py) on a CPU.

Through share_graph's graph-reading test double (tests/test_share_engine.py): a "capture"
records the aten ops, a "retargeted graph" re-runs that record with the patched addresses
pointing at the tensors that live there. A plan that missed a cache address would read and
write the template's cache, and the comparisons with an eager twin (torch.equal, outputs and
caches) would fail.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import cudagraphify as cg
from cudagraphify import _cugraph, _rebase, _state
from test_review_static_state import Cache, Net, StaticLayer, _step
from test_share_engine import _allocated, _FakeExec, _tensors, reading  # noqa: F401 (a fixture)


class _Exec(_FakeExec):
    """The double's rebased graph, run as a CUDA graph runs: no autograd (the double re-runs
    its recorded ops under the caller's grad mode)."""

    def launch(self, stream) -> None:
        with torch.no_grad():
            super().launch(stream)


@pytest.fixture
def fam(reading, monkeypatch):  # noqa: F811 (the fixture imported above)
    monkeypatch.setattr(_rebase, "memory_ranges", lambda pool: (list(_allocated),
                                                                  list(_allocated)))
    layout = _state.state_layout

    def registering(values):  # the double finds a patched address's tensor by its address
        for t in _rebase._tensors(values):
            _tensors[t.data_ptr()] = t
        return layout(values)

    monkeypatch.setattr(_state, "state_layout", registering)
    monkeypatch.setattr(_cugraph, "RetargetedExec", _Exec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            yield reading


def _cache(n: int = 2, max_len: int = 6) -> Cache:
    return Cache([StaticLayer(max_len) for _ in range(n)])


def _register(cache: Cache) -> None:
    for layer in cache.layers:
        if layer.keys is not None:
            _tensors[layer.keys.data_ptr()] = layer.keys


def _generate(ref, g, steps: int = 3, **kw):
    """One sequence with a new pair of caches (as generate(cache_implementation="static")
    makes one per call): the first step sets the caches up (allocates their tensors)."""
    rc, c = _cache(**kw), _cache(**kw)
    for t in range(steps):
        _step(ref, g, rc, c, t)
        _register(c)
    return rc, c


def _pair(cls=Net, **kw):
    torch.manual_seed(0)
    ref = cls()
    return ref, cg.graphify(copy.deepcopy(ref), **kw)


def test_new_caches_are_rebased_not_captured(fam):
    ref, g = _pair()
    kept = [_generate(ref, g) for _ in range(5)]  # (kept alive: distinct addresses)
    s = cg.stats(g)
    # the template, the second cache's capture (diffed); the other three rebased
    assert (s.captures, s.retargets) == (2, 3), (s.captures, s.retargets, s.eager_calls)
    assert s.replays >= 5
    del kept


def test_caches_that_die_between_generates(fam, monkeypatch):
    """The usual case: each generate's cache is dropped before the next one is made. A dead
    cache's rebased graph is kept (two per family) and rewritten for the next cache."""
    made = []

    class Counted(_cugraph.RetargetedExec):  # (the test double)
        def __init__(self, *a, **kw):
            made.append(self)
            super().__init__(*a, **kw)

    monkeypatch.setattr(_cugraph, "RetargetedExec", Counted)
    ref, g = _pair()
    for _ in range(6):
        _generate(ref, g)
    s = cg.stats(g)
    assert (s.captures, s.retargets) == (2, 4), (s.captures, s.retargets)
    assert len({id(e) for e in made}) == 1  # the others rewrote the previous (dead) one
    (family,) = g._cudagraphify_state.families._families.values()
    del _  # the last cache dies: its graph is kept for the next one
    _generate(ref, g, steps=1)  # (a set-up call releases it)
    assert len(family.spare) == 1
    g._cudagraphify_state.release()
    assert family.spare == [] and family.raw is None


def test_a_cache_of_another_layout_founds_its_own_family(fam):
    ref, g = _pair()
    _generate(ref, g)
    _generate(ref, g, max_len=8)
    _generate(ref, g)  # the first family's second cache: diffed
    _generate(ref, g, max_len=8)
    _generate(ref, g)
    _generate(ref, g, max_len=8)
    s = cg.stats(g)
    assert (s.captures, s.retargets) == (4, 2), (s.captures, s.retargets)
    assert len(g._cudagraphify_state.families) == 2


def test_captures_that_differ_beyond_addresses_refuse_the_family(fam):
    """A forward that bakes a value the layout does not show (here: which cache it got, by
    identity) into its kernels: the diff finds a differing scalar; every cache is captured."""

    serial: dict[int, int] = {}  # (the caches are kept alive: their ids are distinct)

    class ByIdentity(Net):
        def forward(self, x, cache, pos):
            return super().forward(x, cache, pos) + serial.setdefault(id(cache), len(serial))

    ref, g = _pair(ByIdentity)
    kept = []
    for _ in range(4):
        rc, c = _cache(), _cache()
        kept.append(c)
        for t in range(3):
            x, p = torch.randn(1, 1, 16), torch.tensor([t])
            want = Net.forward(ref, x, rc, p) + serial.get(id(c), len(serial))  # g's result
            assert torch.equal(g(x, c, p), want)
            _register(c)
    s = cg.stats(g)
    assert s.retargets == 0 and s.captures == 4, (s.captures, s.retargets)
    (family,) = g._cudagraphify_state.families._families.values()
    # the scalar is not a device address: unproven, then disproven against eager on copies
    assert family.reason and "does not equal" in family.reason, family.reason


_calls = [0]


def test_unproven_bytes_proven_against_eager_on_copies(fam):
    """Bytes that differ between the two captures and hold no address (here a scalar that
    changes on every call but multiplies a zero) are proven harmless once, on copies of the
    cache: later caches are rebased, and their results are eager's."""

    class Noisy(Net):
        def forward(self, x, cache, pos):
            _calls[0] += 1
            out = super().forward(x, cache, pos)
            return out + out * 0.0 * float(_calls[0] % 5 + 1)

    ref, g = _pair(Noisy)
    for _ in range(4):
        _generate(ref, g)
    s = cg.stats(g)
    (family,) = g._cudagraphify_state.families._families.values()
    assert family.reason is None and family.plan.unproven > 0
    assert (s.captures, s.retargets) == (2, 2), (s.captures, s.retargets, family.reason)


def test_a_module_attribute_changed_after_the_template_is_not_rebased(fam):
    class Scaled(Net):
        def __init__(self):
            super().__init__()
            self.scale = 1.0

        def forward(self, x, cache, pos):
            return super().forward(x, cache, pos) * self.scale

    ref, g = _pair(Scaled)
    _generate(ref, g)
    _generate(ref, g)  # diffed: the family has its plan
    for m in (ref, g):
        m.scale = 0.5
    _generate(ref, g)  # the template read scale=1.0: captured, not rebased
    s = cg.stats(g)
    assert s.retargets == 0 and s.captures == 3, (s.captures, s.retargets)
    for m in (ref, g):
        m.scale = 1.0
    _generate(ref, g)  # the template's reads hold again
    assert cg.stats(g).retargets == 1


def test_no_families_without_copied_outputs(fam):
    ref, g = _pair(copy_outputs=False)
    for _ in range(3):
        _generate(ref, g)
    assert cg.stats(g).retargets == 0
    assert len(g._cudagraphify_state.families) == 0


def test_release_drops_the_templates(fam):
    ref, g = _pair()
    for _ in range(3):
        _generate(ref, g)
    state = g._cudagraphify_state
    (family,) = state.families._families.values()
    state.release()
    assert len(state.families) == 0 and family.raw is None
    _generate(ref, g)  # starts a family anew
    assert len(state.families) == 1


class _Named:
    """A raw graph whose driver handle is its name (what the faked read_graph looks up)."""

    def __init__(self, name):
        self.name = name

    def cuda_graph(self):
        return self.name


def test_a_stale_address_in_a_struct_tail_is_unproven_not_refused(monkeypatch):
    """A differing 8-byte value that lies in device memory but in none of the memory the
    forward may read (states, pool, parameters, static inputs, attribute tensors) is a stale
    address left in a kernel argument struct's uninitialised tail (seen on the H200): kept as
    the template has it and counted unproven (the family then proves itself against eager).
    One inside memory the forward reads still refuses."""
    from test_share import A, B, POOL, _k, _w

    param = (0xC00000, 0x1000)  # a parameter: memory the forward reads

    class Param:  # (what diff asks of a tensor it may read)
        def untyped_storage(self):
            return self

        def data_ptr(self):
            return param[0]

        def nbytes(self):
            return param[1]

    elsewhere = (0xB00000, 0x100000)  # device memory no tensor of the forward lies in
    device = POOL + list(A.ranges) + list(B.ranges) + [param, elsewhere]
    monkeypatch.setattr(_rebase, "memory_ranges", lambda pool: (POOL, device))

    def diffed(template_value: int, other_value: int, legit):
        nodes = {"t": [_k("neg", _w(0x10000 + 8, template_value))],
                 "o": [_k("neg", _w(0x50000 + 8, other_value))]}
        monkeypatch.setattr(_cugraph, "read_graph", lambda handle: (nodes[handle], frozenset()))

        family = _rebase.Family(_Named("t"), None, None, A, None, None)
        _rebase.diff(family, _Named("o"), B, None, legit)
        return family

    stale = diffed(0xB00100, 0xB08200, [Param()])
    assert stale.plan is not None and (stale.plan.count, stale.plan.unproven) == (1, 1)
    assert stale.failures == []
    # without the readable memory (all device memory counts): refused, as before
    assert diffed(0xB00100, 0xB08200, None).plan is None
    # a differing address inside a parameter is no stale byte: refused
    inside = diffed(0xC00010, 0xC00020, [Param()])
    assert inside.plan is None and "not a rebased" in inside.failures[-1]
    # one inside the pool (or a parameter) in one capture only: a stale address that lies
    # in memory the forward reads, kept too (seen on the H200: a neg kernel's tail refused
    # the decode family of a generate); either way round
    for v0, v1 in ((0x900100, 0xB08200), (0xB08200, 0x900100), (0xC00010, 0xB08200)):
        one = diffed(v0, v1, [Param()])
        assert one.plan is not None and one.plan.unproven == 1, (hex(v0), hex(v1))
    # but never where one of them is an address of a cache (it may be the cache's pointer)
    assert diffed(0x10000 + 16, 0xB08200, [Param()]).plan is None
    assert diffed(0xB08200, 0x50000 + 16, [Param()]).plan is None


def test_a_cache_partly_in_a_dead_caches_memory_is_rebased_and_must_be_proven(monkeypatch):
    """The allocator hands the next cache some of the dead template cache's memory (seen on
    the H200 for the prefill's family): a storage at the template's own address is rebased
    like the others (its slots are the same bytes in both captures), and the plan is unproven
    (the engine proves it against eager on copies at other addresses). Before, the family
    was refused ("two caches share memory")."""
    from test_share import A, POOL, _k, _w

    partly = _rebase.Storages(((A.ranges[0][0], 0x400), (0x60000, 0x100)))
    monkeypatch.setattr(_rebase, "memory_ranges", lambda pool: (POOL, POOL + list(A.ranges)
                                                                + list(partly.ranges)))
    nodes = {"t": [_k("index_copy", _w(0x10000 + 8, 0x20000))],
             "o": [_k("index_copy", _w(0x10000 + 8, 0x60000))]}
    monkeypatch.setattr(_cugraph, "read_graph", lambda handle: (nodes[handle], frozenset()))

    family = _rebase.Family(_Named("t"), None, None, A, None, None)
    _rebase.diff(family, _Named("o"), partly, None)
    assert family.failures == []
    assert sorted(family.plan.slots[0][0]) == [(0, 0, 8), (8, 1, 0)]
    assert family.plan.unproven == 1  # the same-address slot: proven before any rebase


class _SyncsUnlessCaptured(Net):
    """A prefill-like forward (HF's mask building): its eager path syncs with the host, a
    capture takes another path that computes something else (a rounding, say). Graphs are
    planned on the captured path (a rehearsal), so a family's proof must run that path too."""

    def forward(self, x, cache, pos):
        y = super().forward(x, cache, pos)
        _PATH[0] = "captured" if torch.cuda.is_current_stream_capturing() else "eager"
        if _PATH[0] == "eager" and bool((y > -1e9).all()):  # a host sync
            return y
        return y * (1 + 2 ** -10)


_PATH = [""]  # the path the last run took


def test_a_rehearsed_family_is_proven_on_the_captured_path(fam, monkeypatch):
    """A rehearsed signature's family with unproven bytes (forced here: the CPU double has no
    stale struct bytes) is proven with the forward run eagerly *on the captured path* (the
    template's), and what it writes is the rehearsal's: before, the proof was refused ("the
    probe is off") and would have compared the eager path with the template."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: fam.capturing)
    plan_rebase = _rebase.plan_rebase

    def unproven(*a, **kw):
        plan = plan_rebase(*a, **kw)
        plan.unproven += 1
        return plan

    monkeypatch.setattr(_rebase, "plan_rebase", unproven)
    proved, prove = [], _rebase.prove

    def watched(family, states, run_eager, *a, **kw):
        def run(copies):
            out = run_eager(copies)
            proved.append(_PATH[0])
            return out
        return prove(family, states, run, *a, **kw)

    monkeypatch.setattr(_rebase, "prove", watched)
    torch.manual_seed(0)
    policy = cg.OpPolicy()
    policy.TRUSTED_CAPTURED_PATHS = (__name__,)  # (trusted as HF's code is)
    g = cg.graphify(_SyncsUnlessCaptured(), op_policy=policy)
    kept = []
    for _ in range(4):
        c = _cache()
        for t in range(3):
            x = torch.randn(1, 1, 16)
            g(x, c, torch.tensor([t]))
            _register(c)
        kept.append(c)
    s = cg.stats(g)
    assert proved == ["captured"], (proved, s)
    assert (s.captures, s.retargets) == (2, 2) and not s.reasons, s
