"""Review of the same-address rebase (plan_rebase(tied=False)) and one_sided: the silent wrong
results a fresh-context reviewer found on the CPU (F1, F2, F3, F5), now fixed, and its controls.

The retargeted-graph double of tests/test_rebase.py (``_FakeExec``) rebuilds its whole address
map on ``repatch``: that is not what the driver does. ``RetargetedExec._patch`` writes only the
nodes named in ``patches`` (cudagraphify/_cugraph.py); every other node of a spare executable
graph keeps the arguments it was last given. ``_NodeExec`` below models that.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils._pytree as pytree

import cudagraphify as cg
from cudagraphify import _cugraph, _graphdiff, _rebase, _state
from cudagraphify._graphdiff import Refused, Storages, plan_rebase
from test_rebase import fam  # noqa: F401 (a fixture)
from test_review_static_state import Cache, Net, StaticLayer, _quiet  # noqa: F401 (autouse)
from test_share import A, B, POOL, _k, _w
from test_share_engine import _FakeExec, _nodes, _tensors, _traces, _outputs  # noqa: F401
from test_share_engine import reading  # noqa: F401 (a fixture)

CPU = torch.device("cpu")


# -- a driver-faithful retargeted executable graph --------------------------------------------

class _NodeExec(_FakeExec):
    """As the driver: instantiation copies the template's arguments, ``_patch``/``repatch``
    rewrite only the nodes in ``patches`` (whole node: template bytes + the patch), the others
    keep what they had. Launch re-runs the recorded trace, each op with its own node's map
    (``_FakeExec`` follows an in-place op's result to later ops by identity, which hides a read
    slot that a plan misses after a write to the same tensor: a kernel reads by address)."""

    made: list = []

    def __init__(self, template, patches, device_index, nodes=None):
        self.trace = _traces[template]
        self.out = _outputs[template]
        self.maps: dict[int, dict[int, int]] = {}
        self._apply(patches)
        _NodeExec.made.append(self)

    def _apply(self, patches):
        tn = _nodes(self.trace)
        for i, chunks in patches.items():
            old, new = tn[i].chunks[0], chunks.get(0, tn[i].chunks[0])
            m = {}
            for pos in range(0, len(old), 8):
                a, b = old[pos:pos + 8], new[pos:pos + 8]
                if a != b:
                    m[int.from_bytes(a, "little")] = int.from_bytes(b, "little")
            self.maps[i] = m  # the node's arguments are now exactly template + this patch

    def repatch(self, template, patches, nodes=None):
        self._apply(patches)  # (nodes not in patches: unchanged, as cuGraphExecKernelNodeSetParams)

    def launch(self, stream):
        env: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for i, (func, args, kwargs, out) in enumerate(self.trace):
                m = self.maps.get(i, {})

                def arg(v, m=m):
                    if not isinstance(v, torch.Tensor):
                        return v
                    if id(v) in env:
                        return env[id(v)]
                    ptr = m.get(v.data_ptr())
                    return _tensors[ptr] if ptr is not None else v

                a, kw = pytree.tree_map(arg, (args, kwargs))
                new = func(*a, **kw)
                inputs = {id(v) for v in pytree.tree_leaves((args, kwargs))}
                for o, n in zip(pytree.tree_leaves(out), pytree.tree_leaves(new)):
                    # an op's fresh result (graph memory) is found by the later ops that read
                    # it; an in-place or out= result is memory that was there before: a later
                    # op reads it through its own node's address, patched or not
                    if isinstance(o, torch.Tensor) and id(o) not in inputs:
                        env[id(o)] = n
        self._write_back(env)


@pytest.fixture
def faithful(fam, monkeypatch):  # noqa: F811
    """``fam`` with the driver-faithful exec, and every tensor a state walk saw kept alive
    (device memory that was freed still holds its bytes and its address stays mapped: a graph
    that still points there reads and writes it silently, it does not raise)."""
    monkeypatch.setattr(_cugraph, "RetargetedExec", _NodeExec)
    _NodeExec.made = []
    kept: list = []
    layout = _state.state_layout

    def keeping(values):
        for t in _rebase._tensors(values):
            _tensors[t.data_ptr()] = t
            kept.append(t)
        return layout(values)

    monkeypatch.setattr(_state, "state_layout", keeping)
    yield fam
    kept.clear()


def _made(keys: list[torch.Tensor]) -> Cache:
    """A cache already set up, its layers' keys the given tensors (so a test decides which
    memory a cache lies in: the dead template cache's memory, handed on)."""
    layers = []
    for k in keys:
        layer = StaticLayer(k.shape[1])
        layer.keys, layer.is_initialized = k, True
        layers.append(layer)
    return Cache(layers)


def _run(ref, g, rc, c, steps=3, seed=0):
    """``steps`` calls on the pair (eager ``ref`` with ``rc``, graphed ``g`` with ``c``): the
    steps whose output or cache differs from eager's."""
    bad = []
    gen = torch.Generator().manual_seed(seed)
    for t in range(steps):
        x, pos = torch.randn(1, 1, 16, generator=gen), torch.tensor([t])
        want, got = ref(x, rc, pos), g(x, c, pos)
        for layer in c.layers:
            _tensors[layer.keys.data_ptr()] = layer.keys
        same_cache = all(torch.equal(a.keys, b.keys) for a, b in zip(rc.layers, c.layers))
        if not torch.equal(got, want) or not same_cache:
            bad.append(t)
    return bad


def _zeros(n=2):
    return [torch.zeros(1, 6, 16) for _ in range(n)]


def _family(g):
    (family,) = g._cudagraphify_state.families._families.values()
    return family


# -- F1: a spare executable graph from a failed proof is handed, unpatched, to a cache at the
#        template's own addresses (retarget with plan None: patches == {}) --------------------

class _Backend:
    def stream_token(self, device):
        return 0


class _Raw:
    pool = None
    pool_bytes = 0
    capture_seconds = 0.0

    def __init__(self, name):
        self.name = name

    def cuda_graph(self):
        return self.name

    def release(self):
        pass


class _ArgsExec:
    """The driver's executable graph, as arguments per node (what ``_patch`` does to it)."""

    def __init__(self, template, patches, device_index, nodes):
        self.args = {i: list(n.chunks) for i, n in enumerate(nodes)}  # cuGraphInstantiate
        self.repatch(template, patches, nodes)

    def repatch(self, template, patches, nodes):
        for idx, chunks in patches.items():  # (RetargetedExec._patch: only these nodes)
            self.args[idx] = [chunks.get(i, b) for i, b in enumerate(nodes[idx].chunks)]

    def launch(self, stream):
        pass

    def destroy(self):
        pass


class _State:
    """A static state of two storages (big enough not to be keyed by value)."""

    def __init__(self, a=None, b=None):
        self.k = torch.zeros(256) if a is None else a
        self.v = torch.zeros(128) if b is None else b


def _unit_family(monkeypatch):
    monkeypatch.setattr(_cugraph, "RetargetedExec", _ArgsExec)
    sa, sb = _State(), _State()
    layout, ra = _state.state_layout([sa])
    _, rb = _state.state_layout([sb])
    a, b = Storages(tuple(ra)), Storages(tuple(rb))
    n0 = [_k("index_copy", _w(a.ranges[0][0] + 8, a.ranges[1][0]))]
    n1 = [_k("index_copy", _w(b.ranges[0][0] + 8, b.ranges[1][0]))]

    class Inputs:
        copy = []
        leaves = []

    family = _rebase.Family(_Raw("t"), None, layout, a, Inputs(), torch.zeros(3))
    family.nodes, family.edges = n0, frozenset()
    family.plan = plan_rebase(n0, n1, frozenset(), frozenset(), a, b, POOL, tied=False,
                              one_sided=True)
    family.plan.unproven += 1  # (as a same-address slot or a stale struct byte makes it)
    return family, sa, sb, n0


def test_F1_failed_proof_spare_reused_for_a_cache_at_the_templates_addresses(monkeypatch):
    family, sa, sb, n0 = _unit_family(monkeypatch)
    # prove(): the eager run gives something else than the rebased template (any failure after
    # retarget: nondeterminism, a wrong slot that the proof caught, an exception in the replay)
    _rebase.prove(family, [sb], lambda copies: torch.ones(3), [], _Backend(), CPU)
    assert family.plan is None and "does not equal" in family.failures[-1]
    assert family.reason is None  # one failure of three: the family still serves entry()
    assert family.spare == []  # (the proof's graph, patched for its dead copy, is destroyed)
    # a later cache exactly at the template's addresses (plan None: "take the template as is")
    raw = _rebase.retarget(family, family.storages, _Backend(), CPU)
    assert raw._exe.args == {0: n0[0].chunks}, (
        "graph for the template's own addresses points at "
        f"{[hex(int.from_bytes(c[p:p + 8], 'little')) for c in raw._exe.args[0] for p in (0, 8)]}"
        f", template {[hex(int.from_bytes(n0[0].chunks[0][p:p + 8], 'little')) for p in (0, 8)]}")


def test_F1_control_a_passed_proof_repatches_every_planned_node(monkeypatch):
    family, sa, sb, n0 = _unit_family(monkeypatch)
    _rebase.prove(family, [sb], lambda copies: torch.zeros(3), [], _Backend(), CPU)
    assert family.plan is not None and family.failures == []
    raw = _rebase.retarget(family, family.storages, _Backend(), CPU)
    assert raw._exe.args == {0: n0[0].chunks}


def _f1_scenario(monkeypatch):
    real = _rebase.prove
    fails = [1]

    def once_failing(family, states, run_eager, *a, **kw):
        def run(copies):
            out = run_eager(copies)
            if fails[0]:
                fails[0] -= 1
                out = out + 1  # (a proof that fails: the injected fault)
            return out
        return real(family, states, run, *a, **kw)

    monkeypatch.setattr(_rebase, "prove", once_failing)
    torch.manual_seed(0)
    ref = Net()
    g = cg.graphify(copy.deepcopy(ref))
    ka = _zeros()
    a = _made(ka)
    assert _run(ref, g, _made(_zeros()), a) == []  # the template (cache A)
    del a  # A dies; its memory (ka) is handed on
    kb = [ka[0].zero_(), torch.zeros(1, 6, 16)]  # B: layer 0 in A's memory (same address)
    b = _made(kb)
    assert _run(ref, g, _made(_zeros()), b, seed=1) == []  # B: captured, diffed, proof fails
    family = _family(g)
    assert family.plan is None and family.reason is None, family.failures
    del b
    c = _made([ka[0].zero_(), ka[1].zero_()])  # C: wholly in A's memory
    retargets = cg.stats(g).retargets
    bad = _run(ref, g, _made(_zeros()), c, seed=2)
    assert cg.stats(g).retargets == retargets + 1  # (C took the template via Families.entry)
    return bad


def test_F1_control_without_spares_the_same_sequence_equals_eager(faithful, monkeypatch):
    monkeypatch.setattr(_rebase, "_SPARE", 0)
    assert _f1_scenario(monkeypatch) == []


def test_F1_end_to_end_wrong_results_after_a_failed_proof(faithful, monkeypatch):
    bad = _f1_scenario(monkeypatch)
    assert bad == [], f"cache C (at the template's addresses): steps {bad} differ from eager"


# -- F2: the proof cannot see a read slot that a plan misses in a same-address storage --------

def _drop_reads_of(which):
    """A plan_rebase that loses the slots of read-only nodes (the mean) into storage ``which``
    ("same": those at one address in both captures; "moved": those that moved): a stand-in for
    a cache pointer the byte scan cannot see as an in-range 8-byte word (an end pointer, a TMA
    descriptor's packed address, a pointer table in device memory)."""
    real = _graphdiff.plan_rebase

    def lossy(nodes0, nodes1, e0, e1, a, b, *args, **kw):
        plan = real(nodes0, nodes1, e0, e1, a, b, *args, **kw)
        same = {j for j, (x, y) in enumerate(zip(a.ranges, b.ranges)) if x[0] == y[0]}
        for i in list(plan.slots):
            if "mean" not in nodes0[i].name:
                continue
            for c in list(plan.slots[i]):
                keep = [(p, j, o) for p, j, o in plan.slots[i][c]
                        if (j in same) != (which == "same")]
                plan.count -= len(plan.slots[i][c]) - len(keep)
                plan.slots[i][c] = keep
        plan.unproven = max(plan.unproven, 1)
        return plan

    return lossy


def test_F2_proof_blind_to_a_missed_read_in_a_same_address_storage(faithful, monkeypatch):
    monkeypatch.setattr(_rebase, "plan_rebase", _drop_reads_of("same"))
    bad, family = _f2_scenario()
    assert bad == [], (
        f"the proof kept a plan that misses a read of the cache: {family.plan is not None}; "
        f"the later cache's steps that differ from eager: {bad}")


def test_F2_control_the_same_miss_in_a_moved_storage_is_caught(faithful, monkeypatch):
    monkeypatch.setattr(_rebase, "plan_rebase", _drop_reads_of("moved"))
    bad, family = _f2_scenario()
    assert family.plan is None and "does not equal" in family.failures[-1], family.failures


def _f2_scenario():
    torch.manual_seed(0)
    ref = Net()
    g = cg.graphify(copy.deepcopy(ref))
    ka = _zeros()
    a = _made(ka)
    assert _run(ref, g, _made(_zeros()), a) == []
    del a
    kb = [ka[0].zero_(), torch.zeros(1, 6, 16)]  # B: layer 0 in A's memory
    b = _made(kb)
    assert _run(ref, g, _made(_zeros()), b, seed=1) == []
    family = _family(g)
    del b
    kb[0].normal_()  # B died: its memory is someone else's now
    c = _made(_zeros())  # C elsewhere: rebased with the plan, if there is one
    return _run(ref, g, _made(_zeros()), c, seed=2), family


# -- F3: cache-derived values that are not in-range words are kept silently when the storage
#        did not move (the same slot is noticed when it did) ------------------------------------

def test_F3_an_end_pointer_into_a_same_address_storage_is_kept_silently():
    end = A.ranges[0][0] + A.ranges[0][1]
    moved = Storages(((0x50000, 0x400), (0x60000, 0x100)))
    n0 = [_k("scan", _w(A.ranges[0][0], end, A.ranges[1][0]))]
    n1 = [_k("scan", _w(0x50000, 0x50000 + 0x400, 0x60000))]
    with pytest.raises(Refused):  # (moved: the end pointer differs, it is no rebased address)
        plan_rebase(n0, n1, frozenset(), frozenset(), A, moved, POOL, tied=False,
                    one_sided=True)
    partly = Storages(((A.ranges[0][0], 0x400), (0x60000, 0x100)))
    n1 = [_k("scan", _w(A.ranges[0][0], end, 0x60000))]
    try:
        plan = plan_rebase(n0, n1, frozenset(), frozenset(), A, partly, POOL, tied=False,
                           one_sided=True)
    except Refused:
        return  # (what a fix might do)
    patched = plan.patches({0: n0[0].chunks}, Storages(((0x70000, 0x400), (0x80000, 0x100))))
    words = [int.from_bytes(patched[0][0][p:p + 8], "little") for p in (0, 8, 16)]
    assert words == [0x70000, 0x70400, 0x80000], [hex(w) for w in words]


# -- F4: one_sided (4e0f754) keeps a word that is a real address in one capture -----------------

def test_F4_note_one_sided_keeps_a_pool_address_against_an_unknown_one():
    """Not a bug by itself (the plan is then proven): documents what 4e0f754's one_sided accepts.
    A word that is an address in the pool in the template and an address outside the readable
    memory in the second capture (or the reverse) is kept as the template's, unproven; before
    4e0f754 it refused. The proof then carries all the weight, with F2's blind spot."""
    device = POOL + list(A.ranges) + list(B.ranges)
    n0 = [_k("k", _w(0x10000, 0x900100))]
    n1 = [_k("k", _w(0x50000, 0xB08200))]
    with pytest.raises(Refused):
        plan_rebase(n0, n1, frozenset(), frozenset(), A, B, POOL, None, device)
    plan = plan_rebase(n0, n1, frozenset(), frozenset(), A, B, POOL, None, device,
                       tied=False, one_sided=True)
    assert (plan.count, plan.unproven) == (1, 1)


# -- controls for tied=False that hold ----------------------------------------------------------

def test_control_same_address_slot_in_a_copy_node_refuses():
    partly = Storages(((A.ranges[0][0], 0x400), (0x60000, 0x100)))
    n = [_k("memcpy", _w(A.ranges[0][0] + 16), kind=1)]
    with pytest.raises(Refused, match="copies or sets"):
        plan_rebase(n, n, frozenset(), frozenset(), A, partly, POOL, tied=False)


def test_control_swapped_storages_are_rebased_by_index():
    """The allocator hands B's storage 0 the template's storage 1 memory and the reverse (same
    sizes): the differing words are rebased by index, nothing is 'same address'."""
    a = Storages(((0x10000, 0x100), (0x20000, 0x100)))
    b = Storages(((0x20000, 0x100), (0x10000, 0x100)))
    n0 = [_k("k", _w(0x10000 + 8, 0x20000 + 16))]
    n1 = [_k("k", _w(0x20000 + 8, 0x10000 + 16))]
    plan = plan_rebase(n0, n1, frozenset(), frozenset(), a, b, POOL, tied=False)
    assert sorted(plan.slots[0][0]) == [(0, 0, 8), (8, 1, 16)] and plan.unproven == 0
    out = plan.patches({0: n0[0].chunks}, Storages(((0x70000, 0x100), (0x80000, 0x100))))
    assert out[0][0] == _w(0x70000 + 8, 0x80000 + 16)


def test_control_plan_check_with_tied_false_never_refuses_a_moved_storage():
    partly = Storages(((A.ranges[0][0], 0x400), (0x60000, 0x100)))
    n0 = [_k("k", _w(0x10000 + 8, 0x20000))]
    n1 = [_k("k", _w(0x10000 + 8, 0x60000))]
    plan = plan_rebase(n0, n1, frozenset(), frozenset(), A, partly, POOL, tied=False)
    assert plan.shared == frozenset()
    plan.check(A, Storages(((0x70000, 0x400), (0x80000, 0x100))), 0, 256)
    with pytest.raises(Refused, match="aligned"):
        plan.check(A, Storages(((0x70010, 0x400), (0x80000, 0x100))), 0, 256)


# -- F5 (not a wrong result: a regression in reach) --------------------------------------------

def test_F5_probe_off_same_address_cache_refuses_the_family_for_good(faithful):
    torch.manual_seed(0)
    ref = Net()
    g = cg.graphify(copy.deepcopy(ref), probe=False)
    ka = _zeros()
    a = _made(ka)
    assert _run(ref, g, _made(_zeros()), a) == []
    del a
    b = _made([ka[0].zero_(), torch.zeros(1, 6, 16)])
    assert _run(ref, g, _made(_zeros()), b, seed=1) == []
    del b
    kept = []
    for s in range(3):  # caches elsewhere
        c = _made(_zeros())
        assert _run(ref, g, _made(_zeros()), c, seed=2 + s) == []
        kept.append(c)
    family = _family(g)
    rt = cg.stats(g).retargets
    assert not family.final and rt >= 1, (family.failures, rt)
