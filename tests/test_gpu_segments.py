"""Segments on CUDA (experimental, cudagraphify._segrun): bitwise equal to eager, replays
counted, and work the mode cannot see (a Triton kernel launched directly) refuses them."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify.bench.models import GPT

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("segments_enabled")]


def _graphed(m):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cg.graphify(copy.deepcopy(m))


def _plans(g):
    return g._cudagraphify_state.segments.plans()


@pytest.mark.parametrize("sync", ["item", "item-inline"])
def test_sync_blocks_replay_their_segments_bitwise(sync):
    torch.manual_seed(0)
    m = GPT(256, 4, 4, sync=sync).cuda().eval()
    g = _graphed(m)
    xs = [torch.randn(2, 16, 256, device="cuda") for _ in range(5)]
    with torch.no_grad():
        kept = [g(x) for x in xs]  # (the caller keeps every output)
        for x, y in zip(xs, kept):
            assert torch.equal(y, m(x))
    s = cg.stats(g)
    (plan,) = _plans(g)
    assert plan.unseen is None, plan.unseen
    # (call 1 is probed, call 2 recorded, calls 3-5 replay the five segments)
    assert (s.segments, s.segment_replays) == (5, 3 * 5), plan.describe()
    assert plan.divergences == 0
    # each block's submodules (and ln_f) answered whole at their calls in every replayed call
    names = sorted(type(m.module).__name__ for ms in plan.members.values() for m in ms)
    per_block = ["Attention", "LayerNorm", "LayerNorm", "MLP"] if sync == "item" else \
        ["LayerNorm", "LayerNorm", "Linear", "Linear", "Linear", "Linear"]
    assert names == sorted(per_block * 4 + ["LayerNorm"]), plan.describe()
    assert plan.whole == 3 * len(names)


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x):
        h = self.a(x).relu()
        if h.sum().item() > 0:
            return self.b(h) * 2 + 1
        return self.b(h).neg() - 1


def test_a_call_that_goes_another_way_is_eagers():
    torch.manual_seed(0)
    m = _Branchy().cuda().eval()
    g = _graphed(m)
    x = torch.ones(4, 64, device="cuda")
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(g(x), m(x))
        (plan,) = _plans(g)
        assert plan.replays > 0 and plan.divergences == 0
        m.a.bias.fill_(-100.0)
        g.a.bias.fill_(-100.0)
        assert torch.equal(g(x), m(x))
        assert plan.divergences == 1


def test_a_triton_kernel_called_directly_keeps_every_call_eager():
    triton = pytest.importorskip("triton")
    tl = pytest.importorskip("triton.language")

    @triton.jit
    def double(src, dst, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + i, tl.load(src + i, mask=i < n) * 2, mask=i < n)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x):
            h = self.lin(x).relu() + 1
            out = torch.empty_like(h)
            double[(1,)](h, out, h.numel(), BLOCK=1024)  # not a torch call
            y = out * 3 - 1
            return y if y.sum().item() > -1e30 else y

    torch.manual_seed(0)
    m = M().cuda().eval()
    g = _graphed(m)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 64, device="cuda")
            assert torch.equal(g(x), m(x))
    (plan,) = _plans(g)
    assert plan.unseen is not None and "outside every torch call" in plan.unseen
    assert cg.stats(g).segment_replays == 0
    # recorded once (under the profiler): the later calls run without segments at once
    assert [item[2] for item in g._cudagraphify_state.segments._plans.values()] == [1]


def test_generate_with_a_dynamic_cache_graphs_the_runs_around_the_growing_attention():
    # graphify(model, segments=True) and HF generate() with its DynamicCache: tokens as
    # eager's; the cache's cat and the attention over it run eagerly, the runs between graphed
    transformers = pytest.importorskip("transformers")
    from cudagraphify import _segrun
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256)
    m = transformers.LlamaForCausalLM(config).cuda().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = cg.graphify(copy.deepcopy(m), segments=True)
    ids = torch.randint(0, 128, (1, 7), device="cuda")
    greedy = dict(max_new_tokens=24, do_sample=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = m.generate(ids, **greedy)
        for _ in range(2):
            assert torch.equal(g.generate(ids, **greedy), want)
    (plan,) = _plans(g)
    assert plan.unseen is None, plan.unseen
    refused = [seg.refused for seg in plan.segments]
    assert refused.count(_segrun.VARYING) >= 6, plan.describe()
    assert cg.stats(g).segments > 0 and plan.replays > 20, plan.describe()



class _LateInput(nn.Module):
    """A segment whose last copied input (``y``) comes after GPU-heavy members, then members
    that read only the graph's outputs (the replay launches at ``+ y``: see _Segment.launch);
    then a boundary, and a segment whose last call reads its host value (it diverges when the
    value changes, after that segment's replay launched at its first call)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(1024, 1024)
        self.b = nn.Linear(1024, 1024)

    def forward(self, x, y):
        top = x.amax()
        h = x
        for _ in range(4):
            h = self.a(h).tanh()
        h = h + y
        for _ in range(4):
            h = self.b(h).sigmoid()
        n = 1.0 if top.item() < 100 else 0.5
        return self.b(h) * 2 + n


def test_a_segment_replayed_at_its_last_copied_input_is_eagers(device="cuda"):
    torch.manual_seed(0)
    m = _LateInput().to(device).eval()
    g = _graphed(m)
    inputs = [(torch.randn(64, 1024, device=device), torch.randn(64, 1024, device=device))
              for _ in range(6)]
    with torch.no_grad():
        kept = [g(x, y) for x, y in inputs]  # (every input new; every output kept)
        for (x, y), got in zip(inputs, kept):
            assert torch.equal(got, m(x, y))
        (plan,) = _plans(g)
        first, last = plan.segments
        assert first.graph is not None and first.first < first.launch < first.last, \
            plan.describe()
        assert last.graph is not None and last.launch == last.first, plan.describe()
        replays, divergences = plan.replays, plan.divergences
        assert divergences == 0 and replays == 2 * 4, plan.describe()
        # the host value changes: the last segment's ``+ 0.5`` diverges after its replay
        # launched; eager's result all the same
        x = inputs[0][0].clone()
        x[3, 5] = 1000.0
        assert torch.equal(g(x, inputs[0][1]), m(x, inputs[0][1]))
        assert plan.divergences == 1 and plan.replays == replays + 2


_READY: list = [None]  # the event the forward waits for (a global: no guard reads it)


class _Prefetched(nn.Module):
    """``w`` is written on another stream before each call (a prefetch that lands late); the
    forward waits for it (``wait_event``, which no mode sees) between two calls of a segment,
    after its only copied input."""

    def __init__(self, d=256):
        super().__init__()
        self.s = nn.Parameter(torch.randn(d))
        self.w = nn.Parameter(torch.randn(d))

    def forward(self, x):
        h = (x * self.s).relu()  # (x: the segment's only copied input)
        h = h * 2 + 1
        torch.cuda.current_stream().wait_event(_READY[0])
        o = h * self.w  # (reads w after the wait)
        return o * (1.0 if o.abs().amax().item() < 1e30 else 0.5)


def test_a_wait_between_calls_of_a_segment_comes_before_its_replay():
    torch.manual_seed(0)
    m = _Prefetched().cuda().eval()
    g = _graphed(m)
    side = torch.cuda.Stream()
    ws = [torch.randn(256, device="cuda") for _ in range(6)]
    xs = [torch.randn(4, 256, device="cuda") for _ in range(6)]
    outs = {}
    with torch.no_grad():
        for model, key in ((g, "graphed"), (m, "eager")):
            _READY[0] = ready = torch.cuda.Event()
            got = []
            for w, x in zip(ws, xs):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    torch.cuda._sleep(50_000_000)  # (the write lands late)
                    model.w.copy_(w)
                    ready.record(side)
                got.append(model(x))
            outs[key] = got
    for a, b in zip(outs["graphed"], outs["eager"]):
        assert torch.equal(a, b)
    (plan,) = _plans(g)
    # the record's profile showed the waits (the canary's and the forward's)
    assert plan.waits is not None, "the profiler does not report stream waits"
    (seg,) = [s for s in plan.segments if s.graph is not None]
    reader = next(i for i in seg.calls if i in plan.waits)
    assert plan.calls[reader - 1].name.endswith("add") and seg.launch == reader, \
        (plan.waits, seg.launch, plan.describe())
    assert plan.replays >= 3 and plan.divergences == 0, plan.describe()
