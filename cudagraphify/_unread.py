"""Bytes of PyTorch's CUDA kernels' arguments that the kernels never read.

Some kernel arguments are host structs that PyTorch fills only in part: an offset calculator's
entries past its ``dims``, a cat's metadata past the inputs of its launch, struct padding. Those
bytes hold whatever the host stack held, so two captures of the same work (two identical
layers, for ``share_graph``) differ there, and a diff that counted them would refuse to share.
:func:`unread_bytes` names them for the kernels whose argument layouts are known, and only
where the layout is recognised alike in every capture compared: it is never searched for, and a
byte a kernel might read is never in it. Pure: the bytes come from :mod:`._cugraph`.
"""

from __future__ import annotations

import re

__all__ = ["unread_bytes", "reduce_unread", "nocast_unread", "cat_unread", "cast_unread",
           "index_copy_unread", "arange_unread", "captureless_unread"]

_NONE: frozenset[int] = frozenset()


def unread_bytes(node, c: int, chunks) -> frozenset[int]:
    """Positions of the bytes of argument ``c`` of kernel node ``node`` that its kernel never
    reads, given that argument's bytes in every capture compared (``chunks``); empty where
    the kernel or its layout is not recognised."""
    if node.kind != 0 or not chunks:
        return _NONE
    name, n = node.name, len(node.chunks)
    if name.startswith(_REDUCE_KERNEL):
        return reduce_unread(name, chunks) if c == 0 and n == 1 else _NONE
    if node.form != "params":  # one blob of every argument: no argument boundaries
        return _NONE
    if name.startswith(_ELEMENTWISE_KERNEL):
        return nocast_unread(name, chunks) if c == 1 and n == 2 else _NONE
    if name.startswith(_UNROLLED_KERNEL):
        return cast_unread(name, c, chunks) if n == 7 else _NONE
    if "CatArrayBatchedCopy" in name:
        return cat_unread(name, c, chunks, node.grid[1] if node.grid else 0) \
            if n == 5 else _NONE
    if name.startswith(_INDEX_KERNEL):
        return index_copy_unread(name, chunks) if c == 1 and n == 2 else _NONE
    if "elementwise_kernel_with_index" in name:
        return arange_unread(name, chunks) if c == 1 and n == 3 else _NONE
    if name.startswith(_VECTORIZED_KERNEL):
        return captureless_unread(name, chunks) if c == 1 and n == 3 else _NONE
    return _NONE


# PyTorch's CUDA reductions: ``at::native::reduce_kernel<...>(ReduceOp<...> r)`` takes one
# argument, a ReduceOp struct holding (after its functor, identity and launch config) an
# ``OffsetCalculator<1, uint32_t>`` for the input and an ``OffsetCalculator<2, uint32_t>`` for
# the output, back to back. Each is ``int dims; IntDivider<uint32_t> sizes_[25]; uint32_t
# strides_[25][NARGS]``, and its ``get`` stops at ``dims``: the entries past it are never read.
# Its constructor fills only the first ``dims`` of them, so the rest hold whatever the host
# stack held (seen on the H200 and the H100 in HF Llama's RMSNorm mean: another value in every
# layer's capture, stable across two captures of one layer).
_REDUCE_KERNEL = "_ZN2at6native13reduce_kernel"
_MAX_DIMS = 25


def _calc_dims(buf: bytes, at: int, nargs: int) -> int | None:
    """``dims`` of an ``OffsetCalculator<nargs, uint32_t>`` at byte ``at`` of ``buf``: None
    unless ``dims`` is 0..25 and each of its ``dims`` dividers is one IntDivider makes."""
    end = at + 4 + _MAX_DIMS * (12 + 4 * nargs)
    if at < 0 or end > len(buf):
        return None
    dims = int.from_bytes(buf[at:at + 4], "little", signed=True)
    if not 0 <= dims <= _MAX_DIMS:
        return None
    for k in range(dims):
        p = at + 4 + 12 * k
        d, m1, shift = (int.from_bytes(buf[q:q + 4], "little") for q in (p, p + 4, p + 8))
        if not _divider(d, m1, shift):
            return None
    return dims


def _divider(d: int, m1: int, shift: int) -> bool:
    """Whether (d, m1, shift) is what ``IntDivider<unsigned int>(d)`` holds: the magic
    number of division by ``d``."""
    if not 1 <= d <= 0x7FFFFFFF:
        return False
    s = 0
    while s < 32 and (1 << s) < d:
        s += 1
    magic = ((1 << 32) * ((1 << s) - d)) // d + 1
    return shift == s and m1 == magic < 1 << 32


def reduce_unread(name: str, chunks) -> frozenset[int]:
    """Byte positions of a reduction kernel's argument (``chunks``: the same argument in
    several captures) that the kernel never reads: the entries past ``dims`` of its two offset
    calculators, and the struct's padding. Found where ``name`` is
    ``at::native::reduce_kernel``'s and the layout is recognised alike in every capture; else
    none (nothing is taken for unread)."""
    if not name.startswith(_REDUCE_KERNEL) or not chunks:
        return _NONE
    layouts = {_reduce_layout(c) for c in chunks}
    if len(layouts) != 1:
        return _NONE
    layout = layouts.pop()
    if layout is None:
        return _NONE
    at, d_in, d_out = layout
    out = _calc_unread(at, d_in, 1) | _calc_unread(at + _CALC1, d_out, 2)
    # padding, never a field: after the calculators where ``src`` needs 8-byte alignment;
    # after the config's ``bool vectorize_input`` (its last fields: that bool, then ``int
    # output_vec_size``, a power of two up to 16); after the ``accumulate`` and
    # ``final_output`` bools, before ``noutputs`` (seen on the H100: the config's held heap
    # address bytes, another in every layer's capture)
    end = at + _CALC1 + _CALC2
    out.update(range(end, len(chunks[0]) - _AFTER))
    if all(c[at - 8] in (0, 1) and int.from_bytes(c[at - 4:at], "little") in (1, 2, 4, 8, 16)
           for c in chunks):
        out.update(range(at - 7, at - 4))
    if all(c[-8] in (0, 1) and c[-7] in (0, 1) for c in chunks):
        out.update(range(len(chunks[0]) - 6, len(chunks[0]) - 4))
    return frozenset(out)


_CALC1 = 4 + _MAX_DIMS * (12 + 4)  # sizeof(OffsetCalculator<1, uint32_t>)
_CALC2 = 4 + _MAX_DIMS * (12 + 8)
# what follows the output calculator: src, dst[2], acc_buf, cta_buf, semaphores, base_idx (8
# bytes each), accumulate, final_output (bools), noutputs (int); 4 bytes of padding before src
# where the calculators end off an 8-byte boundary
_AFTER = 7 * 8 + 8


def _reduce_layout(buf: bytes) -> tuple[int, int, int] | None:
    """(offset of the input calculator, its dims, the output one's) of a ReduceOp's bytes, or
    None. Not searched for (the launch config's own small ints look like a calculator): the
    calculators end a fixed distance before the struct's end, so the input one starts at one
    of two offsets; exactly one of them must hold a valid input calculator with at least one
    dimension (with none, ``thread_reduce`` still reads its first stride: not recognised)
    followed by a valid output calculator, and ``noutputs``, the last field, must be 1 or 2."""
    if len(buf) % 8 or int.from_bytes(buf[-4:], "little") not in (1, 2):
        return None
    found = []
    for pad in (0, 4):
        at = len(buf) - _AFTER - pad - _CALC2 - _CALC1
        if at < 0 or at % 4 or (at + _CALC1 + _CALC2 + pad) % 8:
            continue
        d_in, d_out = _calc_dims(buf, at, 1), _calc_dims(buf, at + _CALC1, 2)
        if d_in and d_out is not None:
            found.append((at, d_in, d_out))
    return found[0] if len(found) == 1 else None


def _calc_unread(at: int, dims: int, nargs: int) -> set[int]:
    """The entries past ``dims`` of an ``OffsetCalculator<nargs, uint32_t>`` at byte ``at``."""
    sizes, strides = at + 4, at + 4 + 12 * _MAX_DIMS
    return {*range(sizes + 12 * dims, strides),
            *range(strides + 4 * nargs * dims, strides + 4 * nargs * _MAX_DIMS)}


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


# PyTorch's elementwise kernels over strided operands of one dtype (``gpu_kernel_impl_nocast``)
# launch ``elementwise_kernel<nt, vt>(int N, lambda)``, the lambda a ``[=] GPU_LAMBDA`` (host
# and device) one, which nvcc passes as an ``__nv_hdl_wrapper_t``: its captures, in this order
# an ``OffsetCalculator<ntensors, uint32_t>`` (its entries past ``dims`` unset on the host, as
# a reduction's are), the ``ntensors`` data pointers (8-byte aligned) and the op's functor (a
# few bytes, left as they are), then ``void* data``, the host's heap copy of the lambda, which
# only host calls use. Seen on the H100 in HF Llama's multiplications and negations: heap
# addresses at byte 272 of the 648-byte lambda (the calculator) and at byte 528 of the
# 536-byte one (the host copy), another in every layer's capture.
_ELEMENTWISE_KERNEL = "_ZN2at6native18elementwise_kernel"
_NOCAST = re.compile(r"_ZN2at6native18elementwise_kernelILi\d+ELi\d+EZNS0_22gpu_kernel_impl_nocast"
                     r"I.*EUliE_EEviT1_")
_TAIL = (16, 32)  # the bytes after the data pointers: the functor (1 to 24) and ``data``
# The operands (output and inputs) from the functor's type, at::native's own only: the size
# alone cannot tell n operands and a large functor from n + 1 and a small one.
_NOCAST_TAIL = r"EEv(?:RNS_18TensorIteratorBaseE|S\d*_)RKT_EUliE_EEviT1_"
_FUNCTORS = {"13BinaryFunctor": 3, "15CUDAFunctor_add": 3, "13AUnaryFunctor": 2,
             "13BUnaryFunctor": 2, "21CUDAFunctorOnSelf_add": 2, "22CUDAFunctorOnOther_add": 2,
             "11FillFunctor": 1}
_STRUCT = re.compile(r".*?gpu_kernel_impl_nocastINS0_(\d+)(.*)" + _NOCAST_TAIL)
# a lambda local to an at::native function; its parameters (none: ``v``), each a builtin,
# Half, BFloat16 or a back-reference to one
_LAMBDA = re.compile(r".*?gpu_kernel_impl_nocastIZ+NS0_.*EUl(v|(?:[bcahstijlmxyfd]"
                     r"|N3c10(?:8BFloat16|4Half)E|S\d*_)+)E\d*_" + _NOCAST_TAIL)
_PARAM = re.compile(r"[bcahstijlmxyfd]|N3c10(?:8BFloat16|4Half)E|S\d*_")


def nocast_unread(name: str, chunks) -> frozenset[int]:
    """Byte positions of a ``gpu_kernel_impl_nocast`` lambda (``chunks``: its bytes in several
    captures) its kernel never reads: its offset calculator's entries past ``dims``, the
    padding after the calculator, and the host copy's address at its end. The number of
    operands follows from the functor's type, and the size must agree (the functor taking 1
    to 24 bytes); every capture must hold a valid calculator with the same ``dims``, that many
    operand addresses after it, and an aligned address at the end."""
    size = len(chunks[0])
    if not _NOCAST.fullmatch(name) or any(len(c) != size for c in chunks):
        return _NONE
    nargs = _nocast_operands(name)
    if nargs is None or not _TAIL[0] <= size - (_align(_calc_size(nargs), 8) + 8 * nargs) \
            <= _TAIL[1]:
        return _NONE
    data = _align(_calc_size(nargs), 8)
    dims = {_calc_dims(c, 0, nargs) for c in chunks}
    if len(dims) != 1 or not (d := dims.pop()):  # none, or 0: not a strided launch
        return _NONE
    if any(not 1 << 16 <= int.from_bytes(c[p:p + 8], "little") < 1 << 57
           for c in chunks for p in range(data, data + 8 * nargs, 8)):
        return _NONE  # not operand addresses
    if any(not _host_copy(int.from_bytes(c[-8:], "little")) for c in chunks):
        return _NONE
    out = _calc_unread(0, d, nargs) | set(range(_calc_size(nargs), data)) \
        | set(range(size - 8, size))
    functor = data + 8 * nargs
    if size - functor == 16 and _CAPTURELESS_NOCAST.match(name) and all(
            _host_copy(int.from_bytes(c[functor:functor + 8], "little")) for c in chunks):
        out.update(range(functor, functor + 8))  # (the op's own lambda: its host copy only)
    return frozenset(out)


def _nocast_operands(name: str) -> int | None:
    """The number of operands of a nocast lambda's functor, where its type is one of
    at::native's own functors of known arity or an at::native lambda; else None."""
    m = _STRUCT.fullmatch(name)
    if m is not None:  # a source name: its length, then that many characters
        ident = m[2][:int(m[1])]
        return _FUNCTORS.get(m[1] + ident) if m[2][len(ident):].startswith("I") else None
    m = _LAMBDA.fullmatch(name)
    return None if m is None else 1 + (m[1] != "v") * len(_PARAM.findall(m[1]))


def _host_copy(v: int) -> bool:
    """Whether ``v`` can be the address ``new`` returned on the host: nonzero, aligned, in
    user space."""
    return 0 < v < 1 << 47 and v % 8 == 0


def _calc_size(nargs: int) -> int:
    """sizeof(OffsetCalculator<nargs, uint32_t>)."""
    return 4 + _MAX_DIMS * (12 + 4 * nargs)


# ``cat``: ``CatArrayBatchedCopy[_contig|_vectorized|_alignedK_contig]<T, unsigned, Dims, n,
# stride_size, ...>(out, CatArrInputTensorMetadata inputs, TensorSizeStride<unsigned, 4> os,
# int concatDim, unsigned dimStride)``. The metadata holds ``n`` input addresses, then ``n``
# offsets, sizes along the cat dimension and element counts (4 bytes each), ``n`` contiguity
# bools, then ``stride_size`` rows of 4 sizes and 4 strides. PyTorch fills the first entries,
# one per input of the launch, and launches one block row (``gridDim.y``) per input; a block
# reads its own entry only (``blockIdx.y``), and of a size/stride row (``os``, an input's) the
# first ``Dims``. Only ``CatArrayBatchedCopy`` itself reads the bools and the inputs' rows
# (with ``stride_size == 1`` PyTorch never fills that one row). Seen on the H100 in HF Llama's
# rotary ``cat``: byte 3224 of its 3392-byte metadata, 0x0 against 0x530.
_CAT = re.compile(r"_ZN2at6native.*?(\d\d)(CatArrayBatchedCopy(?:_contig|_vectorized"
                  r"|_alignedK_contig)?)INS\w*?_10OpaqueTypeILj\d+EEEjLi([1-4])ELi(\d+)ELi(\d+)E"
                  r".*CatArrInputTensorMetadata.*")


def cat_unread(name: str, c: int, chunks, inputs: int) -> frozenset[int]:
    """Byte positions of argument ``c`` of a cat kernel launched over ``inputs`` inputs (its
    grid's y) that the kernel never reads: in its metadata (argument 1) the entries of inputs
    past ``inputs``, the rows' dimensions past ``Dims``, the bools and rows where the kernel
    reads none, and padding; in ``os`` (argument 2), its dimensions past ``Dims``. Every
    capture must hold, for the launch's inputs, offsets that follow one from the last (each
    the one before plus its size) and the contiguity PyTorch sets."""
    m = _CAT.fullmatch(name)
    if m is None or int(m[1]) != len(m[2]):
        return _NONE
    kind, dims, n, rows = m[2], int(m[3]), int(m[4]), int(m[5])
    base = kind == "CatArrayBatchedCopy"
    if not 1 <= inputs <= n or not 1 <= rows <= n or (base and rows == 1):
        return _NONE
    if c == 2:
        if any(len(x) != 32 for x in chunks):
            return _NONE
        return frozenset(_row_unread(0, dims))
    flags, first = 20 * n, _align(21 * n, 4)  # the bools; the first row
    size = _align(first + 32 * rows, 8)
    if c != 1 or any(len(x) != size for x in chunks):
        return _NONE

    def u32(x, at):
        return int.from_bytes(x[at:at + 4], "little")

    for x in chunks:
        if any(x[flags + j] != (rows == 1) for j in range(inputs)) or any(
                u32(x, 8 * n + 4 * (j + 1)) != (u32(x, 8 * n + 4 * j) + u32(x, 12 * n + 4 * j))
                % (1 << 32) for j in range(inputs - 1)):
            return _NONE
    out = set(range(flags + n, first)) | set(range(first + 32 * rows, size))
    for j in range(inputs, n):
        out.update(range(8 * j, 8 * j + 8))
        for at in (8 * n, 12 * n, 16 * n):
            out.update(range(at + 4 * j, at + 4 * j + 4))
    out.update(flags + j for j in range(0 if not base else inputs, n))
    for j in range(rows):
        if not base or j >= inputs:
            out.update(range(first + 32 * j, first + 32 * j + 32))
        else:
            out.update(_row_unread(first + 32 * j, dims))
    return frozenset(out)


def _row_unread(at: int, dims: int) -> set[int]:
    """A ``TensorSizeStride<unsigned, 4>`` row's sizes and strides past ``dims``."""
    return {p for d in range(dims, 4) for p in (*range(at + 4 * d, at + 4 * d + 4),
                                                *range(at + 16 + 4 * d, at + 20 + 4 * d))}


# Kernels that cast as they load or store (``unrolled_elementwise_kernel<..., LoadWithCast<N>,
# StoreWithCast<M>>(int, functor, data, in_calc, out_calc, loader, storer)``: a ``.to()`` copy,
# an op over mixed dtypes): the loader and the storer each hold ``std::array<ScalarType, N>``
# (one byte a dtype), then ``std::array<uint32_t, N>`` (the element sizes); between them,
# padding. Seen on the H100 in HF Llama's ``.to(float32)``: host bytes after the dtype.
_UNROLLED_KERNEL = "_ZN2at6native27unrolled_elementwise_kernel"
_CAST = re.compile(r"_ZN2at6native27unrolled_elementwise_kernelI.*NS0_6memory12LoadWithCastILi"
                   r"(\d+)EEENS\w*?_13StoreWithCastILi(\d+)EEEEEviT_T0_T2_T3_T4_T5_")


def cast_unread(name: str, c: int, chunks) -> frozenset[int]:
    """Byte positions of the loader's (argument 5) or storer's (argument 6) padding, where
    every capture holds that many dtypes (small enum values) and element sizes (1 to 16)."""
    m = _CAST.fullmatch(name)
    if m is None or c not in (5, 6):
        return _NONE
    n = int(m[1] if c == 5 else m[2])
    at = _align(n, 4)
    for x in chunks:
        if len(x) != at + 4 * n or any(x[j] >= 64 for j in range(n)) or any(
                int.from_bytes(x[p:p + 4], "little") not in (1, 2, 4, 8, 16)
                for p in range(at, at + 4 * n, 4)):
            return _NONE
    return frozenset(range(n, at))


# ``index_copy_`` (HF's StaticCache update): ``index_elementwise_kernel<nt, vt>(int64_t N,
# lambda)``, the lambda a ``[=] C10_DEVICE`` one (device only: no host copy) capturing, in the
# order its body uses them, an ``OffsetCalculator<3, uint32_t>`` (its entries past ``dims``
# unset on the host), the self, index and source pointers, and the self dimension's size and
# stride (int64). Seen on the H100 in HF Llama's decode step: heap addresses at byte 192 (an
# unused divider), another in every layer's capture.
_INDEX_KERNEL = "_ZN2at6native24index_elementwise_kernel"
_INDEX_COPY = re.compile(r"_ZN2at6native24index_elementwise_kernelILi\d+ELi\d+EZNS0_22index_copy_"
                         r"kernel_implI.*EEvRNS_14TensorIteratorElllEUliE_EEvlT1_")


def index_copy_unread(name: str, chunks) -> frozenset[int]:
    """Byte positions of an ``index_copy_`` lambda (``chunks``: its bytes in several
    captures) its kernel never reads: its offset calculator's entries past ``dims`` and the
    padding after it. Every capture must be that lambda's size, hold a valid calculator with
    the same ``dims`` (at least one) first, and three operand addresses after it."""
    calc = _calc_size(3)
    data = _align(calc, 8)
    size = data + 3 * 8 + 2 * 8
    if not _INDEX_COPY.fullmatch(name) or any(len(c) != size for c in chunks):
        return _NONE
    dims = {_calc_dims(c, 0, 3) for c in chunks}
    if len(dims) != 1 or not (d := dims.pop()):
        return _NONE
    if any(not 1 << 16 <= int.from_bytes(c[p:p + 8], "little") < 1 << 57
           for c in chunks for p in range(data, data + 24, 8)):
        return _NONE  # not operand addresses
    return frozenset(_calc_unread(0, d, 3) | set(range(calc, data)))


# ``arange`` and ``range``: ``elementwise_kernel_with_index<index_t>(index_t N, lambda,
# result_t* data)``, the lambda a ``[xstart, xstep] GPU_LAMBDA`` (host and device), which nvcc
# passes as an ``__nv_hdl_wrapper_t``: the two captures (the accumulate type: 4 or 8 bytes
# each), then ``void* data``, the host's heap copy of the lambda, which only host calls use (as
# a nocast lambda's). Seen on the H100 in HF Llama's decode step: a heap address at byte 16 of
# the 24-byte lambda, another in every layer's capture.
_ARANGE = re.compile(r"_ZN\d+_GLOBAL__N__\w+?_RangeFactories_cu_\w+?29elementwise_kernel_with_"
                     r"indexI[ijl]ZZZN2at6native(?:15arange|14range)_cuda_outERKN3c106ScalarES6_"
                     r"S6_RNS1_6TensorEENKUlvE_clEvENKUlvE\d*_clEvEUllE_EEvT_T0_PN15function_"
                     r"traitsISD_E11result_typeE")


def arange_unread(name: str, chunks) -> frozenset[int]:
    """Byte positions of an ``arange``/``range`` lambda its kernel never reads: the address of
    its host copy, its last 8 bytes. Every capture must be 16 or 24 bytes (two captures of 4
    or 8 bytes, then the address) and hold an aligned address there."""
    size = len(chunks[0])
    if not _ARANGE.fullmatch(name) or size not in (16, 24) \
            or any(len(c) != size for c in chunks) \
            or any(not _host_copy(int.from_bytes(c[-8:], "little")) for c in chunks):
        return _NONE
    return frozenset(range(size - 8, size))


# Host-device lambdas (``GPU_LAMBDA``) that capture nothing, where the op's source shows every
# lambda of the function to be one, or to capture something (then it is larger): nvcc passes
# such a lambda as an ``__nv_hdl_wrapper_t`` holding only ``void* data``, the host's heap copy,
# which the device never reads. ``where`` (``[=] GPU_LAMBDA (bool, scalar_t, scalar_t)``, no
# capture used) and ``pow`` by 2, 3 or -2 (``pow_tensor_scalar_kernel_impl``: captureless
# lambdas of 8 bytes; the general one captures the exponent, 16 bytes). Seen on the H100 in HF
# Llama's RMSNorm (``pow(2)``, a vectorized launch: its 8-byte lambda argument a heap address)
# and its mask (``where`` over strided operands: the lambda inside a nocast one, at byte 736 of
# 752), another in some layers' captures.
_VECTORIZED_KERNEL = "_ZN2at6native29vectorized_elementwise_kernel"
_POW_LAMBDA = r"29pow_tensor_scalar_kernel_implI\w+?EEvRNS_18TensorIteratorBaseET0_EUl\w+?E\d*_"
_CAPTURELESS_VECTORIZED = re.compile(
    r"_ZN2at6native29vectorized_elementwise_kernelILi\d+EZN\w+?" + _POW_LAMBDA
    + r"St5arrayIPcLm2EEEEvi\w+")
_CAPTURELESS_NOCAST = re.compile(
    r"_ZN2at6native18elementwise_kernelILi\d+ELi\d+EZNS0_22gpu_kernel_impl_nocastIZ+N(?:\w+?"
    r"17where_kernel_implERNS_14TensorIteratorEE|\w+?" + _POW_LAMBDA + ")")


def captureless_unread(name: str, chunks) -> frozenset[int]:
    """Byte positions of a vectorized kernel's lambda argument its kernel never reads: all 8,
    where the lambda is one of the captureless ``GPU_LAMBDA``s named above and every capture
    holds an aligned address there (its host copy)."""
    if not _CAPTURELESS_VECTORIZED.fullmatch(name) or any(len(c) != 8 for c in chunks) \
            or any(not _host_copy(int.from_bytes(c, "little")) for c in chunks):
        return _NONE
    return frozenset(range(8))
