"""Review hunt 9: silent wrong results in ``bucketed`` (and a look at capture_sizes' lending).

Findings (strict xfails: each asserts eager's result bit for bit, and fails today because of
the finding). All three are a bucket verified on its first call whose forward later makes its
rows interact, through state the check's re-check (``_bucket._State.same``: the training
flags of the modules it ran, the module attributes it read, the epoch) does not look at, so
the bucket goes on padding and the padding rows enter the real rows' outputs:

- H9-1: a flag kept in a buffer (``if self.center:``, a bool tensor) flipped in place after the
  check (``fill_``, ``load_state_dict``): not checked again.
- H9-2: a submodule replaced after the check (``m.head = BatchNorm1d(track_running_stats=
  False)``, a head or adapter swapped on a served model): not checked again.
- H9-3: a mutable object passed as an argument (options, keyed by identity in ``_leaf_key``)
  whose attribute the forward branches on, changed after the check: not checked again
  (graphify itself refuses such an argument and runs eagerly).

Each has a control: the same interaction switched on the way the check does see (a plain
module attribute, the swap before the first call, a new options object) gives eager's result.

Elementwise models (no matmul) so that padded and unpadded outputs are equal bit for bit on
the CPU; the graphified targets run through the simulated backend (conftest.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg

pytestmark = pytest.mark.usefixtures("quiet")


def _rowwise(x, w, c):
    return torch.tanh(x * w + c)


def _center(h):
    return h - h.mean(0, keepdim=True)


def _pair(cls, graph, *args):
    """An eager module, a twin with its weights (graphified or not) and the twin bucketed."""
    torch.manual_seed(0)
    ref = cls(*args)
    m = copy.deepcopy(ref)
    target = cg.graphify(m) if graph else m
    return ref, m, cg.bucketed(target, [4, 8])


def _served(b, ref, n=3, calls=2, *extra):
    """``calls`` calls of ``n`` rows (the first is the bucket's check, the rest run padded);
    each equal to eager's."""
    with torch.no_grad():
        for _ in range(calls):
            x = torch.randn(n, 4)
            assert torch.equal(b(x.clone(), *extra), ref(x.clone(), *extra))


def _after(b, ref, n=3, *extra):
    with torch.no_grad():
        x = torch.randn(n, 4)
        return b(x.clone(), *extra), ref(x.clone(), *extra)


# -- H9-1: a flag kept in a buffer -------------------------------------------------------------

class BufferFlag(nn.Module):
    """Centres the batch while its ``center`` buffer (a bool tensor) is set; a plain attribute
    ``center_attr`` does the same (the control)."""

    def __init__(self):
        super().__init__()
        self.w, self.c = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
        self.register_buffer("center", torch.tensor(False))
        self.center_attr = False

    def forward(self, x):
        h = _rowwise(x, self.w, self.c)
        if self.center or self.center_attr:
            h = _center(h)
        return h


@pytest.mark.parametrize("how", ["fill", "load_state_dict"])
@pytest.mark.parametrize("graph", [False, True])
def test_h9_1_buffer_flag_flipped_after_the_check(sim, graph, how):
    ref, m, b = _pair(BufferFlag, graph)
    _served(b, ref)
    for mod in (ref, m):
        if how == "fill":
            mod.center.fill_(True)
        else:
            mod.load_state_dict({**mod.state_dict(), "center": torch.tensor(True)})
    got, want = _after(b, ref)
    assert torch.equal(got, want)


class AttrFlag(BufferFlag):
    """``BufferFlag`` with the plain attribute only."""

    def forward(self, x):
        h = _rowwise(x, self.w, self.c)
        return _center(h) if self.center_attr else h


@pytest.mark.parametrize("graph", [False, True])
def test_h9_1_control_the_same_flag_as_a_module_attribute(sim, graph):
    ref, m, b = _pair(AttrFlag, graph)
    _served(b, ref)
    assert b.padded_calls > 0 and not b.refused  # (served padded until the flag changes)
    ref.center_attr = m.center_attr = True
    got, want = _after(b, ref)
    assert torch.equal(got, want)
    assert any("rows interact" in why for why in b.refused.values())


# -- H9-2: a submodule replaced ---------------------------------------------------------------

class Headed(nn.Module):
    def __init__(self):
        super().__init__()
        self.w, self.c = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
        self.head = nn.Identity()

    def forward(self, x):
        return self.head(_rowwise(x, self.w, self.c))


def _batch_head():
    # normalises over the batch in eval mode too (no running statistics)
    return nn.BatchNorm1d(4, affine=False, track_running_stats=False).eval()


@pytest.mark.parametrize("graph", [False, True])
def test_h9_2_submodule_replaced_after_the_check(sim, graph):
    ref, m, b = _pair(Headed, graph)
    _served(b, ref)
    ref.head, m.head = _batch_head(), _batch_head()
    got, want = _after(b, ref)
    assert torch.equal(got, want)


@pytest.mark.parametrize("graph", [False, True])
def test_h9_2_control_the_same_head_before_the_first_call(sim, graph):
    ref, m, b = _pair(Headed, graph)
    ref.head, m.head = _batch_head(), _batch_head()
    _served(b, ref, calls=3)
    assert any("rows interact" in why for why in b.refused.values())


# -- H9-3: a mutable options object passed as an argument -------------------------------------

class Opts:
    def __init__(self, center=False):
        self.center = center


class WithOpts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w, self.c = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))

    def forward(self, x, opts):
        h = _rowwise(x, self.w, self.c)
        return _center(h) if opts.center else h


@pytest.mark.parametrize("graph", [False, True])
def test_h9_3_options_object_changed_after_the_check(sim, graph):
    ref, m, b = _pair(WithOpts, graph)
    opts = Opts()
    _served(b, ref, 3, 2, opts)
    opts.center = True
    got, want = _after(b, ref, 3, opts)
    assert torch.equal(got, want)


@pytest.mark.parametrize("graph", [False, True])
def test_h9_3_control_a_new_options_object(sim, graph):
    ref, m, b = _pair(WithOpts, graph)
    _served(b, ref, 3, 2, Opts())
    got, want = _after(b, ref, 3, Opts(center=True))
    assert torch.equal(got, want)
    assert any("neither a tensor nor an immutable value" in why for why in b.refused.values())
    assert b.padded_calls == 0  # (never padded: not even checked)


# -- hunts that came out right ------------------------------------------------------------------

class BatchOps(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.w, self.c = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))

    def forward(self, x):
        h = _rowwise(x, self.w, self.c)
        if self.how == "cumsum":  # rows interact one way only: padding after them is no matter
            return h.cumsum(0)
        if self.how == "roll":  # row 0 takes the last row: the repeated last row hides it
            return torch.roll(h, 1, 0)
        return h + torch.randn_like(h)  # "noise": random numbers per row


@pytest.mark.parametrize("how", ["cumsum", "roll", "noise"])
@pytest.mark.parametrize("graph", [False, True])
def test_batch_ops_and_the_random_stream(sim_rng, graph, how):
    """cumsum over the batch is served padded and exact; a roll (seen by the zero rows) and
    random draws are refused; the user's random stream after each call is eager's."""
    ref, m, b = _pair(BatchOps, graph, how)
    with torch.no_grad():
        for n in (3, 3, 5, 3, 6, 6):
            x = torch.randn(n, 4)
            before = torch.random.get_rng_state()
            got = b(x.clone())
            after = torch.random.get_rng_state()
            torch.random.set_rng_state(before)
            want = ref(x.clone())
            assert torch.equal(got, want), (how, n)
            assert torch.equal(after, torch.random.get_rng_state()), (how, n)
    assert bool(b.refused) == (how != "cumsum")
    if how == "cumsum":
        assert b.padded_calls == 9  # two checks (two padded runs each), five padded calls
