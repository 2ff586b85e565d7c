"""Review of deb1f4d (``reduce_unread``: bytes of a PyTorch reduction's ``ReduceOp`` argument
past its offset calculators' ``dims`` may differ between layers' captures) and 7448ec0 (a nested
tensor read from outside the arguments runs eagerly with a reason). CPU only: byte images of
``ReduceOp`` for ``plan_rebase``/``reduce_unread``, and the simulated backend (tests/conftest.py)
for nested tensors. GPU side: .ci/review/reduce/ (real captures' bytes, share_graph end to end).

The ``ReduceOp<scalar_t, ops_t, uint32_t, ...>`` image below follows the layout of PyTorch 2.x
(aten/src/ATen/native/cuda/Reduce.cuh, OffsetCalculator.cuh): ops, ident, ``ReduceConfig``
(16 ints: element_size_bytes, num_inputs, num_outputs, step_input, step_output,
ctas_per_output, input_mult[3], output_mult[2], block_width, block_height, num_threads,
vectorize_input (bool + 3 padding bytes), output_vec_size), ``OffsetCalculator<1>`` (404
bytes), ``OffsetCalculator<2>`` (504 bytes), 4 bytes of padding, src, dst[2], acc_buf, cta_buf,
semaphores, base_idx (7 x 8 bytes), accumulate, final_output, noutputs. (The image in
tests/test_reduce_unread.py leaves out ``base_idx``: 1040 bytes instead of 1048. Harmless there.)

Findings (fixed after the review: R1 and R2, the layout is no longer searched for, the
input calculator starts a fixed distance before the struct's end, and ``noutputs`` is checked;
N1, a nested or sparse parameter or buffer makes the calls run eagerly with a reason; their
tests now pass):

- R1 (latent silent wrong value; plan_rebase level): where the reduction's real input
  calculator has ``dims == 0`` (a reduction over size-1 dimensions only: TensorIterator
  coalesces them away, ``num_reduce_dims() == 0``, and the kernel still runs), the real layout is
  rejected (``d_in`` must be >= 1) and the search may take another offset for the calculators:
  ``ReduceConfig``'s own ints ``step_input, step_output, ctas_per_output, input_mult[0]`` are
  ``1, 1, 1, 0`` in that launch (block_width 1) -- "dims 1, IntDivider(1)" -- and any int 0..25
  404 bytes later (an uninitialised entry of the real input calculator, zero or a stale value
  that is stable across captures) completes a "valid" pair. That offset (20) is then the only
  one, and its "tails" cover bytes 36..927 but 424..427: the rest of the config (input_mult,
  output_mult, block_width/height, num_threads, output_vec_size), the real calculators'
  ``dims`` and used entries (output sizes and strides); not src/dst (984 on). A read byte that
  differs there is ignored (not even counted as unproven; the
  static-state families prove only plans with unproven bytes). Other guards (attributes read,
  the bitwise check of each shared layer's first call) make an end-to-end wrong value
  unlikely: found at the byte level only.
- R2 (refusal-only): the same config ints make offset 24 a "valid" calculator pair in the
  commonest launch, a last-dim reduction without a warp split (HF decode, T=1: step_output 1,
  ctas_per_output 1, input_mult = {1, 0, 0}), whenever the input calculator's uninitialised
  stride entry 13 (byte 428) holds 0..25 alike in every capture: two offsets, nothing is
  recognised, sharing is refused as before the commit.
  Suggested fix for both: do not search. The layout is fixed by the argument's size: the
  output calculator ends 64 bytes (plus 0 or 4 of padding) before the end (src .. noutputs),
  so the input calculator starts at ``len - 972`` or ``len - 976``; take the one of those two
  that is valid (and require ``noutputs`` in {1, 2} at ``len - 4``, ``num_threads ==
  block_width * block_height`` in the config just before it); with ``dims == 0`` for the input
  recognise the layout too (its 25 entries are then all unread but ``strides_[0][0]``, read and
  unused by ``thread_reduce``), or recognise nothing.
- N1 (crash where eager works): a nested tensor (strided or jagged) registered as a buffer or
  a parameter of a graphified module, read by forward or not, raises on the first call:
  ``Statics.rescan``'s ``_layout`` reads ``t.shape`` ("NestedTensorImpl doesn't support sizes")
  and, for a jagged one, ``Statics.storage_ptrs`` reads ``untyped_storage().data_ptr()``
  ("invalid python storage"). Pre-existing, and a sparse buffer raises the same way
  ("Cannot access data pointer of Tensor that doesn't have storage"). 7448ec0's reason for a
  nested attribute advises "register it as a buffer or pass it in": the first crashes, the
  second runs eagerly too ("nested tensors are not supported"). Suggested fix: where
  ``Statics`` collects the tensors, ``_no_address(t)`` (from _guards) marks the module's
  signature unguardable with a reason (run eagerly), as an attribute of that kind does; and
  say so in the attribute reason instead of "register it as a buffer".
"""

from __future__ import annotations

import random
import struct
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify._cugraph import GraphNode
from cudagraphify._unread import reduce_unread
from cudagraphify._share import Refused, Storages, plan_rebase

MEAN = ("_ZN2at6native13reduce_kernelILi512ELi1ENS0_8ReduceOpIfNS0_7MeanOpsIffffEEjfLi4ELi4EEE"
        "EEvT1_")
A = Storages(((0x7F0000010000, 0x400),))  # a layer's weight
B = Storages(((0x7F0000050000, 0x400),))
POOL = [(0x7F0000900000, 0x10000)]
IN_AT = 72  # MeanOps<float> (4 bytes) + ident (4) + ReduceConfig (64)
SIZE1, SIZE2 = 4 + 25 * 16, 4 + 25 * 20
OUT_AT = IN_AT + SIZE1
SRC_AT = OUT_AT + SIZE2 + 4  # 984 (8-aligned)
SIZE = SRC_AT + 7 * 8 + 8  # 1048


def divider(d):
    shift = next(s for s in range(33) if (1 << s) >= d)
    return d, (2 ** 32 * (2 ** shift - d)) // d + 1, shift


# ReduceConfig ints as setReduceConfig makes them (see the docstring for the order); the word at
# index 14 is vectorize_input's bool and its 3 padding bytes (host garbage).
DECODE = [4, 4096, 1, 512, 1, 1, 1, 0, 0, 0, 1, 512, 1, 512, 0x1, 1]  # mean of (1, 4096), T=1
# mean over a size-1 dim of a (4, 1) tensor: num_reduce_dims() == 0, vectorised along the output
# (output_vec_size 4, block 1x1), step_output = block_width * block_height = 1
SIZE1_DIM = [4, 1, 4, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1, 0x7F5A00, 4]


def reduce_op(config, in_dims, out_dims, *, src=0x7F0000900000, dst=0x7F0000900800,
              tail_seed=0, words=None):
    """A ReduceOp<float, MeanOps, uint32_t, float>'s bytes. ``in_dims``: (size, stride) per
    used dimension, ``out_dims``: (size, stride0, stride1). The calculators' unused entries hold
    random bytes from ``tail_seed`` (0: zeros), then ``words`` ({byte offset: uint32}, stable
    host garbage) is written over them."""
    rng = random.Random(tail_seed)
    b = bytearray(rng.randrange(256) for _ in range(SIZE)) if tail_seed else bytearray(SIZE)
    b[0:IN_AT] = struct.pack("<ff", 1 / 4096, 0.0) + struct.pack("<16I", *config)
    for at, dims, nargs in ((IN_AT, in_dims, 1), (OUT_AT, out_dims, 2)):
        b[at:at + 4] = struct.pack("<i", len(dims))
        for k, d in enumerate(dims):
            b[at + 4 + 12 * k:at + 16 + 12 * k] = struct.pack("<III", *divider(d[0]))
            p = at + 304 + 4 * nargs * k
            b[p:p + 4 * nargs] = struct.pack(f"<{nargs}I", *d[1:])
    b[OUT_AT + SIZE2:SRC_AT] = bytes(4)
    b[SRC_AT:] = struct.pack("<7q", src, dst, 0, 0, 0, 0, 0) + struct.pack("<??xxi", 0, 1, 1)
    for at, v in (words or {}).items():
        b[at:at + 4] = struct.pack("<I", v)
    return bytes(b)


def truly_unread(d_in, d_out):
    """What the kernel never reads (OffsetCalculator::get breaks at dims; thread_reduce reads
    input_calc.strides_[0][0] whatever dims is)."""
    out = set()
    for at, dims, nargs in ((IN_AT, d_in, 1), (OUT_AT, d_out, 2)):
        out.update(range(at + 4 + 12 * dims, at + 304))
        out.update(range(at + 304 + 4 * nargs * dims, at + 304 + 4 * nargs * 25))
    out -= set(range(IN_AT + 304, IN_AT + 308))
    # padding (never read; recognised since this review): after vectorize_input's bool, before
    # src, before noutputs
    out |= {IN_AT - 7, IN_AT - 6, IN_AT - 5} | set(range(OUT_AT + SIZE2, SRC_AT)) \
        | {SIZE - 6, SIZE - 5}
    return frozenset(out)


def node(arg):
    return GraphNode(0, (0, MEAN, (len(arg),)), [arg], MEAN, "params")


def diff(a, b, again=None):
    return plan_rebase([node(a)], [node(b)], frozenset(), frozenset(), A, B, POOL,
                       None if again is None else [node(again)])


# -- controls: the real layout ----------------------------------------------------------------

def test_layout_image_is_pytorchs():
    assert SIZE == 1048 and SRC_AT == 984 and OUT_AT == 476


def test_decode_mean_tails_that_differ_share():
    # tails random in each capture (byte 428 too): only offset 72 is a calculator pair
    a = reduce_op(DECODE, [(4096, 4)], [(1, 4, 16384)], tail_seed=1)
    b = reduce_op(DECODE, [(4096, 4)], [(1, 4, 16384)], tail_seed=2)
    assert reduce_unread(MEAN, [a, b]) == truly_unread(1, 1)
    plan = diff(a, b)
    assert plan.unproven == 0 and plan.count == 0


def test_used_bytes_that_differ_still_refuse():
    a = reduce_op(DECODE, [(4096, 4)], [(8, 4, 16384)], tail_seed=1)
    b = reduce_op(DECODE, [(4096, 4)], [(8, 8, 16384)], tail_seed=2)  # an output stride
    with pytest.raises(Refused, match="not a rebased"):
        diff(a, b)
    b = reduce_op(DECODE, [(4096, 4)], [(8, 4, 16384)], tail_seed=2, src=0x7E0000000000)
    with pytest.raises(Refused, match="not a rebased"):  # src: memory of no layer's
        diff(a, b)


@pytest.mark.parametrize("seed", range(40))
def test_with_a_used_input_dimension_nothing_read_is_taken_for_unread(seed):
    # random real calculators (d_in >= 1), tails random or holding stale calculator images
    rng = random.Random(seed)
    d_in, d_out = rng.randint(1, 6), rng.randint(0, 6)
    ins = [(rng.choice([1, 2, 3, 7, 64, 4096]), rng.randrange(1 << 20)) for _ in range(d_in)]
    outs = [(rng.choice([1, 2, 5, 16, 1000]), rng.randrange(1 << 20), rng.randrange(1 << 20))
            for _ in range(d_out)]
    stale = {}
    for _ in range(rng.randint(0, 6)):  # stale dims/IntDivider images in the tails
        at = rng.choice(sorted(truly_unread(d_in, d_out)))
        at -= at % 4
        d = rng.choice([1, 2, 4, 9])
        for k, v in enumerate((rng.randint(0, 3), *divider(d))):
            stale[at + 4 * k] = v
    stale = {k: v for k, v in stale.items() if k + 4 <= SIZE
             and set(range(k, k + 4)) <= truly_unread(d_in, d_out)}
    caps = [reduce_op(DECODE, ins, outs, tail_seed=rng.choice([0, s]), words=stale)
            for s in (1, 2, 3)]
    assert reduce_unread(MEAN, caps) <= truly_unread(d_in, d_out)


def test_unrecognised_input_calculator_without_a_stand_in_recognises_nothing():
    a = reduce_op(SIZE1_DIM, [], [(4, 4, 4)], tail_seed=1)
    b = reduce_op(SIZE1_DIM, [], [(4, 4, 4)], tail_seed=2)
    assert reduce_unread(MEAN, [a, b]) == frozenset()


# -- R1: a reduction over size-1 dimensions (input calculator dims 0) -------------------------

def _size1_pair(**kw):
    # host garbage: stable across captures except byte 120 (an entry of the input calculator
    # nobody reads, the kind of byte that differed in HF Llama's captures); byte 424 (input
    # stride entry 12) is 0 in both, as zeroed or stale stack often is
    a = reduce_op(SIZE1_DIM, [], [(4, 4, 4)], words={120: 0x11})
    b = reduce_op(SIZE1_DIM, [], [(4, 4, 4)], words={120: 0x22}, **kw)
    return a, b


def test_r1_size1_reduction_nothing_read_is_taken_for_unread():
    a, b = _size1_pair()
    found = reduce_unread(MEAN, [a, b])
    assert found <= truly_unread(0, 1), sorted(found - truly_unread(0, 1))[:8]


def test_r1_differing_output_stride_refuses():
    a, _ = _size1_pair()
    b = reduce_op(SIZE1_DIM, [], [(4, 8, 4)], words={120: 0x22})
    with pytest.raises(Refused):
        diff(a, b)


def test_r1_differing_config_refuses():
    a, _ = _size1_pair()
    cfg = list(SIZE1_DIM)
    cfg[11] = 2  # block_width
    b = reduce_op(cfg, [], [(4, 4, 4)], words={120: 0x22})
    with pytest.raises(Refused):
        diff(a, b)


def test_r1_src_and_dst_stay_outside_the_wrong_tails():
    a, b = _size1_pair(src=0x7E0000000000)
    assert all(p < SRC_AT for p in reduce_unread(MEAN, [a, b]))
    with pytest.raises(Refused, match="not a rebased"):
        diff(a, b)


def test_r1_control_the_same_with_a_used_input_dimension_refuses():
    cfg = list(SIZE1_DIM)
    a = reduce_op(cfg, [(1, 4)], [(4, 4, 4)], words={120: 0x11})
    cfg[11] = 2
    b = reduce_op(cfg, [(1, 4)], [(4, 4, 4)], words={120: 0x22})
    with pytest.raises(Refused, match="not a rebased"):
        diff(a, b)


# -- R2: the config's ints as a second candidate (refusal only) -------------------------------

def test_r2_decode_mean_with_a_stable_zero_at_428_shares():
    a = reduce_op(DECODE, [(4096, 4)], [(1, 4, 16384)], tail_seed=1, words={428: 0})
    b = reduce_op(DECODE, [(4096, 4)], [(1, 4, 16384)], tail_seed=2, words={428: 0})
    assert reduce_unread(MEAN, [a, b]) == truly_unread(1, 1)
    diff(a, b)


# -- nested tensors (7448ec0) -----------------------------------------------------------------

def _nt(layout):
    return torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 4)], layout=layout)


LAYOUTS = [pytest.param(torch.strided, id="strided"), pytest.param(torch.jagged, id="jagged")]


@pytest.fixture(autouse=True)
def _no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _same_as_eager(make, call, n=3, probe="auto"):
    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)
    m = make()
    g = cg.graphify(m, probe=probe)
    with torch.no_grad():
        for i in range(n):
            args = call(i)
            assert torch.equal(g(*args), ref(*args))
    return cg.stats(g)


class _NestedBuffer(nn.Module):
    def __init__(self, layout, read=True, as_parameter=False):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        t = _nt(layout)
        if as_parameter:
            self.t = nn.Parameter(t, requires_grad=False)
        else:
            self.register_buffer("t", t)
        self.read = read

    def forward(self, x):
        y = self.lin(x)
        return y * self.t.unbind()[1].sum() if self.read else y


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("probe", ["auto", False])
def test_n1_nested_buffer_read_runs_as_eager(sim, layout, probe):
    s = _same_as_eager(lambda: _NestedBuffer(layout), lambda i: (torch.randn(2, 4),),
                       probe=probe)
    assert s.captures == 0 and list(s.eager_calls.values()) == [3], s.eager_calls
    assert "'t' of a _NestedBuffer is a nested tensor" in next(iter(s.eager_calls))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_n1_nested_buffer_unread_runs(sim, layout):
    # (eagerly too: what forward reads is known only after a run; a module's own tensors are
    # all guarded)
    s = _same_as_eager(lambda: _NestedBuffer(layout, read=False), lambda i: (torch.randn(2, 4),))
    assert s.captures == 0 and "nested tensor" in next(iter(s.eager_calls)), s.eager_calls


@pytest.mark.parametrize("layout", LAYOUTS)
def test_n1_nested_parameter_runs_as_eager(sim, layout):
    s = _same_as_eager(lambda: _NestedBuffer(layout, as_parameter=True),
                       lambda i: (torch.randn(2, 4),))
    assert s.captures == 0 and "nested tensor" in next(iter(s.eager_calls)), s.eager_calls


def test_n1_sparse_buffer_runs_as_eager(sim):
    class Sparse(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("s", torch.eye(4).to_sparse())

        def forward(self, x):
            return self.lin(x) @ self.s

    s = _same_as_eager(Sparse, lambda i: (torch.randn(2, 4),))
    assert s.captures == 0 and "'s' of a Sparse is a sparse_coo tensor" in next(
        iter(s.eager_calls)), s.eager_calls


def test_n1_nested_buffer_of_a_module_a_graphed_function_runs(sim):
    # (adopted in the first call's warm-up: the screen sends it eagerly)
    torch.manual_seed(0)
    m = _NestedBuffer(torch.strided)
    g = cg.graphify(lambda x: m(x) + 1)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 4)
            assert torch.equal(g(x), m(x) + 1)
    s = cg.stats(g)
    assert s.captures == 0 and any("nested tensor" in r for r in s.eager_calls), s.eager_calls


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("probe", ["auto", False])
def test_nested_attribute_and_closure_run_eagerly_with_the_reason(sim, layout, probe):
    nt = _nt(layout)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.t = nt

        def forward(self, x):
            return x * self.t.unbind()[0].sum()

    for fn in (M(), lambda x: x * nt.unbind()[0].sum()):
        g = cg.graphify(fn, probe=probe)
        with torch.no_grad():
            for _ in range(3):
                x = torch.randn(3)
                assert torch.equal(g(x), x * 8)
        s = cg.stats(g)
        assert s.captures == 0 and s.replays == 0
        assert any("nested" in r for r in s.eager_calls), s.eager_calls


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("wrap", ["plain", "list", "dict"])
def test_nested_arguments_run_eagerly(sim, layout, wrap):
    def fn(x, t):
        t = t[0] if wrap == "list" else t["t"] if wrap == "dict" else t
        return x * t.unbind()[0].sum()

    g = cg.graphify(fn)
    with torch.no_grad():
        for i in range(3):
            x, t = torch.randn(3), _nt(layout) * (i + 1)
            t = [t] if wrap == "list" else {"t": t} if wrap == "dict" else t
            assert torch.equal(g(x, t), fn(x, t))
    s = cg.stats(g)
    assert s.captures == 0 and s.replays == 0, s


def test_strided_nested_output_runs_eagerly(sim):
    def fn(x):
        return torch.nested.as_nested_tensor([x[:2], x[2:]])

    g = cg.graphify(fn)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(5, 4)
            got, want = g(x), fn(x)
            assert all(torch.equal(a, b) for a, b in zip(got.unbind(), want.unbind()))
    assert cg.stats(g).replays == 0


def test_an_output_with_no_storage_of_its_own_is_refused_by_the_output_plan():
    # (a jagged nested tensor returned by forward crashed the first call on the H100 with
    # "Attempted to access the data pointer on an invalid python storage"; the CPU double
    # cannot record its ops, so the output rule is tested alone)
    from cudagraphify._replay import OutputPlanError, output_leaves

    values, offsets = torch.randn(5, 4), torch.tensor([0, 2, 5])
    jagged = torch.nested.nested_tensor_from_jagged(values, offsets)
    with pytest.raises(OutputPlanError, match="no storage of its own"):
        output_leaves((jagged, values), [values, offsets])
    kinds, _ = output_leaves((values * 2, torch.nested.nested_tensor([values])), [values])
    assert [k for k, _ in kinds] == ["tensor", "tensor"]  # a strided nested one has storage
