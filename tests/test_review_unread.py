"""Review of ``cudagraphify/_unread.py`` as first written (nocast lambdas, cat metadata, casting
loaders/storers): a byte a kernel reads must never be declared unread, or two layers whose
kernels differ there share one graph and the later ones silently compute with the template's
value. Each finding (U<n>) is a test that failed on the reviewed code (U1: fixed by taking the
number of operands from the functor's type); the other tests are checks that hold. The "read"
models below are written out from PyTorch's sources independently of ``_unread``
(CUDALoops.cuh ``gpu_kernel_impl_nocast``'s legacy lambda,
OffsetCalculator.cuh ``get``, IntegerDivider.cuh ``divmod``, Shape.cu's four cat kernels and
``CatArrIndexToOffset``, MemoryAccess.cuh ``LoadWithCast``/``StoreWithCast``). Real argument
bytes (two HF Llama layers' captures on an H100, torch 2.11) are embedded below. The GPU side
is .ci/review/unread/."""
from __future__ import annotations

import base64
import random
import struct
import zlib

import pytest

from cudagraphify._cugraph import GraphNode
from cudagraphify._share import Refused, Storages, plan_rebase
from cudagraphify._unread import cast_unread, cat_unread, nocast_unread, unread_bytes

from test_kernel_unread import CAT, COPY, MUL, NEG  # noqa: E402  (the kernels' names)

ADD = ("_ZN2at6native18elementwise_kernelILi128ELi4EZNS0_22gpu_kernel_impl_nocastINS0_15CUDAFunc"
       "tor_addIN3c108BFloat16EEEEEvRNS_18TensorIteratorBaseERKT_EUliE_EEviT1_")

# (size, zlib+base64 of the template layer's bytes followed by the other layer's), from
# .ci/diag/share_slots.py's share_args.txt (H100, torch 2.11; nodes 7, 12, 15, 13 and 0 of
# the first diff)
_REAL = {
    "mul": (648, "eNpjYgACJgYGRiDFCcQCDBA2CxD/rUewQTQIGLgtv322ngEO+KESOwI/eIEZUFqg4IAliP7gBBWHAn"
                 "tmwxcgCsbfyQyxh8GBAT9gZKAu8NLyhDAUUKgPdhD3MuKwjwkJgwMGSit8yZUCMWM+G74A+WfB72"
                 "ruc0D6wUcIv1KjA8yHqXve2wTmG3yCyC/kagTzYSADqg4GBJqstJHNx2WfAZS/o68FzA+Ams8Ed6"
                 "7C+lNAfgZUHORNNph/SAAw+22+QMz5DxW/8AnhX0i8QuxjYPixG0JD+MxQ9wjkLVCFhSs10uEKpi"
                 "+Q9AalYenwgEKmHL50GMgymg5HRDrk+IM3HQIAO9HJbw=="),
    "neg": (536, "eNpjYmBgUABiRiBmBeIGKJsdiM/VM0BlGRgSvhu++AvkK7AYgekCZy1PkPiCLxDxBZM/eDEggT/XVx"
                 "SfrWfACoDqGf8Hm3KDzD8A1a/wJVcKbNs3CJ8FqnYCVL5SowOsHqbueW8TmP8AKr+Qq5H7HJJ9GV"
                 "B1DlMh7hJostJGNh+XfQ++Qvg7+lrA5jGhuZ0Jih2gYQVTL3u+CsV+hd8Q8QtTIPaDwhQUHsxo5j"
                 "34hWo/TB8/I9T/UPM3nFx7H6R/AtS9MH0TattzQOJyymvDQLSB2/LbILrCBULD+Oj2MTAorj9VD/"
                 "KHApiGgYQcew+YP8lJFwtYvnghpwuDrh+DM130/BjYdNH9Y3CmCwf86QIAhEQbRw=="),
    "add": (648, "eNpjZmBgcABiRiBmA2IOKJsZiAWgbBYGLICRgbrAS8sTwlBAEb7g8sELbB0O+5iQMNjxHFBTvuRKge"
                 "ieT4Yv/tYzMCz4Xc19DkgLfITwdx1ddf8skNaBysPAB6j852nrwPLPmXHb1wDFYDtZILgBoswepv"
                 "4EUD/YfAcC/qdTeB6YBQ9PbmzaEqDhsZCrERxeMHNg4XnnM2p4wtTDwrPmMyI8IelGcf0pEP+AAo"
                 "ROgPIZGsBhJJC3QJUBmt4Gczp0cBra6TCeZXClwwu2dE6HDrB0B6UXYE+HAAxLnw0="),
    "cat": (3392, "eNpjYFBcf6qeAQgUoPQoGGlAYYT7fST7n0EAikcBWYARiDmgQagADU8FqAQjNnkg4QCimSByo2AUjI"
                  "JRMApGwWAEC7JzXpzF0i848MTwxV+geAKUPhw37T5InQBSvYhMV0DlD1y0s8RWh9722nn/LAn9"
                  "j31Hs3jOIam/MfWNF7J8QR+EX/AY4r4gXP6DyjOkCTcev/9784tHEL4BK9SfXg1gezb8h4AOqP"
                  "oJTFADHEb7T6P9p9H+02j/aRSM9p9GwSgYBaNgFIyCodV/Ktj/BaX/xLHjC136TwB7K47X"),
    "cat_os": (32, "eNpjZGBg4ABiASB2AGIGBSBmgbAZoRifPAAvIAF9"),
    "load": (8, "eNrjf2j4gomBgYEfiEE0AB09Ah0="),
    "store": (8, "eNpje2j4goWBgYENiEE0AByFAg8="),
}


def real(key):
    size, blob = _REAL[key]
    both = zlib.decompress(base64.b64decode(blob))
    assert len(both) == 2 * size
    return both[:size], both[size:]


def u32(b, at):
    return int.from_bytes(b[at:at + 4], "little")


def align(n, to):
    return -(-n // to) * to


# -- what the kernels read, modelled from PyTorch's sources -----------------------------------

def calc_size(n):
    return 4 + 25 * 12 + 25 * 4 * n


def nocast_reads(size, n, dims):
    """Bytes ``elementwise_kernel<..., gpu_kernel_impl_nocast<...>::lambda(int)>`` may read:
    the calculator's ``dims``, its first ``dims`` dividers (divisor, m1, shift) and stride rows,
    the ``n`` operand addresses, and the functor after them (assumed to run up to the last 8
    bytes: nvcc's ``__nv_hdl_wrapper_t`` holds the captures f1..fN, then ``void *data``, the
    host's heap copy, which device code does not use)."""
    data = align(calc_size(n), 8)
    out = set(range(4))
    for k in range(dims):
        out.update(range(4 + 12 * k, 16 + 12 * k))
        out.update(range(304 + 4 * n * k, 304 + 4 * n * (k + 1)))
    out.update(range(data, size - 8))
    return out


def cat_reads(kind, n, rows, dims, inputs, concat_dim=None):
    """Bytes of ``CatArrInputTensorMetadata<T, unsigned, n, rows>`` a cat kernel launched over
    ``inputs`` block rows may read: entry j < inputs of input/offset/dimSize/nElements; for
    ``CatArrayBatchedCopy`` itself also isContiguous[j] and (rows > 1) row j's first ``dims``
    sizes and strides (``CatArrIndexToOffset<unsigned, Dims>`` reads sizes 1..Dims-1 and
    strides 0..Dims-1: a superset taken)."""
    out = set()
    for j in range(inputs):
        out.update(range(8 * j, 8 * j + 8))
        for at in (8 * n, 12 * n, 16 * n):
            out.update(range(at + 4 * j, at + 4 * j + 4))
    if kind == "CatArrayBatchedCopy":
        first = align(21 * n, 4)
        for j in range(inputs):
            out.add(20 * n + j)
            row = first + 32 * (j if rows > 1 else 0)
            for d in range(dims):
                out.update(range(row + 4 * d, row + 4 * d + 4))
                out.update(range(row + 16 + 4 * d, row + 20 + 4 * d))
    return out


def os_reads(dims):
    return {p for d in range(dims) for p in (*range(4 * d, 4 * d + 4),
                                              *range(16 + 4 * d, 20 + 4 * d))}


def cast_reads(n):
    return set(range(n)) | set(range(align(n, 4), align(n, 4) + 4 * n))


def divider(d):
    shift = next(s for s in range(33) if (1 << s) >= d)
    return d, (2 ** 32 * (2 ** shift - d)) // d + 1, shift


def lam(n, sizes, tail, garbage, strides=None):
    """A nocast lambda: OffsetCalculator<n> (sizes[k], strides k*64+arg), padding, ``n``
    operand addresses in the pool, ``tail`` (the functor and the wrapper's bytes); unused
    entries and padding random from ``garbage``."""
    rng = random.Random(garbage)
    junk = lambda m: bytes(rng.randrange(256) for _ in range(m))  # noqa: E731
    dims = len(sizes)
    out = struct.pack("<i", dims)
    out += b"".join(struct.pack("<III", *divider(s)) for s in sizes) + junk(12 * (25 - dims))
    for k in range(dims):
        out += struct.pack(f"<{n}I", *(strides[k] if strides else
                                       [64 * k + a + 2 for a in range(n)]))
    out += junk(4 * n * (25 - dims))
    out += junk(-len(out) % 8)
    out += b"".join(struct.pack("<Q", 0x7F0000900000 + 0x400 * a) for a in range(n))
    return out + tail


A = Storages(((0x7F0000010000, 0x400),))
B = Storages(((0x7F0000050000, 0x400),))
POOL = [(0x7F0000900000, 0x10000)]


def node(args, name, grid=(264, 1, 1)):
    return GraphNode(0, (0, name, grid, tuple(map(len, args))), list(args), name, "params", grid)


def diff(a, b, name, again=None, grid=(264, 1, 1)):
    return plan_rebase([node(a, name, grid)], [node(b, name, grid)], frozenset(), frozenset(),
                       A, B, POOL, None if again is None else [node(again, name, grid)])


N_ARG = struct.pack("<i", 4096)
HOST = struct.pack("<Q", 0x25A06E10)  # the wrapper's ``void *data`` (a heap address)


# == findings =====================================================================================

def test_u1_a_large_functor_shifts_the_inferred_operand_count():
    # a nullary nocast kernel (a fill of a strided output: ntensors == 1) whose functor holds
    # 14 doubles (112 bytes), plus nvcc's wrapper's 8-byte host copy address: tail 120
    def tail(first):
        return struct.pack("<14d", first, *[1.0 + k for k in range(13)]) + HOST

    a = lam(1, (512, 16), tail(2.0), garbage=1)
    # another layer: its functor's first double differs; the host-stack leftovers happen to
    # be the same (as most of them are between two layers on the H100: share_args.txt)
    b = lam(1, (512, 16), tail(3.0), garbage=1)
    assert len(a) == 536 and 520 + 16 <= len(a) <= 520 + 32  # the 2-operand window
    unread = nocast_unread(MUL, [a, b, a])
    functor = set(range(416, 416 + 112))
    operand = set(range(408, 416))
    assert not unread & (functor | operand), sorted(unread & (functor | operand))[:8]
    with pytest.raises(Refused):  # the functor's bytes are read: the layers must not share
        diff((N_ARG, a), (N_ARG, b), MUL, again=(N_ARG, a))


def test_u1_three_operands_with_a_large_functor_read_as_four():
    tail_a = struct.pack("<14d", *[0.5 + k for k in range(14)]) + HOST  # 120 bytes
    tail_b = struct.pack("<14d", 7.5, *[1.5 + k for k in range(13)]) + HOST
    a, b = lam(3, (64, 8, 16), tail_a, 1), lam(3, (64, 8, 16), tail_b, 1)
    assert 736 + 16 <= len(a) <= 736 + 32  # the 4-operand window
    assert not nocast_unread(MUL, [a, b]) & set(range(608, len(a) - 8))
    with pytest.raises(Refused):
        diff((N_ARG, a), (N_ARG, b), MUL, again=(N_ARG, a))


# == what holds ===================================================================================

@pytest.mark.parametrize("key,name,n", [("mul", MUL, 3), ("neg", NEG, 2), ("add", ADD, 3)])
def test_real_llama_lambdas_unread_is_never_read_and_covers_the_garbage(key, name, n):
    a, b = real(key)
    dims = u32(a, 0)
    unread = nocast_unread(name, [a, b, a])
    assert unread and not unread & nocast_reads(len(a), n, dims)
    data = align(calc_size(n), 8)
    addresses = {p for k in range(n) for p in range(data + 8 * k, data + 8 * k + 8)}
    assert {p for p in range(len(a)) if a[p] != b[p]} <= unread | addresses
    # the layout of torch 2.11 / CUDA 13: calculator, operand addresses, then the functor
    # (CUDAFunctor_add's alpha 1.0 right after the addresses) and 8 bytes nvcc adds
    if key == "add":
        assert struct.unpack_from("<f", a, data + 8 * n)[0] == 1.0


def test_real_llama_cat_metadata_and_os():
    a, b = real("cat")
    unread = cat_unread(CAT, 1, [a, b, a], 2)
    assert unread and not unread & cat_reads("CatArrayBatchedCopy", 64, 64, 4, 2)
    pointers = set(range(16))
    assert {p for p in range(len(a)) if a[p] != b[p]} <= unread | pointers
    os_a, os_b = real("cat_os")
    assert cat_unread(CAT, 2, [os_a, os_b], 2) == frozenset()  # Dims 4: all of os is read


def test_real_llama_cast_padding():
    for key, c in (("load", 5), ("store", 6)):
        a, b = real(key)
        unread = cast_unread(COPY, c, [a, b, a])
        assert unread == {1, 2, 3} and not unread & cast_reads(1)


@pytest.mark.parametrize("n", range(1, 9))
def test_nocast_never_declares_a_read_byte_for_small_functors(n):
    rng = random.Random(n)
    for trial in range(40):
        dims = rng.randrange(1, 26)
        sizes = [rng.randrange(2, 5000) for _ in range(dims)]
        functor = rng.randrange(1, 25)  # what PyTorch's nocast functors take
        tail = bytes(rng.randrange(256) for _ in range(align(functor, 8))) \
            + struct.pack("<Q", 0x25A00000 + 8 * rng.randrange(1 << 20))  # the host copy
        x, y = lam(n, sizes, tail, trial), lam(n, sizes, tail, trial + 1000)
        # (a lambda of n - 1 floats: the name gives the operands since U1's fix)
        name = NEG.replace("UlN3c108BFloat16EE_", "Ul" + ("f" * (n - 1) or "v") + "E_")
        unread = nocast_unread(name, [x, y])
        assert unread, (n, dims, functor)
        assert not unread & nocast_reads(len(x), n, dims)
        assert {p for p in range(len(x)) if x[p] != y[p]} <= unread


@pytest.mark.parametrize("kind", ["CatArrayBatchedCopy", "CatArrayBatchedCopy_contig",
                                  "CatArrayBatchedCopy_alignedK_contig",
                                  "CatArrayBatchedCopy_vectorized"])
def test_cat_never_declares_a_read_byte(kind):
    rng = random.Random(kind)
    extra = {"CatArrayBatchedCopy_alignedK_contig": "Li16E",
             "CatArrayBatchedCopy_vectorized": "Li16ELi8E"}.get(kind, "")
    configs = [(64, 64)] if kind == "CatArrayBatchedCopy" else [(128, 1)]
    for n, rows in configs:
        for dims in range(1, 5):
            name = (f"_ZN2at6native40_GLOBAL__N__0f1a8107_8_Shape_cu_49f7391c{len(kind)}{kind}INS1"
                    f"_10OpaqueTypeILj2EEEjLi{dims}ELi{n}ELi{rows}E{extra}EEvPT_NS1_25CatArrInpu"
                    "tTensorMetadataIS5_T0_XT2_EXT3_EEENS1_16TensorSizeStrideIS8_Lj4EEEiS8_")
            for inputs in (1, 2, 3, n - 1, n):
                meta = bytearray(rng.randrange(256) for _ in range(align(align(21 * n, 4)
                                                                       + 32 * rows, 8)))
                off = rng.randrange(0, 5000)  # a later batch's offsets carry on
                for j in range(inputs):
                    struct.pack_into("<Q", meta, 8 * j, 0x7F0000900000 + 0x100 * j)
                    size = rng.randrange(1, 50)
                    struct.pack_into("<I", meta, 8 * n + 4 * j, off)
                    struct.pack_into("<I", meta, 12 * n + 4 * j, size)
                    struct.pack_into("<I", meta, 16 * n + 4 * j, size * 7)
                    meta[20 * n + j] = rows == 1
                    off += size
                unread = cat_unread(name, 1, [bytes(meta)], inputs)
                assert unread or (inputs == n and dims == 4 and kind == "CatArrayBatchedCopy")
                assert not unread & cat_reads(kind, n, rows, dims, inputs), (kind, dims, inputs)
                os_unread = cat_unread(name, 2, [bytes(32)], inputs)
                assert not os_unread & os_reads(dims)
                assert os_unread == set(range(32)) - os_reads(dims)


def test_cat_vectorized_os_dims_follow_the_launch_not_the_tensor():
    # parallel_cat's vectorized launch: nDimsLocal = dimension + 1 (a 4-D cat along dim 1 is
    # launched with Dims == 2 and the rewritten kernelOutputParam): only dims 0..1 are read
    kind = "CatArrayBatchedCopy_vectorized"
    name = (f"_ZN2at6native40_GLOBAL__N__0f1a8107_8_Shape_cu_49f7391c30{kind}INS1_10OpaqueTypeI"
            "Lj2EEEjLi2ELi128ELi1ELi16ELi8EEEvPcNS1_25CatArrInputTensorMetadataIT_T0_XT2_EXT3_"
            "EEENS1_16TensorSizeStrideIS7_Lj4EEEiS7_")
    os = struct.pack("<8I", 2, 512, 16, 32, 512 * 8 // 8, 1, 32, 1)
    assert cat_unread(name, 2, [os], 2) == set(range(32)) - os_reads(2)


@pytest.mark.parametrize("n", range(1, 5))
def test_cast_never_declares_a_read_byte(n):
    name = COPY.replace("LoadWithCastILi1EEE", f"LoadWithCastILi{n}EEE")
    x = bytes(range(5, 5 + n)) + b"\xaa" * (align(n, 4) - n) + struct.pack(f"<{n}I", *[2] * n)
    unread = cast_unread(name, 5, [x])
    assert unread == set(range(n, align(n, 4))) and not unread & cast_reads(n)


def test_dispatch_uses_the_template_nodes_grid_and_form():
    a, b = real("cat")
    args = (bytes(8), a, bytes(32), bytes(4), bytes(4))
    assert unread_bytes(node(args, CAT, (264, 2, 1)), 1, [a, b]) == cat_unread(CAT, 1, [a, b], 2)
    # a launch over one input reads entry 0 only; over 3, entry 2 is read (and here invalid)
    assert 8 in unread_bytes(node(args, CAT, (264, 1, 1)), 1, [a, b])
    assert unread_bytes(node(args, CAT, (264, 3, 1)), 1, [a, b]) == frozenset()
    no_grid = GraphNode(0, (), list(args), CAT, "params")
    assert unread_bytes(no_grid, 1, [a, b]) == frozenset()
