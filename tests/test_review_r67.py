"""Review r67 of 26f47b6 (helper-66's sweep). Simulated backend; every comparison is with eager
PyTorch on a ``copy.deepcopy`` twin. Tests named ``test_finding_*`` failed on 26f47b6; all six
were fixed after the review (A: no first-call chain replay where the graph reads tensors from
outside; B: explain leaves out tensors on a parameter's or buffer's memory; C-F: bucketed's
check compares the modules' own attributes and what they keep, plain classes with slots
included, and lets a set-up and a memo that only gains keys pass). The others are controls.

 A (wrong values, region): a chaining region's first replay now runs inside
   ``_writes.undone(outcome.held)`` (_engine.py:722-728): the statistics are put back after
   it, but the outputs the replay hands to the caller were computed from statistics updated a
   second time (a functional batch norm's write the probe does not see).
 B (wrong state, silent, explain): explain now copies the tensors inside containers; a view of
   a parameter kept in a list is among them (only identical tensors are left out), and
   ``undone``'s ``versions_kept`` resets the version counter it shares with the parameter: a
   parameter the runs wrote in place (Embedding(max_norm) renormalises rows) is neither put
   back (only the view's rows are) nor named in explain's warning any more.
 C (wrong state, bucketed over a function): ``_check`` watches the modules only when the
   target is a module (_bucket.py:144-146): over a function, the recorder sees no attribute
   writes, ``self.step += 1`` still runs three times per check (finding C of r66 not fixed
   there).
 D (wrong state, bucketed): ``_writes.contents``/``differ``/``put_back`` know plain objects'
   ``__dict__`` and slotted dataclasses, not a plain class with ``__slots__``: its counter
   still advances three times per check.
 E (speed, bucketed): ``rec.writes`` refuses a size for good (Module target, no
   ``_refused_in`` entry) when the checked call is the one that sets an attribute up
   (``if self.scale is None: self.scale = ...``, the very pattern the set-up deferral serves):
   that size runs unpadded forever.
 F (speed, bucketed): ``differ`` refuses a size whose padded runs add a key to a memo dict (a
   causal mask cached per length, bucketed on dim=1): runs unpadded forever.
"""

from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg

pytestmark = pytest.mark.usefixtures("quiet")


def close(a, b):
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


# -- A: a region's first replay returns outputs computed from twice-updated statistics ------

class FBNOut(nn.Module):
    """Running statistics as plain attributes, updated by F.batch_norm, and read after it."""

    def __init__(self, d=32):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.rm = torch.zeros(d)
        self.rv = torch.ones(d)

    def forward(self, x):
        h = torch.nn.functional.batch_norm(self.lin(x), self.rm, self.rv, training=True,
                                           momentum=0.5)
        return h + self.rm  # (a centring offset read from the statistics as they now are)


def _fbn_out(region):
    torch.manual_seed(0)
    ref = FBNOut()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(6, 32) + 3
            with cg.graph_region(enabled=region):
                a, b = g(x), ref(x)
                assert close(a, b), (i, (a - b).abs().max())
                a, b = g(a), ref(b)
                assert close(a, b), (i, (a - b).abs().max())
            assert close(g.rm, ref.rm) and close(g.rv, ref.rv), i


def test_finding_a_region_first_replay_outputs_see_stats_updated_twice(sim):
    """_engine.py:722-728: the replay after the real call updates ``rm`` a second time and
    computes ``h + rm`` from it; ``undone`` puts ``rm`` back afterwards, but the first call's
    output (the replay's) keeps the doubled update. Fix: return the real call's values (copy
    ``outcome.result`` into the replay's outputs where ``undone`` found a held tensor changed),
    or put the held tensors back to their pre-call values (copied before the real call) and
    let the replay make the call's one write."""
    _fbn_out(True)


def test_fbn_out_plain_control(sim):
    _fbn_out(False)


# -- B: explain's copy of a parameter view hides a parameter write ------------------------

class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8, max_norm=1.0)  # renormalises looked-up rows in place
        with torch.no_grad():
            self.emb.weight.mul_(5)
        self.lin = nn.Linear(8, 8)
        self.special = [self.emb.weight[:2]]  # a view of the first rows, kept in a list

    def forward(self, idx):
        return self.lin(self.emb(idx)) + self.special[0].sum()


def _explain_emb(idx):
    torch.manual_seed(0)
    m = Tied()
    g = cg.graphify(m)
    before = m.emb.weight.detach().clone()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cg.explain(g, idx)
    named = [str(x.message) for x in w if "wrote parameter" in str(x.message)]
    return torch.equal(m.emb.weight, before), named


def test_finding_b_explain_param_view_in_list_hides_param_write(sim):
    """_explain.py:190-193 takes ``self.special[0]`` (a view of ``emb.weight``, not identical to
    it) into ``undone``; _writes.py ``versions_kept`` resets the version counter the view
    shares with the parameter, so explain's check ``p._version != version`` sees no write:
    rows 3-5 stay renormalised and no warning names emb.weight (14c5597 warned). Fix: leave
    out tensors whose storage is a parameter's or buffer's (``storage_of``, not ``id``)."""
    same, named = _explain_emb(torch.tensor([[3, 4, 5]]))
    assert same or named, "explain changed emb.weight silently"


def test_explain_param_view_rows_covered_control(sim):
    # rows inside the view's span: (after the fix of B, a view of a parameter is the
    # parameter's: named in the warning, not put back)
    same, named = _explain_emb(torch.tensor([[0, 1]]))
    assert same or named


# -- C: bucketed over a function: attribute writes of the modules it runs ----------------

class Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.step = 0

    def forward(self, x):
        self.step += 1
        return self.lin(x)


def test_finding_c_bucketed_function_advances_step_counter(sim):
    """_bucket.py:144-146 watches ``self._target.modules()`` only for a Module target; the
    modules a function runs are never watched, ``rec.writes`` stays empty and the two padded
    runs' ``self.step += 1`` stay (3 per check). Fix: snapshot the ``__dict__`` of the modules
    in ``rec.called`` after the real call (``_writes.contents``) and put back / refuse on
    ``differ``, as for containers; or watch ``rec.called`` and re-run the check next call."""
    torch.manual_seed(0)
    ref = Counted()
    m = copy.deepcopy(ref)
    b = cg.bucketed(lambda x: m(x), [4, 8])
    with torch.no_grad():
        for i, n in enumerate([3, 3, 5]):
            x = torch.randn(n, 8)
            assert close(b(x), ref(x)), i
            assert m.step == ref.step, (i, m.step, ref.step)


def test_bucketed_module_step_counter_control(sim):
    torch.manual_seed(0)
    ref = Counted()
    g = copy.deepcopy(ref)
    b = cg.bucketed(g, [4, 8])
    with torch.no_grad():
        for i, n in enumerate([3, 3, 5]):
            x = torch.randn(n, 8)
            assert close(b(x), ref(x)), i
            assert g.step == ref.step, (i, g.step, ref.step)


# -- D: a counter in an object with __slots__ --------------------------------------------

class Ctr:
    __slots__ = ("n",)

    def __init__(self):
        self.n = 0


class SlotCount(nn.Module):
    def __init__(self, holder):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.ctr = holder

    def forward(self, x):
        self.ctr.n += 1
        return self.lin(x)


def _slot(holder):
    torch.manual_seed(0)
    ref = SlotCount(holder)
    g = cg.graphify(copy.deepcopy(ref))
    b = cg.bucketed(g, [4, 8])
    with torch.no_grad():
        for i, n in enumerate([3, 3, 5]):
            x = torch.randn(n, 8)
            assert close(b(x), ref(x)), i
            assert g.ctr.n == ref.ctr.n, (i, g.ctr.n, ref.ctr.n)


def test_finding_d_bucketed_slotted_counter_advances(sim):
    """_writes.py ``_contents`` (:254-264) snapshots ``__dict__`` objects and slotted
    *dataclasses* only; a plain class with ``__slots__`` is skipped, so ``differ`` cannot see
    the padded runs' ``ctr.n += 1`` and ``put_back`` does not undo it. Fix: a branch for
    objects whose type defines ``__slots__`` (every slot name over the MRO, set ones only),
    compared with ``getattr`` and put back with ``object.__setattr__``."""
    _slot(Ctr())


def test_bucketed_namespace_counter_control(sim):
    _slot(types.SimpleNamespace(n=0))


# -- E: a lazily set-up attribute refuses the first bucketed size for good -----------------

class LazyScale(nn.Module):
    def __init__(self, lazy=True):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = None if lazy else torch.ones(8) * 2

    def forward(self, x):
        if self.scale is None:
            self.scale = torch.ones(8) * 2
        return self.lin(x) * self.scale


def _lazy_scale(lazy):
    torch.manual_seed(0)
    ref = LazyScale(lazy)
    g = cg.graphify(copy.deepcopy(ref))
    b = cg.bucketed(g, [4, 8])
    with torch.no_grad():
        for i, n in enumerate([3, 3, 3, 5, 3, 3]):
            x = torch.randn(n, 8)
            assert close(b(x), ref(x)), i
    return b


def test_finding_e_bucketed_refuses_first_size_for_a_set_up(sim):
    """_bucket.py:168-171: the first call of size 3 is also the call that binds
    ``self.scale`` (held None); ``rec.writes`` refuses the size, and for a Module target
    the refusal is permanent (no ``_refused_in`` entry): batch 3 runs unpadded (its own graph)
    on every later call, although from the second call on forward sets nothing. Fix: a write
    whose old value is None/missing (the set-up rule of _first_call.py:188-195) returns the
    call's result unverified and checks again on the next call; refuse only writes seen twice."""
    b = _lazy_scale(True)
    assert not b.refused, list(b.refused.values())


def test_bucketed_preallocated_attr_control(sim):
    b = _lazy_scale(False)
    assert not b.refused, list(b.refused.values())


# -- F: a memo dict keyed by the bucketed length -----------------------------------------

class MaskCache(nn.Module):
    """A causal mask memoized per sequence length (x: (B, L, 8))."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.masks = {}

    def forward(self, x):
        L = x.shape[1]
        m = self.masks.get(L)
        if m is None:
            m = self.masks[L] = torch.ones(L, L).tril()
        return torch.einsum("ij,bjd->bid", m, self.lin(x))


def _mask_cache(dim):
    torch.manual_seed(0)
    ref = MaskCache()
    g = cg.graphify(copy.deepcopy(ref))
    b = cg.bucketed(g, [4, 8], dim=dim)
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(2, 3, 8) if dim == 1 else torch.randn(3, 2, 8)
            assert close(b(x), ref(x)), i
    return b


def test_finding_f_bucketed_memo_dict_refused(sim):
    """_bucket.py:172-190: the padded runs (length 4) add ``masks[4]``; ``differ`` reports a
    change and the size is refused for good, where 14c5597 padded it. A memo is filled once
    per key, not on every call. Fix: tell a container the padded runs *added* keys to from one
    whose existing items changed (or run the check again on the next call and refuse only
    if the contents change again), and keep ``put_back``."""
    b = _mask_cache(1)
    assert not b.refused, list(b.refused.values())


def test_bucketed_memo_other_dim_control(sim):
    b = _mask_cache(0)
    assert not b.refused, list(b.refused.values())
