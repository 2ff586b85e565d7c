"""Review of eed2309 (captureless host-device lambdas of ``where`` and ``pow`` by 2/3/-2: their
8 bytes, nvcc's host-copy address, declared unread in a vectorized launch and inside a nocast
lambda).

What the rule rests on, pinned here in bytes (CPU only):

* every lambda of ``pow_tensor_scalar_kernel_impl`` and ``where_kernel_impl`` is a
  ``[=] GPU_LAMBDA`` (``__host__ __device__``), so nvcc passes it as an ``__nv_hdl_wrapper_t``:
  its captures, then ``void* data``. Only the general pow lambda captures (the exponent, of
  1 to 8 bytes), and its wrapper is then at least 16 bytes: an 8-byte argument, or an 8-byte
  functor slot in a nocast lambda (tail 16), is a captureless one;
* a captureless lambda nvcc turned into a function pointer (``HasFuncPtrConv``) is an empty
  struct, 1 byte: refused in a vectorized launch (not 8 bytes); inside a nocast lambda it is
  the slot's byte 0 and 7 bytes of padding, none of them read;
* nothing else matches: other pow impls (tensor-tensor, scalar-tensor capturing its base,
  complex), ``where`` launched vectorized or from the 1.x signature, functor structs
  (``WhereFunctor``, ``PowImplUnaryFunctor1``), jitted kernels.

A failing test is a bug found: its assertion states the correct behaviour."""

from __future__ import annotations

import struct

import pytest

from cudagraphify._share import Refused
from cudagraphify._unread import captureless_unread, nocast_unread, unread_bytes
from test_kernel_unread import POW2, WHERE, diff, lam, n_arg, node

HOST = (0x649AE1A0, 0x6489EA30, 0x5D1C2E80)  # heap addresses as seen on the H100
NS = "51_GLOBAL__N__b1108092_12_PowKernel_cu_751192d7_21396"


def pow_vec(targs="ff", param="f", n=""):
    """``vectorized_elementwise_kernel<4, lambda #n of pow_tensor_scalar_kernel_impl<targs>,
    std::array<char*, 2>>``."""
    return ("_ZN2at6native29vectorized_elementwise_kernelILi4EZNS0_" + NS
            + f"29pow_tensor_scalar_kernel_implI{targs}EEvRNS_18TensorIteratorBaseET0_EUl{param}E"
            + f"{n}_St5arrayIPcLm2EEEEviS6_T1_")


def pow_nocast(targs="ff", param="f", n=""):
    return ("_ZN2at6native18elementwise_kernelILi128ELi2EZNS0_22gpu_kernel_impl_nocastIZNS0_" + NS
            + f"29pow_tensor_scalar_kernel_implI{targs}EEvRNS_18TensorIteratorBaseET0_EUl{param}E"
            + f"{n}_EEvS6_RKT_EUliE_EEviT1_")


def kept_apart(*args, **kw) -> bool:
    """Whether the diff refuses, or counts unproven bytes: the differing bytes were read."""
    try:
        return diff(*args, **kw).unproven > 0
    except Refused:
        return True


def q(v):
    return struct.pack("<Q", v)


UNARY = dict(dims=((32, 2, 2), (128, 64, 128)), data=(0x7F0000900000, 0x7F0000900400))
FUNCTOR = 504 + 16  # OffsetCalculator<2> (504 bytes, 8-aligned), two operand addresses


# -- 1. the general pow lambda captures the exponent: 16 bytes whatever its type ---------------

@pytest.mark.parametrize("n", ["", "0", "1", "2"])  # the four lambdas: 2, 3, -2, general
@pytest.mark.parametrize("targs,param", [("ff", "f"), ("dd", "d"), ("hh", "h"), ("ll", "l"),
                                         ("N3c104HalfES3_", "S3_"),
                                         ("N3c108BFloat16ES3_", "S3_")])
def test_every_lambda_of_the_impl_is_decided_by_its_size_alone(n, targs, param):
    """The regex takes any of the four lambdas (it cannot tell them apart); only 8 bytes
    are taken, and the exponent-capturing one is 16 for every exponent type."""
    name = pow_vec(targs, param, n)
    eight = [q(v) for v in HOST[:2]]
    assert captureless_unread(name, eight) == frozenset(range(8))
    for fmt in ("<B7xQ", "<H6xQ", "<f4xQ", "<dQ", "<qQ"):  # exp (uint8 .. 8 bytes), host copy
        exp = 8.0 if fmt[1] in "fd" else 8
        chunks = [struct.pack(fmt, exp, v) for v in HOST[:2]]
        assert len(chunks[0]) == 16
        assert captureless_unread(name, chunks) == frozenset()
        assert unread_bytes(node((struct.pack("<i", 512), chunks[0], bytes(16)), name), 1,
                            chunks) == frozenset()


def test_an_exponent_that_looks_like_a_host_address_is_still_read():
    """pow(x, 8) and pow(x, 16) over int64: the captured exponents are 8-aligned and small,
    but they sit in a 16-byte wrapper: not taken, and the diff keeps them apart."""
    name = pow_vec("ll", "l", "2")
    a, b = struct.pack("<qQ", 8, HOST[0]), struct.pack("<qQ", 16, HOST[1])
    assert captureless_unread(name, [a, b]) == frozenset()
    args = [(struct.pack("<i", 512), x, struct.pack("<QQ", 0x7F0000900000, 0x7F0000900400))
            for x in (a, b)]
    assert kept_apart(*args, name, again=args[0])


def test_a_function_pointer_wrapper_of_one_byte_is_refused_in_a_vectorized_launch():
    assert captureless_unread(POW2, [b"\0", b"\0"]) == frozenset()
    assert captureless_unread(POW2, [q(HOST[0]) + bytes(8)] * 2) == frozenset()


# -- 2. inside a nocast lambda: tail 16 only ---------------------------------------------------

@pytest.mark.parametrize("fmt", ["<B7xQ", "<H6xQ", "<f4xQ", "<dQ", "<qQ"])
def test_a_capturing_pow_lambda_in_a_nocast_one_keeps_its_bytes(fmt):
    name = pow_nocast(n="2")
    exp = 8.0 if fmt[1] in "fd" else 8
    a = lam(garbage=1, functor=struct.pack(fmt, exp, HOST[0]), **UNARY)
    b = lam(garbage=2, functor=struct.pack(fmt, exp * 2, HOST[1]), copy=0x4A2B3C40, **UNARY)
    assert len(a) - FUNCTOR == 24  # its 16 bytes, then the host copy
    unread = nocast_unread(name, [a, b])
    assert unread  # the layout is recognised (the calculator's entries, the host copy)
    assert set(range(FUNCTOR, FUNCTOR + 16)).isdisjoint(unread)
    assert kept_apart(n_arg(a), n_arg(b), name, again=n_arg(a))


@pytest.mark.parametrize("targs,param", [("ff", "f"), ("N3c104HalfES3_", "S3_"),
                                         ("N3c108BFloat16ES3_", "S3_"), ("ll", "l")])
def test_a_captureless_pow_lambda_in_a_nocast_one_is_its_host_copy(targs, param):
    name = pow_nocast(targs, param)
    a = lam(garbage=1, functor=q(HOST[0]), **UNARY)
    b = lam(garbage=2, functor=q(HOST[1]), copy=0x4A2B3C40, **UNARY)
    assert len(a) == 536
    unread = nocast_unread(name, [a, b])
    assert set(range(FUNCTOR, FUNCTOR + 8)) <= unread
    assert set(range(504, FUNCTOR)).isdisjoint(unread)  # the operand addresses are read
    assert diff(n_arg(a), n_arg(b), name, again=n_arg(a)).unproven == 0


def test_an_empty_functor_and_its_padding_are_harmless_to_take():
    """nvcc's function-pointer wrapper (no capture default) is 1 byte: tail 16 too, the slot
    its byte and 7 of padding; taken only where they look like an address, and nothing the
    kernel reads is in it."""
    name = pow_nocast()
    a = lam(garbage=1, functor=b"\0" + bytes(7), **UNARY)
    b = lam(garbage=2, functor=b"\0" + b"\x10" + bytes(6), copy=0x4A2B3C40, **UNARY)
    unread = nocast_unread(name, [a, b])
    assert set(range(504, FUNCTOR)).isdisjoint(unread)
    assert set(range(FUNCTOR, FUNCTOR + 8)).isdisjoint(unread)  # 0 is no address: kept


def test_the_where_lambda_slot_follows_its_four_operands():
    """where: OffsetCalculator<4> (704 bytes), 4 operand addresses, the lambda at 736, the
    host copy at 744; a where lambda 16 bytes long (it would capture) is not taken."""
    dims = ((32, 1, 2, 2, 2), (128, 0, 64, 64, 64))
    data = (0x7F0000900000, 0x7F0000900400, 0x7F0000900800, 0x7F0000900C00)
    a = lam(dims=dims, data=data, garbage=1, functor=struct.pack("<dQ", 8.0, HOST[0]))
    b = lam(dims=dims, data=data, garbage=2, functor=struct.pack("<dQ", 9.0, HOST[1]),
            copy=0x4A2B3C40)
    assert len(a) == 760
    assert set(range(736, 752)).isdisjoint(nocast_unread(WHERE, [a, b]))


# -- 3. what else the two regexes might take ---------------------------------------------------

def test_other_kernels_are_not_taken_as_captureless():
    eight = [q(v) for v in HOST[:2]]
    others = [
        # pow_scalar_tensor_impl captures the base
        POW2.replace("29pow_tensor_scalar_kernel_implIffEEvRNS_18TensorIteratorBaseET0_",
                     "22pow_scalar_tensor_implIfEEvRNS_18TensorIteratorBaseET_"),
        # the complex lambdas of pow_tensor_scalar_kernel (by 2.0, or capturing exp)
        POW2.replace("29pow_tensor_scalar_kernel_implIffEEvRNS_18TensorIteratorBaseET0_EUlfE_",
                     "24pow_tensor_scalar_kernelERNS_18TensorIteratorBaseERKN3c106ScalarEENKUlv"
                     "E_clEvEUlN3c107complexIfEEE_"),
        # 1.x: pow_tensor_scalar_kernel_impl(TensorIterator&, Exp_type)
        POW2.replace("18TensorIteratorBaseET0_", "14TensorIteratorET0_"),
        # a functor struct of the same behaviour (torch-xpu-ops style)
        "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_20PowImplUnaryFunctor1IfEESt5arr"
        "ayIPcLm2EEEEviT0_T1_",
        # a jitted pow
        "pow_kernel_vectorized4_kernel",
    ]
    for name in others:
        assert captureless_unread(name, eight) == frozenset(), name
        assert unread_bytes(node((struct.pack("<i", 512), eight[0], bytes(16)), name), 1,
                            eight) == frozenset(), name


def test_other_nocast_functors_are_not_taken_as_captureless():
    dims = ((32, 1, 2, 2, 2), (128, 0, 64, 64, 64))
    data = (0x7F0000900000, 0x7F0000900400, 0x7F0000900800, 0x7F0000900C00)
    a = lam(dims=dims, data=data, garbage=1, functor=q(HOST[0]))
    b = lam(dims=dims, data=data, garbage=2, functor=q(HOST[1]), copy=0x4A2B3C40)
    slot = set(range(736, 744))
    for name in (
            # 1.x where_kernel_impl(TensorIterator&, ScalarType)
            WHERE.replace("ERNS_14TensorIteratorEENKUlvE_", "ERNS_14TensorIteratorEN3c1010Sc"
                                                            "alarTypeEENKUlvE_"),
            # a functor struct (WhereFunctor): not a lambda local to where_kernel_impl
            "_ZN2at6native18elementwise_kernelILi128ELi4EZNS0_22gpu_kernel_impl_nocastINS0_12W"
            "hereFunctorIN3c108BFloat16EEEEEvRNS_18TensorIteratorBaseERKT_EUliE_EEviT1_"):
        assert slot.isdisjoint(nocast_unread(name, [a, b])), name
    # where launched vectorized (contiguous): four operands, not taken by the pow rule
    vec = POW2.replace(NS + "29pow_tensor_scalar_kernel_implIffEEvRNS_18TensorIteratorBaseET0_"
                       "EUlfE_St5arrayIPcLm2EE",
                       "49_GLOBAL__N__d2ba64fb_16_TensorCompare_cu_71e06f4e17where_kernel_implER"
                       "NS_14TensorIteratorEENKUlvE_clEvENKUlvE1_clEvEUlbN3c108BFloat16ES9_E_St5"
                       "arrayIPcLm4EE")
    assert captureless_unread(vec, [q(v) for v in HOST[:2]]) == frozenset()


def test_only_the_lambda_argument_of_a_vectorized_launch():
    eight = [q(v) for v in HOST[:2]]
    n = node((struct.pack("<i", 512), eight[0], bytes(16)), POW2)
    assert unread_bytes(n, 0, [struct.pack("<i", 512)] * 2) == frozenset()
    assert unread_bytes(n, 2, [bytes(16)] * 2) == frozenset()
    blob = node((struct.pack("<i", 512), eight[0], bytes(16)), POW2)
    blob.form = "blob"
    assert unread_bytes(blob, 1, eight) == frozenset()
    for bad in (1 << 47, HOST[0] + 4, 0):  # not a user-space, aligned, nonzero address
        assert captureless_unread(POW2, [eight[0], q(bad)]) == frozenset()
