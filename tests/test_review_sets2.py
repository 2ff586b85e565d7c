"""Review of d59b2ff (share_graph's runs recorded with ``Recorder(everything=True)`` and undone
with ``rec.undo()``; the template's counter check) and c6ac1e0 (segments' held check without
the storage size). CPU, share_graph's graph-reading double (``reading``); outputs compared with
an eager deep-copied twin (``torch.equal``). The findings (S1, S1b, S2: the partner
layer's first run partly undone) were strict xfails, fixed since: the group's recorder notes
the plain attributes of the layers' modules as they were when it started only (no registry's,
no module made in the runs); plain tests now, with the controls."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from test_share_engine import _register, reading  # noqa: F401 (a fixture)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _layers(cls, n: int = 4):
    torch.manual_seed(0)
    layers = nn.ModuleList(cls() for _ in range(n))
    ref = copy.deepcopy(layers)
    _register(layers)
    return layers, ref, cg.share_graph(layers)


def _run(layers, ref, calls: int = 3):
    x = torch.randn(2, 8)
    bad = []
    with torch.no_grad():
        for it in range(calls):
            for i, (m, r) in enumerate(zip(layers, ref)):
                if not torch.equal(m(x), r(x)):
                    bad.append((it, i))
    return bad


# -- S1: a module the partner layer's first run creates loses what its __init__ set ---------------

class _Scale(nn.Module):
    factor = 1.0  # (a class default: the instance's value, once popped, falls back to it)

    def __init__(self, f: float):
        super().__init__()
        self.factor = f

    def forward(self, x):
        return x * self.factor


class _LazyScale(nn.Module):
    """Builds a submodule on its first call (lazy set-up, per layer)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if "scale" not in self._modules:
            self.scale = _Scale(3.0)
        return self.scale(self.lin(x))


# (S1: the partner's warm-up builds the submodule; its __init__ sets were undone)
def test_s1_partner_lazily_built_submodule_keeps_its_init_attributes(reading):  # noqa: F811
    layers, ref, group = _layers(_LazyScale)
    bad = _run(layers, ref)
    assert layers[1].scale.__dict__.get("factor") == 3.0
    assert not bad, bad


class _LazyNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if "norm" not in self._modules:
            self.norm = nn.LayerNorm(8, elementwise_affine=False)
        return self.norm(self.lin(x))


# (S1b: the same for an nn.LayerNorm: every later call raised AttributeError)
def test_s1b_partner_lazily_built_layernorm_still_runs(reading):  # noqa: F811
    layers, ref, _ = _layers(_LazyNorm)
    assert not _run(layers, ref)


# -- S2: a registry write of the partner's first run is undone, the state that tells of it not ----

class _ReadyTable(nn.Module):
    """Fills a table buffer on its first call, noting so in a dict (a one-time set-up)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("table", torch.zeros(2, 1))
        self.meta = {"ready": False}

    def forward(self, x):
        if not self.meta["ready"]:
            self.table = torch.arange(2, dtype=x.dtype)[:, None] + 1
            self.meta["ready"] = True
        return self.lin(x) + self.table


# (S2: the partner's buffer replacement was put back while its dict flag stayed)
def test_s2_partner_first_run_buffer_replacement_is_kept_with_its_flag(reading):  # noqa: F811
    layers, ref, _ = _layers(_ReadyTable)
    bad = _run(layers, ref)
    assert torch.equal(layers[1].table, ref[1].table)
    assert not bad, bad


# -- controls -------------------------------------------------------------------------------------

class _Holder(nn.Module):
    pass


class _External(nn.Module):
    """Counts its calls on a module outside the layers, held out of the registries (unwatched)."""

    def __init__(self, holder):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.__dict__["holder"] = holder

    def forward(self, x):
        self.__dict__["holder"].calls += 1
        return self.lin(x)


def test_counter_on_an_unwatched_outside_module_counts_as_eager(reading):  # noqa: F811
    holder, twin = _Holder(), _Holder()
    holder.calls = twin.calls = 0
    torch.manual_seed(0)
    layers = nn.ModuleList(_External(holder) for _ in range(4))
    ref = nn.ModuleList(_External(twin) for _ in range(4))
    ref.load_state_dict(layers.state_dict())
    _register(layers)
    group = cg.share_graph(layers)
    assert not _run(layers, ref, calls=5)
    assert holder.calls == twin.calls == 20
    assert any("Stats" in r or "calls" in r for r in group.stats().reasons)  # (refused)


class _Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = 2.0

    def forward(self, x):
        return self.lin(x) * self.scale


def test_plain_layers_share_and_equal_eager(reading):  # noqa: F811
    layers, ref, group = _layers(_Plain)
    assert not _run(layers, ref)
    s = group.stats()
    assert s.per_layer == 0 and s.retargets >= 3, s
