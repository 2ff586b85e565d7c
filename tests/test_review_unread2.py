"""Review of b5e5dbc (index_copy_'s and arange's unread lambda bytes) and dfaab7f/ac9156c
(static-cache share_graph: templates of dead caches, a layer returning a tensor of the cache,
the catch-all in ``_make``).

CPU only: bytes for ``_unread``; the graph-reading double of tests/test_share_engine.py for
``_share``. A failing test is a bug found: its assertion states the correct behaviour."""

from __future__ import annotations

import copy
import gc
import struct

import torch

import cudagraphify as cg
from cudagraphify._unread import arange_unread, index_copy_unread
from test_kernel_unread import ARANGE, INDEX_COPY, index_copy
from test_review_share_cache import Model, _decode, kv_cache
from test_share_engine import _register, ideal_pool, reading  # noqa: F401 - fixtures


# -- _share: templates of caches that are gone ------------------------------------------------

def _twins(max_graphs: int):
    torch.manual_seed(0)
    ref = Model().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model = copy.deepcopy(ref)
    _register(model)
    return ref, model, cg.share_graph(model.layers, max_graphs=max_graphs)


def _generations(ref, model, n: int) -> None:
    """``n`` generate()-like runs, each with a fresh cache (the last one's dropped too)."""
    for g in range(n):
        _decode(ref, model, kv_cache(4), kv_cache(4), 3, prefill=2,
                gen=torch.Generator().manual_seed(g))
        gc.collect()


def _kept(group) -> list:
    return [t for t in (*group._templates.values(), *group._stale) if not t.raw.released]


def test_templates_of_dead_caches_do_not_pile_up_without_bound(ideal_pool):
    """Before dfaab7f a dead cache's template stayed in ``_templates``: at most max_graphs of
    them (later signatures refused). Now each goes to ``_stale``, released only by
    ``release()``: one more template graph (its graph exec, its static inputs and outputs in
    the pool, its parsed nodes) per generate() with a fresh cache, for ever, although the
    engine has already dropped every layer graph made from it (nothing reads its memory)."""
    ref, model, group = _twins(max_graphs=4)
    _generations(ref, model, 12)
    assert [cg.stats(layer).graphs for layer in model.layers] == [1, 1, 1, 1]  # the live cache's
    kept = _kept(group)
    assert len(kept) <= 4, (
        f"{len(kept)} template graphs kept ({len(group._stale)} of dead caches, in _stale) "
        "while each layer holds 1 graph: unbounded growth with the number of generations")


def test_template_pool_bytes_counts_every_template_graph_kept(ideal_pool):
    """The stats hide that growth: ``template_pool_bytes`` sums ``_templates`` only."""
    ref, model, group = _twins(max_graphs=4)
    _generations(ref, model, 6)
    held = sum(t.raw.pool_bytes for t in _kept(group))
    assert group.stats().template_pool_bytes == held


# -- _unread: what was checked and holds (PyTorch's sources) ----------------------------------

def test_range_cuda_out_lambda_has_arange_layout():
    # range_cuda_out and arange_cuda_out launch the same ``[xstart, xstep] GPU_LAMBDA``:
    # accscalar_t (float for Half/BFloat16/float, double, int64_t for integers), then the
    # __nv_hdl_wrapper_t's ``void* data``
    rng = ARANGE.replace("15arange_cuda_out", "14range_cuda_out")
    floats = [struct.pack("<ffQ", 0.0, 1.0, v) for v in (0x601BB360, 0x60BA6250)]
    assert arange_unread(rng, floats) == frozenset(range(8, 16))
    longs = [struct.pack("<qqQ", 0, 1, v) for v in (0x601BB360, 0x60BA6250)]
    assert arange_unread(rng, longs) == frozenset(range(16, 24))
    # a 64-bit index (N > INT_MAX): the same lambda
    assert arange_unread(rng.replace("with_indexIi", "with_indexIl"), longs) == \
        frozenset(range(16, 24))
    # linspace/logspace's lambdas (other captures) are not taken for arange's
    for other in ("17linspace_cuda_out", "17logspace_cuda_out"):
        assert arange_unread(ARANGE.replace("15arange_cuda_out", other), longs) == frozenset()


def test_index_copy_layout_other_max_dims_or_no_size_capture_is_not_recognised():
    a, b = index_copy(garbage=1), index_copy(garbage=4)
    # MAX_DIMS 16 (ROCm): a 388-byte calculator, a 432-byte lambda: refused, not misread
    assert index_copy_unread(INDEX_COPY, [a[:432], b[:432]]) == frozenset()
    # CUDA_KERNEL_ASSERT compiled out: self_dim_size not captured (640 bytes): refused
    assert index_copy_unread(INDEX_COPY, [a[:640], b[:640]]) == frozenset()
    # index_fill's and gpu_index_kernel's (index, index_put) lambdas are other layouts
    for other in ("22index_fill_kernel_impl", "16gpu_index_kernel"):
        assert index_copy_unread(INDEX_COPY.replace("22index_copy_kernel_impl", other),
                                 [a, b]) == frozenset()
