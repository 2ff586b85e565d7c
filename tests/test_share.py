"""share_graph on a CPU: the structural-identity check, the graph diff that decides which
argument slots are weight addresses, and the per-layer fallback through the simulated backend."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from conftest import assert_chain_matches
from cudagraphify._cugraph import GraphNode
from cudagraphify._graphdiff import host_ranges
from cudagraphify._share import Refused, Storages, first_difference, plan_rebase
from cudagraphify.bench.models import GPT


class Layer(nn.Module):
    def __init__(self, d=4, scale=1.0):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.scale = scale
        self.layer_idx = 0

    def forward(self, x):
        return self.norm(self.lin(x)) * self.scale + x


def _stack(n=3):
    torch.manual_seed(0)
    layers = nn.ModuleList(Layer() for _ in range(n))
    for i, layer in enumerate(layers):
        layer.layer_idx = i
    return layers


# -- structural identity ---------------------------------------------------------------------

def test_identical_layers_pass_and_each_difference_is_named():
    a, b = Layer(), Layer()
    assert first_difference(a, b) is None
    b.scale = 2.0
    assert "scale: 1.0 vs 2.0" in first_difference(a, b)
    b = Layer(d=5)
    assert "lin.weight" in first_difference(a, b)
    b = Layer().double()
    assert "float64" in first_difference(a, b)
    b = Layer()
    b.norm = nn.Identity()
    assert "norm: class LayerNorm vs Identity" in first_difference(a, b)
    b = Layer()
    b.lin.weight = nn.Parameter(b.lin.weight.detach().t().contiguous().t())  # same shape, strided
    assert "lin.weight" in first_difference(a, b)
    b = Layer().eval()
    assert "training=True vs False" in first_difference(a, b)
    b = Layer()
    b.register_buffer("extra", torch.zeros(1))
    assert "buffers" in first_difference(a, b)
    b = Layer()
    b.lin.weight.requires_grad_(False)
    assert "lin.weight" in first_difference(a, b)


def test_a_parameter_difference_names_the_fields_that_differ():
    a = Layer()
    b = Layer()
    b.lin.weight = nn.Parameter(b.lin.weight.detach().half())
    assert first_difference(a, b) == ("lin.weight: dtype torch.float32 vs torch.float16, "
                                      "storage bytes 64 vs 32")
    b = Layer()
    b.lin.weight.requires_grad_(False)
    assert first_difference(a, b) == "lin.weight: requires grad True vs False"
    b = Layer()
    b.lin.weight = nn.Parameter(b.lin.weight.detach().t().contiguous().t())
    assert first_difference(a, b) == "lin.weight: stride (4, 1) vs (1, 4)"
    b = Layer(d=5)
    assert first_difference(a, b).startswith("lin.weight: shape (4, 4) vs (5, 5), stride")
    a, b = nn.Linear(2, 2), nn.Linear(2, 2, bias=False)
    b.register_parameter("bias", None)
    assert first_difference(a, b) == "bias: a tensor vs None"  # a parameter of the root


def test_share_graph_refuses_bad_input_with_the_first_difference():
    layers = nn.ModuleList([Layer(), Layer(), Layer(d=5)])
    with pytest.raises(cg.CudagraphifyError, match=r"layer 2 differs from layer 0: lin.weight"):
        cg.share_graph(layers)
    assert all("forward" not in m.__dict__ for m in layers)  # nothing was installed
    layers = _stack()  # a plain attribute per layer (layer_idx): proven per layer, not refused
    group = cg.share_graph(layers)
    assert isinstance(group, cg.ShareGroup) and len(group.layers) == 3
    with pytest.raises(cg.CudagraphifyError, match="already shares"):
        cg.share_graph(layers, ignore_attrs="layer_idx")
    group.unshare()
    assert all("forward" not in m.__dict__ and "_cudagraphify_share" not in m.__dict__
               for m in layers)
    with pytest.raises(cg.CudagraphifyError, match="not one Layer"):
        cg.share_graph(Layer())
    with pytest.raises(cg.CudagraphifyError, match="item 1 is a int"):
        cg.share_graph([Layer(), 3])
    one = Layer()
    with pytest.raises(cg.CudagraphifyError, match="same module"):
        cg.share_graph([one, one])
    with pytest.raises(cg.CudagraphifyError, match="at least one"):
        cg.share_graph([])
    with pytest.raises(cg.CudagraphifyError, match="copy_outputs=False"):
        cg.share_graph([Layer(), Layer()], copy_outputs=False)
    pre = cg.graphify(Layer())
    with pytest.raises(cg.CudagraphifyError, match="graphified already"):
        cg.share_graph([Layer(), pre])
    gpt = GPT(32, 2, 3)
    with pytest.raises(cg.CudagraphifyError, match="differs"):
        cg.share_graph([gpt.blocks[0], gpt.ln_f])


def test_layers_call_through_the_group_and_fall_back_per_layer_without_a_graph_reader(sim):
    layers = _stack()
    ref = copy.deepcopy(layers)
    group = cg.share_graph(layers, ignore_attrs=("layer_idx",))
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            assert_chain_matches(layers, ref, x)
    s = group.stats()
    assert s.per_layer == 3 and s.retargets == 0
    assert s.reasons == {"the capture backend cannot read graphs": 3}
    assert [cg.stats(m).captures for m in layers] == [1, 1, 1]
    assert [cg.stats(m).replays for m in layers] == [2, 2, 2]
    group.release()
    assert [cg.stats(m).graphs for m in layers] == [0, 0, 0]
    with cg.graph_region():
        with torch.no_grad():
            layers[0](x)
    assert "called inside a graph_region" in " ".join(group.stats().reasons)


# -- the diff --------------------------------------------------------------------------------

A = Storages(((0x10000, 0x400), (0x20000, 0x100)))  # layer a: weight, bias storages
B = Storages(((0x50000, 0x400), (0x60000, 0x100)))
POOL = [(0x900000, 0x10000), (0xA00000, 0x10000)]


def _w(*values: int) -> bytes:
    return b"".join(v.to_bytes(8, "little") for v in values)


def _k(name, *chunks, kind=0):
    return GraphNode(kind, (kind, name, tuple(map(len, chunks))), list(chunks), name)


def test_weight_addresses_are_rebased_and_intermediates_keep_the_templates_address():
    n0 = [_k("gemm", _w(0x10000 + 64, 0x900100, 7)), _k("add", _w(0x20000, 0x900200), _w(3))]
    n1 = [_k("gemm", _w(0x50000 + 64, 0xA00100, 7)), _k("add", _w(0x60000, 0x900200), _w(3))]
    plan = plan_rebase(n0, n1, frozenset({(0, 1)}), frozenset({(0, 1)}), A, B, POOL)
    assert plan.count == 2
    assert plan.slots == {0: {0: [(0, 0, 64)]}, 1: {0: [(0, 1, 0)]}}
    C = Storages(((0x70000, 0x400), (0x80000, 0x100)))
    patches = plan.patches({i: n.chunks for i, n in enumerate(n0)}, C)
    assert patches[0][0] == _w(0x70000 + 64, 0x900100, 7)  # intermediate: template's value
    assert patches[1][0] == _w(0x80000, 0x900200)
    assert 1 not in patches[1]  # unchanged chunks are not rewritten


@pytest.mark.parametrize("case, message", [
    ("scalar", "is not a rebased parameter address"),
    ("offset", "is not a rebased parameter address"),
    ("outside", "is not a rebased parameter address"),
    ("kernel", "different work"),
    ("count", "nodes"),
    ("edges", "dependencies"),
    ("memset", "copies or sets a parameter"),
    ("unaligned", "is not a rebased parameter address"),
    ("sizes", "storages differ"),
])
def test_every_unproven_difference_refuses_sharing(case, message):
    n0 = [_k("gemm", _w(0x10000, 0x900100, 7))]
    n1 = [_k("gemm", _w(0x50000, 0xA00100, 7))]
    e0 = e1 = frozenset()
    b = B
    if case == "scalar":
        n1 = [_k("gemm", _w(0x50000, 0xA00100, 8))]
    elif case == "offset":  # the same storage, another offset: not the same parameter slot
        n1 = [_k("gemm", _w(0x50000 + 8, 0xA00100, 7))]
    elif case == "outside":  # an address of memory neither a storage nor the pool
        n1 = [_k("gemm", _w(0x50000, 0xB00100, 7))]
    elif case == "kernel":
        n1 = [_k("gemv", _w(0x50000, 0xA00100, 7))]
    elif case == "count":
        n1 = n1 + [_k("add", _w(1))]
    elif case == "edges":
        n0, n1 = n0 * 2, n1 * 2
        e0, e1 = frozenset({(0, 1)}), frozenset()
    elif case == "memset":
        n0 = [_k("memset", _w(0x10000), kind=2)]
        n1 = [_k("memset", _w(0x50000), kind=2)]
    elif case == "unaligned":
        n0 = [_k("f", b"\x01\x02\x03")]
        n1 = [_k("f", b"\x01\x02\x04")]
    elif case == "sizes":
        b = Storages(((0x50000, 0x800), (0x60000, 0x100)))
    with pytest.raises(Refused, match=message):
        plan_rebase(n0, n1, e0, e1, A, b, POOL)


def test_bytes_that_differ_between_two_captures_of_one_layer_keep_the_templates_value():
    n0 = [_k("gemm", _w(0x7FFC0000_22DC, 0x10000))]  # slot 0: host-stack padding
    n1 = [_k("gemm", _w(0x7FFC0000_2C6C, 0x50000))]
    again = [_k("gemm", _w(0x7FFC0000_2C6C, 0x10000))]  # layer a again: padding changed too
    plan = plan_rebase(n0, n1, frozenset(), frozenset(), A, B, POOL, again)
    assert plan.slots == {0: {0: [(8, 0, 0)]}}
    with pytest.raises(Refused, match="not a rebased"):  # stable in layer a: layer-dependent
        plan_rebase(n0, n1, frozenset(), frozenset(), A, B, POOL, n0)
    unstable = [_k("gemm", _w(0x7FFC0000_22DC, 0x10008))]  # a weight address that moved
    with pytest.raises(Refused, match="not a rebased"):
        plan_rebase(n0, n1, frozenset(), frozenset(), A, B, POOL, unstable)
    # a one-byte argument (an empty functor's padding) that changes between captures of layer a
    odd = plan_rebase([_k("f", b"\x01")], [_k("f", b"\x07")], frozenset(), frozenset(), A, B,
                      POOL, [_k("f", b"\x05")])
    assert odd.count == 0
    with pytest.raises(Refused, match="same layer differ"):
        plan_rebase(n0, n1, frozenset(), frozenset(), A, B, POOL, [_k("gemv", _w(0, 0))])


def test_non_address_bytes_are_kept_as_unproven_only_when_not_strict():
    n0 = [_k("reduce", _w(0x7FFD7CC4E900, 0x10000, 0x1))]  # slot 0: host-stack tail garbage
    n1 = [_k("reduce", _w(0x7FFD7CC4E8F0, 0x50000, 0x1))]
    device = POOL + [(0x10000, 0x100000)]
    plan = plan_rebase(n0, n1, frozenset(), frozenset(), A, B, POOL, n0, device)
    assert (plan.count, plan.unproven) == (1, 1)
    with pytest.raises(Refused, match="not a rebased"):  # strict: device ranges not given
        plan_rebase(n0, n1, frozenset(), frozenset(), A, B, POOL, n0)
    # a differing value that is device memory (not the layer's, not the pool) never passes
    n1 = [_k("reduce", _w(0x7FFD7CC4E900, 0x50000, 0x900100 + 0x200000))]
    with pytest.raises(Refused, match="not a rebased"):
        plan_rebase(n0, n1, frozenset(), frozenset(), A, B, POOL, n0,
                    device + [(0xB00000, 0x100000)])


MAPS = """\
00400000-00401000 r--p 00000000 08:01 122 /usr/bin/python3-non-pie
55d0a0000000-55d0a0001000 r--p 00000000 08:01 123 /usr/bin/python3.12
55d0a1000000-55d0a1400000 rw-p 00000000 00:00 0 [heap]
7f0000000000-7f0040000000 ---p 00000000 00:00 0
7f1000000000-7f1000200000 rw-s 00000000 00:05 77 /dev/nvidia-uvm
7f2000000000-7f2000001000 rw-s 00000000 00:01 78 /memfd:cuda (deleted)
7fe2a1300000-7fe2a1400000 r-xp 00020000 08:01 456 /usr/lib/libtorch_cuda.so
7ffc22570000-7ffc22600000 rw-p 00000000 00:00 0 [stack]
"""
HOST = host_ranges(MAPS)


def test_host_memory_is_the_stack_and_mapped_files_never_anonymous_device_files_or_heap():
    # (nor a mapping below 4 GiB, where an ordinary integer may lie: a non-PIE executable)
    assert HOST == [(0x55D0A0000000, 0x1000), (0x7FE2A1300000, 0x100000),
                    (0x7FFC22570000, 0x90000)]
    assert host_ranges("") == []


@pytest.mark.parametrize("v0, v1, kept", [
    (0x7FFC22592E50, 0x7FFC22592D20, True),  # two stack addresses (seen: Llama, 16 layers)
    (0x7FE2A13138D3, 0x4, True),  # a return address into a library, and a small value
    (0x4, 0x7FE2A13138D3, True),  # either capture may hold the host address
    (0x7F0000001000, 0x7F0000002000, False),  # anonymous memory: device memory may lie there
    (0x7F1000000100, 0x7F1000000200, False),  # a device file's mapping is not host memory
    (0x7FFC22592E50, 0x7F0000002000, True),  # a host address: the kernel does not read it
    (0x7F1000000100, 0x7FFC22592D20, True),  # (seen: a stack address against the pool's)
    (0x7FFC22592E50, 0xA00100, True),
    (0x7FFC22592E50, 0x50000, False),  # the other side is layer b's storage
    (0x10008, 0x7FFC22592D20, False),  # or layer a's
    (0x4, 0x8, False),  # two scalars
    (0x400100, 0x7F0000002000, False),  # a number (in a non-PIE executable's range)
    (0x55D0A1000100, 0x7F0000002000, False),  # the heap: a host buffer a node may write
])
def test_a_host_address_in_either_capture_is_kept_as_unproven_when_strict(v0, v1, kept):
    n0 = [_k("reduce", _w(v0, 0x10000))]
    n1 = [_k("reduce", _w(v1, 0x50000))]
    calls = []

    def host():
        calls.append(1)
        return HOST

    if kept:
        plan = plan_rebase(n0, n1, frozenset(), frozenset(), A, B, POOL, n0, host=host)
        assert (plan.count, plan.unproven) == (1, 1) and calls
    else:
        with pytest.raises(Refused, match="argument 0 at byte 0 differs"):
            plan_rebase(n0, n1, frozenset(), frozenset(), A, B, POOL, n0, host=host)
    with pytest.raises(Refused, match="argument 0 at byte 0 differs"):  # not given: refused
        plan_rebase(n0, n1, frozenset(), frozenset(), A, B, POOL, n0)


def test_a_host_address_in_a_copy_node_is_never_kept():
    # a memcpy's host pointer is where it writes or reads: another layer's is another buffer
    n0 = [_k("memcpy", _w(0x7FFC22592E50, 0x900100), kind=1)]
    n1 = [_k("memcpy", _w(0x7FFC22592D20, 0x900100), kind=1)]
    k0, k1 = [_k("f", *n0[0].chunks)], [_k("f", *n1[0].chunks)]
    plan = plan_rebase(k0, k1, frozenset(), frozenset(), A, B, POOL, k0, host=lambda: HOST)
    assert plan.unproven == 1  # (the same bytes in a kernel's arguments are kept)
    with pytest.raises(Refused, match="argument 0 at byte 0 differs"):
        plan_rebase(n0, n1, frozenset(), frozenset(), A, B, POOL, n0, host=lambda: HOST)


def test_the_stack_canary_is_read_from_the_random_bytes_the_kernel_passes():
    import struct

    from cudagraphify._graphdiff import stack_canary

    auxv = struct.pack("<8Q", 6, 4096, 25, 0x7FFC0000A000, 31, 0x7FFC0000B000, 0, 0)
    memory = {0x7FFC0000A000: bytes([0x41, 0x0B, 0x7C, 0x8D, 0x55, 0xA6, 0x4F, 0x1B])}
    read = lambda address, n: memory[address][:n]  # noqa: E731
    assert stack_canary(auxv, read) == 0x1B4FA6558D7C0B00  # (the low byte is zeroed)
    assert stack_canary(struct.pack("<4Q", 6, 4096, 0, 0), read) is None  # no AT_RANDOM
    assert stack_canary(b"", read) is None
    canary = stack_canary()  # this process's: a word its protected frames hold
    if canary is not None:
        assert canary & 0xFF == 0 and (canary, 1) in host_ranges()
    assert not any(n == 1 for _, n in host_ranges(MAPS))  # (not from another process's maps)


def test_the_stack_canary_in_one_capture_is_kept_as_unproven_when_strict():
    # seen on the H200: HF Llama's mean reduction, one layer's struct tail holding the canary
    # (in both of its captures), the other's 0x8
    canary = 0x1B4FA6558D7C0B00
    n0 = [_k("reduce", _w(canary, 0x10000))]
    n1 = [_k("reduce", _w(0x8, 0x50000))]
    plan = plan_rebase(n0, n1, frozenset(), frozenset(), A, B, POOL, n0,
                       host=lambda: HOST + [(canary, 1)])
    assert (plan.count, plan.unproven) == (1, 1)
    with pytest.raises(Refused, match="argument 0 at byte 0 differs"):  # one more: refused
        plan_rebase(n0, [_k("reduce", _w(0x8, 0x50000))], frozenset(), frozenset(), A, B,
                    POOL, n0, host=lambda: HOST + [(canary + 0x100, 1)])


def test_a_rebased_address_never_asks_for_host_memory():
    n0 = [_k("gemm", _w(0x10000, 0x900100))]
    n1 = [_k("gemm", _w(0x50000, 0xA00100))]
    plan = plan_rebase(n0, n1, frozenset(), frozenset(), A, B, POOL,
                       host=lambda: pytest.fail("read the maps for a proven slot"))
    assert (plan.count, plan.unproven) == (1, 0)


def test_a_one_byte_argument_is_kept_as_unproven_even_when_strict():
    # Seen on the H200: GELU's empty functor held 0xf0 in both captures of layer a, 0x00 in
    # layer b's. One byte cannot be an address; the layer's graph is verified against eager.
    n0 = [_k("gelu", _w(4096), b"\xf0", _w(0x900100, 0x10000))]
    n1 = [_k("gelu", _w(4096), b"\x00", _w(0x900100, 0x50000))]
    plan = plan_rebase(n0, n1, frozenset(), frozenset(), A, B, POOL, n0)
    assert (plan.count, plan.unproven) == (1, 1) and plan.slots == {0: {2: [(8, 0, 0)]}}
    n1[0].chunks[0] = _w(4097)  # a scalar of eight bytes that differs still refuses
    with pytest.raises(Refused, match="argument 0 at byte 0 differs"):
        plan_rebase(n0, n1, frozenset(), frozenset(), A, B, POOL, n0)


def test_a_storage_both_layers_share_is_never_rebased():
    tied = Storages(((0x10000, 0x400), (0x60000, 0x100)))  # storage 0 shared by both layers
    n0 = [_k("gemm", _w(0x10000, 0x20000))]
    n1 = [_k("gemm", _w(0x10000, 0x60000))]
    plan = plan_rebase(n0, n1, frozenset(), frozenset(), A, tied, POOL)
    assert plan.slots == {0: {0: [(8, 1, 0)]}}


def test_untied_a_storage_at_one_address_in_both_is_rebased_and_unproven():
    # two caches, the second where the first one's storage 0 was freed: its slots are the
    # same bytes in both captures, rebased all the same, and the plan must be proven
    again = Storages(((0x10000, 0x400), (0x60000, 0x100)))
    n0 = [_k("gemm", _w(0x10000 + 8, 0x20000, 0x10000 + 0x3ff)), _k("f", _w(0x10000 + 0x400))]
    n1 = [_k("gemm", _w(0x10000 + 8, 0x60000, 0x10000 + 0x3ff)), _k("f", _w(0x10000 + 0x400))]
    plan = plan_rebase(n0, n1, frozenset(), frozenset(), A, again, POOL, tied=False)
    assert sorted(plan.slots[0][0]) == [(0, 0, 8), (8, 1, 0), (16, 0, 0x3ff)]
    assert plan.slots[1] == {0: [(0, 0, 0x400)]}  # its end (a bound), where nothing starts
    assert (plan.count, plan.unproven, plan.same, plan.shared) == (4, 3, 3, frozenset())
    plan.check(A, Storages(((0x70000, 0x400), (0x80000, 0x100))), 1, 1)  # a third: no refusal
    patched = plan.patches({0: n0[0].chunks, 1: n0[1].chunks},
                           Storages(((0x70000, 0x400), (0x80000, 0x100))))
    assert patched[0][0] == _w(0x70000 + 8, 0x80000, 0x70000 + 0x3ff)
    copy0 = [_k("memcpy", _w(0x10000), kind=1)]
    with pytest.raises(Refused, match="copies or sets a cache's memory"):
        plan_rebase(copy0, copy0, frozenset(), frozenset(), A, again, POOL, tied=False)
    tied_plan = plan_rebase(n0, n1, frozenset(), frozenset(), A, again, POOL)
    assert tied_plan.slots == {0: {0: [(8, 1, 0)]}} and tied_plan.shared == {0}


def test_storages_are_deduplicated_in_parameter_order():
    m = nn.Linear(3, 3)
    flat = torch.zeros(12)
    m.weight = nn.Parameter(flat[:9].view(3, 3))
    m.bias = nn.Parameter(flat[9:])  # both views of one storage... as separate Parameters
    s = Storages.of(m)
    assert len(s.ranges) >= 1
    assert s.find(m.weight.untyped_storage().data_ptr() + 4) == (0, 4)
    assert s.find(0) is None


def test_a_piecewise_layer_shares_each_safe_piece_across_layers(sim):
    torch.manual_seed(0)
    ref = GPT(32, 2, 3, sync="item")
    model = copy.deepcopy(ref)
    group = cg.share_graph(model.blocks)
    x = torch.randn(1, 4, 32)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", cg.CudagraphifyWarning)  # "runs eagerly: piecewise"
        for _ in range(3):
            torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    s = group.stats()
    assert s.per_layer == 0 and s.captures == 0  # the blocks themselves run eagerly
    assert set(s.pieces) == {"ln1", "attn", "ln2", "mlp"}
    for path, piece in s.pieces.items():
        # each piece of every block went to its path's group (the simulated backend cannot
        # read graphs, so each captured on its own in the group's pool)
        assert piece.layers == 3 and piece.per_layer == 3, (path, piece)
    shared = [b.get_submodule("attn").__dict__["_cudagraphify_share"] for b in model.blocks]
    assert all(g is group.pieces["attn"] for g, _ in shared) and [k for _, k in shared] == [0, 1, 2]
    group.unshare()
    assert all("_cudagraphify_share" not in m.__dict__ for b in model.blocks for m in b.modules())


def test_explain_reports_the_group_and_why_sharing_was_refused(sim):
    layers = _stack(2)
    cg.share_graph(layers, ignore_attrs="layer_idx")
    with torch.no_grad():
        for _ in range(2):
            layers[1](layers[0](torch.randn(2, 4)))
    text = str(cg.explain(layers[1]))
    assert "share_graph layer 1 of 2" in text
    assert "2 per layer: the capture backend cannot read graphs (x2)" in text
    assert cg.explain(layers[0]).to_dict()["modules"][0]["share"]["per_layer"] == 2


def test_a_layer_whose_storages_do_not_fit_the_plan_is_refused():
    n0 = [_k("gemm", _w(0x10000, 0x20000))]
    n1 = [_k("gemm", _w(0x50000, 0x20000))]  # storage 1 tied between the diffed layers
    tied_b = Storages(((0x50000, 0x400), (0x20000, 0x100)))
    plan = plan_rebase(n0, n1, frozenset(), frozenset(), A, tied_b, POOL)
    assert plan.shared == {1}
    plan.check(A, Storages(((0x90000, 0x400), (0x20000, 0x100))), 2)  # tied too: fine
    with pytest.raises(Refused, match="its own storage 1"):
        plan.check(A, Storages(((0x90000, 0x400), (0x70000, 0x100))), 2)
    with pytest.raises(Refused, match="aligned differently"):
        plan.check(A, Storages(((0x90040, 0x400), (0x20000, 0x100))), 2)
    with pytest.raises(Refused, match="number or size"):
        plan.check(A, Storages(((0x90000, 0x400),)), 2)
    with pytest.raises(Refused, match="number or size"):
        plan.check(A, Storages(((0x90000, 0x800), (0x20000, 0x100))), 2)


def test_a_forward_that_writes_its_buffers_is_not_shared_and_layers_share_one_lock(sim):
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)) for _ in range(3))
    ref = copy.deepcopy(layers)
    group = cg.share_graph(layers)  # train mode: BatchNorm updates its running statistics
    x = torch.randn(8, 4)
    with torch.no_grad():
        for _ in range(3):
            assert_chain_matches(layers, ref, x)
    assert group.stats().reasons == {"forward writes to its buffers or inputs": 3}
    assert all(m.__dict__["_cudagraphify_state"].lock is group.lock for m in layers)
    group.release()
    assert group._pools == {}


def test_a_group_reports_one_stats_type_through_cg_stats_too(sim):
    layers = _stack()
    ref = copy.deepcopy(layers)
    group = cg.share_graph(layers, ignore_attrs="layer_idx")
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 4)
            y = x
            for layer, r in zip(layers, ref):
                x, y = layer(x), r(y)
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    s = cg.stats(group)
    assert isinstance(s, cg.Stats) and s == group.stats()
    assert (s.layers, s.per_layer, s.retargets, s.captures) == (3, 3, 0, 0)
    assert s.reasons == {"the capture backend cannot read graphs": 3}
    # the layers' calls, summed: each layer captured its own graph and replayed it twice
    assert (s.replays, s.graphs) == (6, 3) and s.replays == sum(cg.stats(m).replays
                                                                for m in layers)
    both = s + s
    assert (both.layers, both.per_layer, both.replays) == (6, 6, 12)
    assert both.reasons == {"the capture backend cannot read graphs": 6}
    assert cg.Stats(pieces={"a": s}) + cg.Stats(pieces={"a": s, "b": s}) == cg.Stats(
        pieces={"a": both, "b": s})
