"""share_graph's diff of two captures: the bytes of a CUDA reduction's argument its kernel
never reads (the tails of its offset calculators, past their ``dims``), which PyTorch leaves
as whatever the host stack held, do not refuse sharing (HF Llama's RMSNorm mean: bytes 176
and 648 of its ReduceOp differed between every two layers' captures, on the H200 and the
H100). Everything else in that argument still must match or be a rebased address."""
import random
import struct

import pytest

from cudagraphify._cugraph import GraphNode
from cudagraphify._unread import _divider, reduce_unread
from cudagraphify._share import Refused, Storages, plan_rebase

MEAN = ("_ZN2at6native13reduce_kernelILi512ELi1ENS0_8ReduceOpIfNS0_7MeanOpsIffffEEjfLi4ELi4EEE"
        "EEvT1_")
A = Storages(((0x7F0000010000, 0x400),))  # a layer's weight
B = Storages(((0x7F0000050000, 0x400),))
POOL = [(0x7F0000900000, 0x10000)]
IN_AT, SIZE1 = 72, 4 + 25 * 16  # where the input calculator starts; its size
OUT_AT = IN_AT + SIZE1


def divider(d):
    """IntDivider<unsigned int>(d) as PyTorch computes it (written out independently)."""
    shift = next(s for s in range(33) if (1 << s) >= d)
    return d, (2 ** 32 * (2 ** shift - d)) // d + 1, shift


def reduce_op(in_dims=((512, 4),), out_dims=((16, 4, 2048),), garbage=0, block_width=32,
              src=0x7F0000900000):
    """A ReduceOp<float, MeanOps, uint32_t, float, 4, 4>'s bytes (1048, as PyTorch 2.13 lays
    it out): its functor, identity and
    config, the input and output offset calculators (used entries from ``in_dims``: (size,
    stride), ``out_dims``: (size, stride0, stride1)), then its pointers and flags. The unused
    tails hold random bytes from ``garbage`` (a seed; 0: zeros)."""
    rng = random.Random(garbage)

    def junk(n):
        return bytes(rng.randrange(256) for _ in range(n)) if garbage else bytes(n)

    head = struct.pack("<ff", 1 / 512, 0.0) + struct.pack("<15i", 4, 512, 16, 1, 1, 1, 1, 0,
                                                           0, 0, 0, block_width, 1, 32, 0) \
        + struct.pack("<i", 4)
    assert len(head) == IN_AT

    def calc(dims, nargs):
        sizes = b"".join(struct.pack("<III", *divider(d[0])) for d in dims) \
            + junk(12 * (25 - len(dims)))
        strides = b"".join(struct.pack(f"<{nargs}I", *d[1:]) for d in dims) \
            + junk(4 * nargs * (25 - len(dims)))
        return struct.pack("<i", len(dims)) + sizes + strides

    # src, dst[2], acc_buf, cta_buf, semaphores, base_idx, accumulate, final_output, noutputs
    tail = struct.pack("<7Q", src, 0x7F0000900800, 0, 0, 0, 0, 0) + struct.pack("<??xxi", 0, 1, 1)
    return head + calc(in_dims, 1) + calc(out_dims, 2) + struct.pack("<I", 0) + tail


def node(arg, name=MEAN):
    return GraphNode(0, (0, name, (len(arg),)), [arg], name, "params")


def diff(a, b, again=None):
    return plan_rebase([node(a)], [node(b)], frozenset(), frozenset(), A, B, POOL,
                       None if again is None else [node(again)])


def test_the_dividers_pytorch_makes():
    assert divider(1) == (1, 1, 0) and divider(512) == (512, 1, 9)
    assert divider(3) == (3, 1431655766, 2)
    for d in (1, 2, 3, 7, 16, 100, 512, 1000, 4096, 65537, 0x7FFFFFFF):
        assert _divider(*divider(d))
    assert not _divider(512, 2, 9) and not _divider(512, 1, 8) and not _divider(0, 1, 0)


def test_the_bytes_that_differed_on_the_h100_are_unread():
    unread = reduce_unread(MEAN, [reduce_op(garbage=1), reduce_op(garbage=2)])
    assert set(range(176, 184)) <= unread and set(range(648, 656)) <= unread
    # and the struct's padding: after the config's vectorize_input bool (byte 64), before src
    # (980..983), after the two flag bools (1040, 1041)
    padding = {65, 66, 67, 980, 981, 982, 983, 1042, 1043}
    assert padding <= unread
    # the used entries, the dims, the head and the pointers are not
    used = set(range(IN_AT, IN_AT + 16)) | set(range(OUT_AT, OUT_AT + 16)) \
        | set(range(IN_AT + 304, IN_AT + 308)) | set(range(OUT_AT + 304, OUT_AT + 312)) \
        | set(range(IN_AT)) | set(range(OUT_AT + 504, len(reduce_op())))
    assert not (used - padding) & unread
    assert len(unread) == (300 - 12 + 100 - 4) + (300 - 12 + 200 - 8) + len(padding)


def test_padding_is_taken_for_unread_only_where_the_fields_around_it_are_what_they_must_be():
    a = bytearray(reduce_op(garbage=1))
    a[64] = 7  # not a bool: vectorize_input is not where it was taken to be
    unread = reduce_unread(MEAN, [bytes(a), reduce_op(garbage=2)])
    assert unread and not {65, 66, 67} & unread and {1042, 1043} <= unread
    b = bytearray(reduce_op(garbage=1))
    b[1041] = 2  # final_output is a bool
    unread = reduce_unread(MEAN, [reduce_op(garbage=2), bytes(b)])
    assert unread and not {1042, 1043} & unread and {65, 66, 67} <= unread


def test_layers_whose_reductions_differ_only_in_the_tails_share():
    plan = diff(reduce_op(garbage=1), reduce_op(garbage=2), again=reduce_op(garbage=1))
    assert plan.unproven == 0 and plan.count == 0


@pytest.mark.parametrize("in_dims, out_dims", [
    (((512, 4),), ()),  # a full reduction: no output dimension
    (((8, 4), (64, 32)), ((16, 4, 2048), (3, 64, 8192))),
])
def test_other_shapes_of_calculators(in_dims, out_dims):
    a, b = reduce_op(in_dims, out_dims, garbage=3), reduce_op(in_dims, out_dims, garbage=4)
    assert diff(a, b).unproven == 0


def test_a_used_entry_that_differs_refuses():
    a = reduce_op(((512, 4),), garbage=1)
    b = reduce_op(((512, 8),), garbage=1)  # the input stride: read by the kernel
    with pytest.raises(Refused, match="not a rebased"):
        diff(a, b)
    with pytest.raises(Refused, match="not a rebased"):  # the config
        diff(reduce_op(garbage=1), reduce_op(garbage=1, block_width=16))


def test_nothing_is_taken_for_unread_where_the_layout_is_not_recognised():
    a, b = reduce_op(garbage=1), reduce_op(garbage=2)
    with pytest.raises(Refused, match="not a rebased"):  # another kernel
        plan_rebase([node(a, "_ZN2at6native18elementwise_kernel")],
                    [node(b, "_ZN2at6native18elementwise_kernel")], frozenset(), frozenset(),
                    A, B, POOL)
    # the captures disagree on the dims (a layout that is not one)
    c = reduce_op(((512, 4), (2, 2048)), garbage=2)
    assert reduce_unread(MEAN, [a, c]) == frozenset()
    with pytest.raises(Refused):
        diff(a, c)
    # a dims that cannot be, or a divider that is not one: not a calculator
    bad = bytearray(a)
    bad[IN_AT:IN_AT + 4] = struct.pack("<i", 26)
    assert reduce_unread(MEAN, [bytes(bad), b]) == frozenset()
    bad = bytearray(a)
    bad[IN_AT + 8:IN_AT + 12] = struct.pack("<I", 2)  # m1 of 512 is 1
    assert reduce_unread(MEAN, [bytes(bad), b]) == frozenset()
    assert reduce_unread(MEAN, [a[:600], b[:600]]) == frozenset()  # too short for both


def test_a_parameter_address_in_the_struct_is_still_rebased():
    a = reduce_op(garbage=1, src=0x7F0000010000 + 64)
    b = reduce_op(garbage=2, src=0x7F0000050000 + 64)
    plan = diff(a, b, again=a)
    assert plan.count == 1 and plan.slots == {0: {0: [(OUT_AT + 504 + 4, 0, 64)]}}
