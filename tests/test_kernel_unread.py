"""share_graph's diff of two captures: the bytes of PyTorch's elementwise, cat and casting
kernels' arguments that the kernels never read (offset calculators' entries past ``dims``, a
cat's metadata past its launch's inputs, struct padding) hold host-stack leftovers that differ
between two layers' captures (HF Llama on the H100: byte 272 of a ``mul``'s lambda, byte 3224
of the rotary ``cat``'s metadata, the bytes after a ``.to()`` copy's dtype). They do not refuse
sharing; every byte a kernel reads still must match or be a rebased address, and nothing is
taken for unread where the layout is not recognised in every capture."""
import random
import struct

import pytest

from cudagraphify._cugraph import GraphNode
from cudagraphify._share import Refused, Storages, plan_rebase
from cudagraphify._unread import (arange_unread, captureless_unread, cast_unread, cat_unread,
                                  index_copy_unread, nocast_unread, unread_bytes)

MUL = ("_ZN2at6native18elementwise_kernelILi128ELi4EZNS0_22gpu_kernel_impl_nocastINS0_13Binary"
       "FunctorIN3c108BFloat16ES5_S5_NS0_15binary_internal10MulFunctorIfEEEEEEvRNS_18TensorIter"
       "atorBaseERKT_EUliE_EEviT1_")
NEG = ("_ZN2at6native18elementwise_kernelILi128ELi4EZNS0_22gpu_kernel_impl_nocastIZZZNS0_15neg_"
       "kernel_cudaERNS_18TensorIteratorBaseEENKUlvE0_clEvENKUlvE7_clEvEUlN3c108BFloat16EE_EEv"
       "S4_RKT_EUliE_EEviT1_")
CAT = ("_ZN2at6native40_GLOBAL__N__0f1a8107_8_Shape_cu_49f7391c19CatArrayBatchedCopyINS1_10Opaq"
       "ueTypeILj2EEEjLi4ELi64ELi64EEEvPT_NS1_25CatArrInputTensorMetadataIS5_T0_XT2_EXT3_EEENS1"
       "_16TensorSizeStrideIS8_Lj4EEEiS8_")
CAT_CONTIG = CAT.replace("19CatArrayBatchedCopyI", "26CatArrayBatchedCopy_contigI") \
    .replace("Li4ELi64ELi64E", "Li2ELi128ELi1E")
COPY = ("_ZN2at6native27unrolled_elementwise_kernelIZZZNS0_23direct_copy_kernel_cudaERNS_18Tens"
        "orIteratorBaseEENKUlvE1_clEvENKUlvE5_clEvEUlfE_St5arrayIPcLm2EELi4E23TrivialOffsetCalc"
        "ulatorILi1EjESB_NS0_6memory12LoadWithCastILi1EEENSC_13StoreWithCastILi1EEEEEviT_T0_T2_"
        "T3_T4_T5_")
A = Storages(((0x7F0000010000, 0x400),))  # a layer's weight
B = Storages(((0x7F0000050000, 0x400),))
POOL = [(0x7F0000900000, 0x10000)]


def junk(seed, n):
    rng = random.Random(seed)
    return bytes(rng.randrange(256) for _ in range(n)) if seed else bytes(n)


def divider(d):
    """IntDivider<unsigned int>(d) as PyTorch computes it (written out independently)."""
    shift = next(s for s in range(33) if (1 << s) >= d)
    return d, (2 ** 32 * (2 ** shift - d)) // d + 1, shift


def lam(dims=((512, 4, 4, 0), (16, 2048, 2048, 4)), data=(0x7F0000900000, 0x7F0000900400,
        0x7F0000900800), garbage=0, functor=b"\x03\0\0\0\x04\0\0\0", copy=0x25A06E10):
    """A ``gpu_kernel_impl_nocast`` lambda's bytes: an OffsetCalculator<len(data)> (used
    entries from ``dims``: (size, stride per operand)), padding to 8, the operand addresses,
    the functor, the address of the lambda's host copy (``copy``: the ``data`` of nvcc's
    host-device lambda wrapper). The unused entries and the padding hold random bytes from
    ``garbage``."""
    n = len(data)
    sizes = b"".join(struct.pack("<III", *divider(d[0])) for d in dims) \
        + junk(garbage, 12 * (25 - len(dims)))
    strides = b"".join(struct.pack(f"<{n}I", *d[1:]) for d in dims) \
        + junk(garbage + 1 if garbage else 0, 4 * n * (25 - len(dims)))
    calc = struct.pack("<i", len(dims)) + sizes + strides
    calc += junk(garbage + 2 if garbage else 0, -len(calc) % 8)
    return calc + struct.pack(f"<{n}Q", *data) + functor + struct.pack("<Q", copy)


def node(args, name, grid=(264, 1, 1)):
    return GraphNode(0, (0, name, tuple(map(len, args))), list(args), name, "params", grid)


def diff(a, b, name, again=None, grid=(264, 1, 1)):
    return plan_rebase([node(a, name, grid)], [node(b, name, grid)], frozenset(), frozenset(),
                       A, B, POOL, None if again is None else [node(again, name, grid)])


def n_arg(x):
    return struct.pack("<i", 4096), x


# -- elementwise lambdas ----------------------------------------------------------------------

def test_lambdas_that_differ_only_in_unused_calculator_entries_share():
    a, b = lam(garbage=1), lam(garbage=5, copy=0x4A2B3C40)
    assert len(a) == 648  # as on the H100: three operands, the functor, the host copy
    plan = diff(n_arg(a), n_arg(b), MUL, again=n_arg(a))
    assert plan.unproven == 0 and plan.count == 0
    two = dict(dims=((32, 2, 2), (128, 64, 128)), data=(0x7F0000900000, 0x7F0000900400),
               functor=bytes(8))
    a, b = lam(garbage=1, copy=0x66887840, **two), lam(garbage=3, copy=0x442D1B20, **two)
    assert len(a) == 536
    assert diff(n_arg(a), n_arg(b), NEG, again=n_arg(a)).unproven == 0


def test_what_the_unread_set_holds():
    a, b = lam(garbage=1), lam(garbage=2, copy=0x4A2B3C40)
    unread = nocast_unread(MUL, [a, b])
    calc = 4 + 25 * 24
    sizes, strides = range(4 + 24, 4 + 300), range(304 + 24, calc)
    assert unread == frozenset([*sizes, *strides, *range(calc, calc + 4), *range(640, 648)])
    assert {p for p in range(len(a)) if a[p] != b[p]} <= unread


def test_a_used_entry_an_address_or_the_functor_that_differs_refuses():
    a = lam(garbage=1)
    b = lam(dims=((512, 4, 4, 0), (16, 2048, 2048, 8)), garbage=2)  # a used stride
    with pytest.raises(Refused, match="not a rebased"):
        diff(n_arg(a), n_arg(b), MUL, again=n_arg(a))
    b = lam(garbage=2, functor=b"\x03\0\0\0\x05\0\0\0")  # the functor's bytes: read
    with pytest.raises(Refused, match="not a rebased"):
        diff(n_arg(a), n_arg(b), MUL, again=n_arg(a))
    b = lam(garbage=2, data=(0x7F0000900000, 0x7F0000900400, 0x7F0000A00800))  # not the pool
    with pytest.raises(Refused, match="not a rebased"):
        diff(n_arg(a), n_arg(b), MUL, again=n_arg(a))


def test_a_parameter_operand_is_still_rebased():
    a = lam(garbage=1, data=(0x7F0000900000, 0x7F0000010000, 0x7F0000900800))
    b = lam(garbage=2, data=(0x7F0000900000, 0x7F0000050000, 0x7F0000900800))
    plan = diff(n_arg(a), n_arg(b), MUL, again=n_arg(a))
    assert plan.count == 1 and plan.slots == {0: {1: [(608 + 8, 0, 0)]}}


def test_no_lambda_layout_where_it_is_not_recognised():
    a, b = lam(garbage=1), lam(garbage=2)
    casting = MUL.replace("22gpu_kernel_impl_nocast", "15gpu_kernel_impl")
    assert nocast_unread(casting, [a, b]) == frozenset()  # another lambda: another layout
    assert nocast_unread(MUL, [a, b[:-8]]) == frozenset()  # sizes disagree
    longer = lam(garbage=1, functor=bytes(32))  # a functor of more than 24 bytes
    assert nocast_unread(MUL, [longer, longer]) == frozenset()
    assert nocast_unread(MUL, [a[:-16], b[:-16]]) == frozenset()  # no functor at all
    for copy in (0, 0x25A06E14, 1 << 48):  # not an address new returns
        assert nocast_unread(MUL, [a, lam(garbage=2, copy=copy)]) == frozenset()
    c = lam(dims=((512, 4, 4, 0),), garbage=2)
    assert nocast_unread(MUL, [a, c]) == frozenset()  # the captures disagree on dims
    bad = bytearray(a)
    bad[8:12] = struct.pack("<I", 2)  # not the divider of 512
    assert nocast_unread(MUL, [bytes(bad), b]) == frozenset()
    bad = bytearray(a)
    bad[0:4] = struct.pack("<i", 0)
    assert nocast_unread(MUL, [bytes(bad), bytes(bad)]) == frozenset()  # no dims
    small = lam(garbage=1, data=(0x7F0000900000, 0x1000, 0x7F0000900800))
    assert nocast_unread(MUL, [small, b]) == frozenset()  # not operand addresses
    with pytest.raises(Refused):
        diff(n_arg(a), n_arg(c), MUL, again=n_arg(a))
    # only the lambda (argument 1 of 2) of such a kernel
    assert unread_bytes(node(n_arg(a), MUL), 0, [a, b]) == frozenset()
    assert unread_bytes(node(n_arg(a), MUL), 1, [a, b]) == nocast_unread(MUL, [a, b])
    extra = GraphNode(0, (), [a], MUL, "extra")
    assert unread_bytes(extra, 0, [a, b]) == frozenset()


# -- cat ----------------------------------------------------------------------------------------

def metadata(inputs, n=64, rows=64, dims=4, garbage=0, offset0=0, contig=False):
    """``CatArrInputTensorMetadata<T, unsigned, n, rows>`` for ``inputs``: (address, size
    along the cat dimension, elements, (sizes...), (strides...)); the entries past them (and
    the rows' dimensions past ``dims``) random bytes from ``garbage``."""
    k, rng = len(inputs), random.Random(garbage)

    def fill(m):
        return bytes(rng.randrange(256) for _ in range(m)) if garbage else bytes(m)

    offsets, at = [], offset0
    for _, size, *_ in inputs:
        offsets.append(at)
        at += size
    out = b"".join(struct.pack("<Q", x[0]) for x in inputs) + fill(8 * (n - k))
    for values in (offsets, [x[1] for x in inputs], [x[2] for x in inputs]):
        out += struct.pack(f"<{k}I", *values) + fill(4 * (n - k))
    out += bytes([contig] * k) + fill(n - k) + fill(-(21 * n) % 4)
    for j in range(rows):
        if j < k and not contig:
            sizes, strides = inputs[j][3], inputs[j][4]
            out += struct.pack(f"<{dims}I", *sizes) + fill(4 * (4 - dims)) \
                + struct.pack(f"<{dims}I", *strides) + fill(4 * (4 - dims))
        else:
            out += fill(32)
    return out + fill(-len(out) % 8)


INPUTS = [(0x7F0000900000, 32, 4096, (1, 8, 16, 32), (4096, 32, 256, 1)),
          (0x7F0000902000, 32, 4096, (1, 8, 16, 32), (8192, 64, 512, 1))]
OS = struct.pack("<8I", 1, 8, 16, 64, 8192, 1024, 64, 1)


def cat_args(meta, os=OS):
    return (struct.pack("<Q", 0x7F0000904000), meta, os, struct.pack("<i", 3),
            struct.pack("<I", 1))


def test_cat_metadata_that_differs_past_the_launchs_inputs_shares():
    a, b = metadata(INPUTS, garbage=1), metadata(INPUTS, garbage=2)
    assert len(a) == 3392
    plan = diff(cat_args(a), cat_args(b), CAT, again=cat_args(a), grid=(264, 2, 1))
    assert plan.unproven == 0 and plan.count == 0
    unread = cat_unread(CAT, 1, [a, b], 2)
    read = {*range(16), *range(512, 520), *range(768, 776), *range(1024, 1032), 1280, 1281,
            *range(1344, 1408)}
    assert unread == frozenset(range(3392)) - read


def test_cat_a_used_entry_that_differs_refuses():
    a = metadata(INPUTS, garbage=1)
    other = [INPUTS[0], (*INPUTS[1][:4], (8192, 64, 512, 2))]  # the second input's stride
    with pytest.raises(Refused, match="not a rebased"):
        diff(cat_args(a), cat_args(metadata(other, garbage=2)), CAT, again=cat_args(a),
             grid=(264, 2, 1))
    # the same bytes past input 1 are read where the launch has three inputs: not unread
    three = INPUTS + [(0x7F0000904000, 32, 4096, (1, 8, 16, 32), (4096, 32, 256, 1))]
    a3 = metadata(three, garbage=1)
    assert not cat_unread(CAT, 1, [a3, a3], 3) & set(range(16, 24))
    assert 16 in cat_unread(CAT, 1, [a, a], 2)


def test_cat_rows_past_dims_and_the_output_row():
    d3 = [(p, s, e, sz[:3], st[:3]) for p, s, e, sz, st in INPUTS]
    a, b = metadata(d3, dims=3, garbage=1), metadata(d3, dims=3, garbage=2)
    name = CAT.replace("Li4ELi64ELi64E", "Li3ELi64ELi64E")
    unread = cat_unread(name, 1, [a, b], 2)
    assert {1344 + 12, 1344 + 28} <= unread and not {1344 + 8, 1344 + 24} & unread
    os_a = OS[:12] + b"\x11" * 4 + OS[16:28] + b"\x22" * 4
    assert cat_unread(name, 2, [os_a, OS], 2) == frozenset([*range(12, 16), *range(28, 32)])
    assert cat_unread(CAT, 2, [os_a, OS], 2) == frozenset()  # four dims: all read
    plan = diff(cat_args(a, os_a), cat_args(b), name, again=cat_args(a, os_a),
                grid=(264, 2, 1))
    assert plan.unproven == 0


def test_cat_contig_kernels_read_no_rows_nor_flags():
    a = metadata(INPUTS, n=128, rows=1, garbage=1, contig=True)
    b = metadata(INPUTS, n=128, rows=1, garbage=2, contig=True)
    assert len(a) == 128 * 21 + 32
    unread = cat_unread(CAT_CONTIG, 1, [a, b], 2)
    assert set(range(128 * 20, len(a))) <= unread  # the bools and the one row
    assert not unread & {*range(16), 128 * 8, 128 * 12, 128 * 16}
    assert diff(cat_args(a), cat_args(b), CAT_CONTIG, again=cat_args(a),
                grid=(264, 2, 1)).unproven == 0


def test_no_cat_layout_where_it_is_not_recognised():
    a, b = metadata(INPUTS, garbage=1), metadata(INPUTS, garbage=2)
    assert cat_unread(CAT, 1, [a, b], 0) == frozenset()  # no grid: no inputs known
    assert cat_unread(CAT, 1, [a, b], 65) == frozenset()  # more than the metadata holds
    assert cat_unread(CAT.replace("c19Cat", "c18Cat"), 1, [a, b], 2) == frozenset()
    assert cat_unread(CAT.replace("EjLi4E", "EmLi4E"), 1, [a, b], 2) == frozenset()  # 64-bit
    assert cat_unread(CAT, 1, [a[:-8], b[:-8]], 2) == frozenset()
    assert cat_unread(CAT, 3, [a, b], 2) == frozenset()
    bad = bytearray(a)
    bad[516:520] = struct.pack("<I", 33)  # the second offset is not the first's size
    assert cat_unread(CAT, 1, [bytes(bad), b], 2) == frozenset()
    bad = bytearray(a)
    bad[1281] = 1  # contiguous, in a launch PyTorch makes over strided rows
    assert cat_unread(CAT, 1, [bytes(bad), b], 2) == frozenset()
    # offsets carry on from an earlier launch of the same cat (more inputs than the batch)
    later = metadata(INPUTS, garbage=1, offset0=2048)
    assert cat_unread(CAT, 1, [later, later], 2) == cat_unread(CAT, 1, [a, b], 2)
    with pytest.raises(Refused):
        diff(cat_args(a), cat_args(b), CAT, again=cat_args(a), grid=(264, 0, 1))


# -- casting loaders and storers ----------------------------------------------------------------

def caster(dtypes, sizes, pad):
    n = len(dtypes)
    return bytes(dtypes) + pad[:-n % 4] + struct.pack(f"<{n}I", *sizes)


def copy_args(load, store):
    return (struct.pack("<i", 4096), b"\x00", struct.pack("<2Q", 0x7F0000900000, 0x7F0000900400),
            b"\x00", b"\x00", load, store)


def test_cast_padding_after_the_dtypes_is_unread():
    a = copy_args(caster([15], [2], b"\xe1\x31\xe8"), caster([6], [4], b"\xe1\x31\xe8"))
    b = copy_args(caster([15], [2], bytes(3)), caster([6], [4], bytes(3)))
    assert a[5].hex() == "0fe131e802000000"  # as on the H100
    plan = diff(a, b, COPY, again=a)
    assert plan.unproven == 0
    assert cast_unread(COPY, 5, [a[5], b[5]]) == frozenset({1, 2, 3})
    two = COPY.replace("LoadWithCastILi1EEE", "LoadWithCastILi2EEE")
    assert cast_unread(two, 5, [caster([15, 6], [2, 4], b"\x99\x98"),
                                caster([15, 6], [2, 4], b"\0\0")]) == frozenset({2, 3})


def test_no_cast_layout_where_it_is_not_recognised():
    a, b = caster([15], [2], b"\xe1\x31\xe8"), caster([15], [2], bytes(3))
    assert cast_unread(COPY, 4, [a, b]) == frozenset()  # the output calculator, not the storer
    assert cast_unread(COPY, 5, [a, caster([15], [3], bytes(3))]) == frozenset()  # no size 3
    assert cast_unread(COPY, 5, [a, caster([99], [2], bytes(3))]) == frozenset()  # no dtype 99
    assert cast_unread(COPY, 5, [a + bytes(4), b + bytes(4)]) == frozenset()
    assert cast_unread(COPY.replace("unrolled", "unrolleD"), 5, [a, b]) == frozenset()
    x = copy_args(caster([15], [2], b"\xe1\x31\xe8"), caster([6], [4], bytes(3)))
    y = copy_args(caster([5], [2], b"\xe1\x31\xe8"), caster([6], [4], bytes(3)))  # the dtype
    with pytest.raises(Refused, match="argument 5 at byte 0"):
        diff(x, y, COPY, again=x)


def test_the_operands_come_from_the_functors_type():
    # the size alone cannot tell n operands and a functor of 104+ bytes from n + 1 operands
    # and a small one (the review's U1): the functor's type names them, and the size must agree
    from cudagraphify._unread import _nocast_operands

    assert _nocast_operands(MUL) == 3 and _nocast_operands(NEG) == 2
    assert _nocast_operands(NEG.replace("UlN3c108BFloat16EE_", "UlvE_")) == 1  # a fill
    assert _nocast_operands(NEG.replace("UlN3c108BFloat16EE_", "UlfS5_E0_")) == 3
    assert _nocast_operands(MUL.replace("13BinaryFunctor", "13AUnaryFunctor")) == 2  # x * 2.0
    fill = ("_ZN2at6native18elementwise_kernelILi128ELi2EZNS0_22gpu_kernel_impl_nocastINS0_11Fill"
            "FunctorIfEEEEvRNS_18TensorIteratorBaseERKT_EUliE_EEviT1_")  # a strided fill_
    assert _nocast_operands(fill) == 1
    one = lam(dims=((16, 8),), data=(0x7F0000900000,), functor=struct.pack("<f", 3.25) + bytes(4))
    assert len(one) == 432  # as on the H100
    assert nocast_unread(fill, [one, one]) >= {28, 408 - 4} | set(range(424, 432))
    assert _nocast_operands(MUL.replace("13BinaryFunctor", "13TernaryFunctr")) is None
    assert _nocast_operands(MUL.replace("13BinaryFunctor", "14BinaryFunctorX")) is None
    assert _nocast_operands(NEG.replace("UlN3c108BFloat16EE_", "UlN2my4TypeEE_")) is None
    outside = NEG.replace("IZZZNS0_15neg_kernel_cuda", "IZZZN2my15neg_kernel_cuda")
    assert _nocast_operands(outside) is None  # a lambda that is not at::native's
    two = lam(dims=((32, 2, 2), (128, 64, 128)), data=(0x7F0000900000, 0x7F0000900400))
    assert nocast_unread(NEG, [two, two]) and not nocast_unread(MUL, [two, two])


# -- index_copy_ and arange (HF's StaticCache update, its decode step) -------------------------

INDEX_COPY = ("_ZN2at6native24index_elementwise_kernelILi128ELi4EZNS0_22index_copy_kernel_implINS0"
              "_10OpaqueTypeILi2EEEEEvRNS_14TensorIteratorElllEUliE_EEvlT1_")
ARANGE = ("_ZN50_GLOBAL__N__fa15d16e_17_RangeFactories_cu_38772b0829elementwise_kernel_with_inde"
          "xIiZZZN2at6native15arange_cuda_outERKN3c106ScalarES6_S6_RNS1_6TensorEENKUlvE_clEvENKU"
          "lvE2_clEvEUllE_EEvT_T0_PN15function_traitsISD_E11result_typeE")


def index_copy(garbage=0, dims=((64, 2, 8, 2), (17, 0, 0, 128), (4, 2176, 8, 128)),
               size_stride=(17, 64), data=(0x7F0000900000, 0x7F0000900400, 0x7F0000900800)):
    """An ``index_copy_`` lambda's bytes: an OffsetCalculator<3>, padding, the self, index and
    source addresses, the self dimension's size and stride (no host copy: a device lambda)."""
    return lam(dims=dims, data=data, garbage=garbage, functor=struct.pack("<qq", *size_stride))[:-8]


def test_index_copy_lambdas_that_differ_in_unused_calculator_entries_share():
    a, b = index_copy(garbage=1), index_copy(garbage=4)
    assert len(a) == 648  # as on the H100
    unread = index_copy_unread(INDEX_COPY, [a, b])
    calc = 4 + 25 * 24
    assert unread == frozenset([*range(4 + 36, 4 + 300), *range(304 + 36, calc),
                                *range(calc, calc + 4)])
    assert 192 in unread and {p for p in range(648) if a[p] != b[p]} <= unread
    args = (struct.pack("<q", 4096), a), (struct.pack("<q", 4096), b)
    assert diff(*args, INDEX_COPY, again=args[0]).unproven == 0
    # what it reads differs: the dimension's size, a used stride, an operand
    for other in (index_copy(garbage=4, size_stride=(18, 64)),
                  index_copy(garbage=4, dims=((64, 2, 8, 2), (17, 0, 0, 128), (4, 2176, 8, 64))),
                  index_copy(garbage=4, data=(0x7F0000900000, 0x7F0000A00400, 0x7F0000900800))):
        with pytest.raises(Refused, match="not a rebased"):
            diff(args[0], (args[0][0], other), INDEX_COPY, again=args[0])


def test_no_index_copy_layout_where_it_is_not_recognised():
    a, b = index_copy(garbage=1), index_copy(garbage=2)
    fill = INDEX_COPY.replace("22index_copy_kernel_impl", "22index_fill_kernel_impl")
    assert index_copy_unread(fill, [a, b]) == frozenset()
    assert index_copy_unread(INDEX_COPY, [a, b + bytes(8)]) == frozenset()  # another size
    assert index_copy_unread(INDEX_COPY, [a, index_copy(garbage=2, dims=())]) == frozenset()
    two = ((64, 2, 8, 2), (17, 0, 0, 128))  # dims differ between the captures
    assert index_copy_unread(INDEX_COPY, [a, index_copy(garbage=2, dims=two)]) == frozenset()
    assert index_copy_unread(INDEX_COPY, [a, index_copy(garbage=2, data=(0, 1, 2))]) == frozenset()


def test_arange_lambdas_differ_in_their_host_copy_only():
    a = struct.pack("<qqQ", 0, 1, 0x601BB360)
    b = struct.pack("<qqQ", 0, 1, 0x60BA6250)
    assert arange_unread(ARANGE, [a, b]) == frozenset(range(16, 24))
    floats = [struct.pack("<ffQ", 0.0, 1.0, v) for v in (0x601BB360, 0x60BA6250)]
    assert arange_unread(ARANGE, floats) == frozenset(range(8, 16))
    args = [(struct.pack("<i", 17), x, struct.pack("<Q", 0x7F0000900000)) for x in (a, b)]
    assert diff(*args, ARANGE, again=args[0]).unproven == 0
    with pytest.raises(Refused, match="not a rebased"):  # the start differs: read
        diff(args[0], (args[0][0], struct.pack("<qqQ", 1, 1, 0x60BA6250), args[0][2]),
             ARANGE, again=args[0])
    assert arange_unread(ARANGE, [a, struct.pack("<qqQ", 0, 1, 0x60BA6251)]) == frozenset()
    assert arange_unread(ARANGE, [a + bytes(8), b + bytes(8)]) == frozenset()  # 32 bytes
    linspace = ARANGE.replace("15arange_cuda_out", "17linspace_cuda_out")
    assert arange_unread(linspace, [a, b]) == frozenset()


# -- captureless host-device lambdas: where, pow by 2 (HF Llama's mask and RMSNorm) ------------

POW2 = ("_ZN2at6native29vectorized_elementwise_kernelILi4EZNS0_51_GLOBAL__N__b1108092_12_PowKerne"
        "l_cu_751192d7_2139629pow_tensor_scalar_kernel_implIffEEvRNS_18TensorIteratorBaseET0_EUl"
        "fE_St5arrayIPcLm2EEEEviS6_T1_")
WHERE = ("_ZN2at6native18elementwise_kernelILi128ELi4EZNS0_22gpu_kernel_impl_nocastIZZZNS0_49_GLO"
         "BAL__N__d2ba64fb_16_TensorCompare_cu_71e06f4e17where_kernel_implERNS_14TensorIteratorEE"
         "NKUlvE_clEvENKUlvE1_clEvEUlbN3c108BFloat16ES9_E_EEvRNS_18TensorIteratorBaseERKT_EUliE_"
         "EEviT1_")


def test_a_captureless_pow_lambda_is_its_host_copy_only():
    a, b = struct.pack("<Q", 0x649AE1A0), struct.pack("<Q", 0x6489EA30)
    assert unread_bytes(node((struct.pack("<i", 512), a, bytes(16)), POW2), 1, [a, b]) \
        == frozenset(range(8))
    args = [(struct.pack("<i", 512), x, struct.pack("<QQ", 0x7F0000900000, 0x7F0000900400))
            for x in (a, b)]
    assert diff(*args, POW2, again=args[0]).unproven == 0
    # the general lambda captures the exponent: 16 bytes, not taken
    exp = [struct.pack("<fiQ", 2.5, 0, v) for v in (0x649AE1A0, 0x6489EA30)]
    assert captureless_unread(POW2, exp) == frozenset()
    assert captureless_unread(POW2, [a, struct.pack("<Q", 3)]) == frozenset()  # not an address
    other = POW2.replace("29pow_tensor_scalar_kernel_impl", "29pow_tensor_tensor_kernel_impl_")
    assert captureless_unread(other, [a, b]) == frozenset()


def test_a_where_lambda_inside_a_nocast_one_is_its_host_copy_only():
    dims = ((32, 1, 2, 2, 2), (128, 0, 64, 64, 64))
    data = (0x7F0000900000, 0x7F0000900400, 0x7F0000900800, 0x7F0000900C00)
    a = lam(dims=dims, data=data, garbage=1, functor=struct.pack("<Q", 0x409F3E30))
    b = lam(dims=dims, data=data, garbage=2, functor=struct.pack("<Q", 0x3B3453D0),
            copy=0x4A2B3C40)
    assert len(a) == 752  # as on the H100
    unread = nocast_unread(WHERE, [a, b])
    assert set(range(736, 744)) <= unread and set(range(704, 736)).isdisjoint(unread)
    assert diff(n_arg(a), n_arg(b), WHERE, again=n_arg(a)).unproven == 0
    # the same layout behind another op's lambda (it may capture 8 bytes): not taken
    neg = WHERE.replace("17where_kernel_impl", "17xhere_kernel_impl")
    assert set(range(736, 744)).isdisjoint(nocast_unread(neg, [a, b]))
    # not an address there: not taken
    c = lam(dims=dims, data=data, garbage=2, functor=struct.pack("<Q", 5))
    assert set(range(736, 744)).isdisjoint(nocast_unread(WHERE, [a, c]))
