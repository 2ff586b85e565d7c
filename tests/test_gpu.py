"""GPU tests: every graphed output compared with eager, counters prove the graph path ran."""

from __future__ import annotations

import copy
import gc
import threading

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify.bench.models import GPT, GPTConfig

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("quiet_gpu")]

DEV = "cuda"



def _gpt(cfg: GPTConfig, seed=0):
    torch.manual_seed(seed)
    return GPT.from_config(cfg, DEV)


def _pair(model):
    """An eager reference and a graphified deep copy of ``model``."""
    return model, cg.graphify(copy.deepcopy(model))


def _five_calls(ref, graphed, make_input):
    for i in range(5):
        x = make_input(i)
        want = ref(x)
        got = graphed(x)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("cfg", [GPTConfig(768, 12, 4, 1, 16, torch.bfloat16),
                                 GPTConfig(256, 4, 6, 1, 8, torch.float32)],
                         ids=["A-bf16", "B-fp32"])
def test_gpt_five_calls_equal_eager_one_capture_four_replays(cfg):
    ref, graphed = _pair(_gpt(cfg))
    with torch.no_grad():
        _five_calls(ref, graphed,
                    lambda i: torch.randn(cfg.batch, cfg.seq, cfg.dim, device=DEV, dtype=cfg.dtype))
    s = cg.stats(graphed)
    assert (s.captures, s.replays, s.eager) == (1, 4, 0), s
    assert s.graph_pool_bytes > 0 and s.capture_seconds > 0


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

    def forward(self, x):
        return self.body(x)


def test_convnet_eval_equals_eager():
    torch.manual_seed(0)
    ref = ConvNet().to(DEV).eval()
    ref, graphed = _pair(ref)
    with torch.no_grad():
        _five_calls(ref, graphed, lambda i: torch.randn(4, 3, 32, 32, device=DEV))
    s = cg.stats(graphed)
    assert (s.captures, s.replays) == (1, 4)


def test_shape_change_captures_again_and_stride_change_is_correct():
    ref, graphed = _pair(_gpt(GPTConfig(128, 4, 2, 1, 8, torch.float32)))
    with torch.no_grad():
        for t in (8, 16, 8, 16):
            x = torch.randn(2, t, 128, device=DEV)
            torch.testing.assert_close(graphed(x), ref(x), rtol=0, atol=0)
        assert cg.stats(graphed).captures == 2
        base = torch.randn(2, 128, 16, device=DEV)
        x_nc = base.transpose(1, 2)  # (2, 16, 128), not contiguous
        assert not x_nc.is_contiguous()
        for _ in range(3):
            base.normal_()
            torch.testing.assert_close(graphed(x_nc), ref(x_nc), rtol=1e-6, atol=1e-6)
    s = cg.stats(graphed)
    assert s.captures == 3 and s.replays == 2 + 2


def test_parameter_changes_recapture_and_stay_correct():
    ref, graphed = _pair(_gpt(GPTConfig(128, 4, 2, 1, 8, torch.float32)))
    x = torch.randn(1, 8, 128, device=DEV)
    with torch.no_grad():
        graphed(x), graphed(x)
        assert cg.stats(graphed).captures == 1

        # model.to(dtype): new parameter storage
        ref.to(torch.bfloat16), graphed.to(torch.bfloat16)
        xb = x.to(torch.bfloat16)
        for _ in range(2):
            torch.testing.assert_close(graphed(xb), ref(xb), rtol=0, atol=0)
        s = cg.stats(graphed)
        assert s.captures == 2 and s.invalidations == 1

        # load_state_dict(assign=True): new Parameter objects
        sd = {k: torch.randn_like(v) for k, v in ref.state_dict().items()}
        ref.load_state_dict(sd, assign=True)
        graphed.load_state_dict({k: v.clone() for k, v in sd.items()}, assign=True)
        for _ in range(2):
            torch.testing.assert_close(graphed(xb), ref(xb), rtol=0, atol=0)
        assert cg.stats(graphed).captures == 3

        # p.data = ...: same Parameter object, new memory
        w = torch.randn_like(ref.blocks[0].mlp.fc.weight)
        ref.blocks[0].mlp.fc.weight.data = w
        graphed.blocks[0].mlp.fc.weight.data = w.clone()
        torch.testing.assert_close(graphed(xb), ref(xb), rtol=0, atol=0)
        assert cg.stats(graphed).captures == 4

        # in-place update (an optimizer step): same memory, the graph stays valid
        with torch.no_grad():
            for p, q in zip(ref.parameters(), graphed.parameters()):
                p.mul_(0.5), q.mul_(0.5)
        torch.testing.assert_close(graphed(xb), ref(xb), rtol=0, atol=0)
        assert cg.stats(graphed).captures == 4


class CacheWriter(nn.Module):
    """Writes into a caller-owned cache in place (like a KV cache), reads it back."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x, cache, pos: int):
        cache[:, pos] = self.lin(x)
        return cache.sum(dim=1)


def test_marked_static_input_is_not_copied_and_updates_in_place():
    torch.manual_seed(0)
    m = CacheWriter().to(DEV)
    graphed = cg.graphify(copy.deepcopy(m))
    cache_ref = torch.zeros(2, 4, 32, device=DEV)
    cache = cg.mark_static(torch.zeros(2, 4, 32, device=DEV))
    with torch.no_grad():
        for step in range(6):
            x = torch.randn(2, 32, device=DEV)
            want = m(x, cache_ref, step % 2)
            got = graphed(x, cache, step % 2)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            torch.testing.assert_close(cache, cache_ref, rtol=0, atol=0)
    s = cg.stats(graphed)
    assert (s.captures, s.replays) == (2, 4)
    # only x is copied in; the cache never is (one copy per replay)
    assert s.input_copies == s.replays


class InPlace(nn.Module):
    def forward(self, x):
        x.add_(1)
        return x, x * 2


def test_inplace_input_mutation_reaches_the_callers_tensor_once():
    graphed = cg.graphify(InPlace())
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(8, device=DEV)
            x0 = x.clone()
            same, doubled = graphed(x)
            torch.testing.assert_close(x, x0 + 1, rtol=0, atol=0)
            assert same is x
            torch.testing.assert_close(doubled, (x0 + 1) * 2, rtol=0, atol=0)
    assert cg.stats(graphed).replays == 3


def test_outputs_are_not_overwritten_by_later_calls():
    ref, graphed = _pair(_gpt(GPTConfig(128, 4, 2, 1, 8, torch.float32)))
    with torch.no_grad():
        xs = [torch.randn(1, 8, 128, device=DEV) for _ in range(4)]
        outs = [graphed(x) for x in xs]
        for x, out in zip(xs, outs):
            torch.testing.assert_close(out, ref(x), rtol=0, atol=0)
        # zero-copy mode: the same static tensor comes back each call
        fast = cg.graphify(copy.deepcopy(ref), copy_outputs=False)
        fast(xs[0]), fast(xs[0])
        a = fast(xs[1])
        b = fast(xs[2])
        assert a.data_ptr() == b.data_ptr()


class Pytree(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, extra=None, *, scale: float = 1.0):
        y = self.lin(x) * scale
        return {"y": y, "pair": (y.sum(), [x.mean()]), "extra": extra, "n": 3}


def test_pytree_arguments_and_outputs():
    torch.manual_seed(0)
    m = Pytree().to(DEV)
    graphed = cg.graphify(copy.deepcopy(m))
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(4, 16, device=DEV)
            want = m(x, extra="tag", scale=2.0)
            got = graphed(x, extra="tag", scale=2.0)
            assert got["extra"] == "tag" and got["n"] == 3
            torch.testing.assert_close(got["y"], want["y"], rtol=0, atol=0)
            torch.testing.assert_close(got["pair"][1][0], want["pair"][1][0], rtol=0, atol=0)
        got = graphed(x, extra="tag", scale=3.0)  # another constant: another graph
        torch.testing.assert_close(got["y"], m(x, scale=3.0)["y"], rtol=0, atol=0)
    s = cg.stats(graphed)
    assert (s.captures, s.replays) == (2, 3)


class _Cols(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, cols):
        return self.lin(x)[:, cols] * 2


def test_slice_arguments_are_keyed_by_value():
    # (a slice of constants is a constant: each slice its own graph, replayed; 2026-12-07)
    torch.manual_seed(0)
    m = _Cols().to(DEV)
    graphed = cg.graphify(copy.deepcopy(m))
    with torch.no_grad():
        for i in range(8):
            x, cols = torch.randn(4, 16, device=DEV), (slice(0, 8), slice(4, 16, 2))[i % 2]
            torch.testing.assert_close(graphed(x, cols), m(x, cols), rtol=0, atol=0)
    s = cg.stats(graphed)
    assert (s.captures, s.replays) == (2, 6) and not s.eager_calls, s


def test_hf_model_output_structure():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_outputs import BaseModelOutput

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return BaseModelOutput(last_hidden_state=self.lin(x))

    m = Wrap().to(DEV)
    g = cg.graphify(copy.deepcopy(m))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 8, device=DEV)
            out = g(x)
            assert isinstance(out, BaseModelOutput)
            torch.testing.assert_close(out.last_hidden_state, m(x).last_hidden_state,
                                       rtol=0, atol=0)
    assert cg.stats(g).replays == 2, transformers.__version__


class ItemModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        y = self.lin(x)
        if y.sum().item() > 0:  # a host sync: cannot be captured
            return y * 2
        return y


def test_item_in_forward_goes_piecewise():
    torch.manual_seed(0)
    m = ItemModule().to(DEV)
    g = cg.graphify(copy.deepcopy(m))
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 16, device=DEV)
            torch.testing.assert_close(g(x), m(x), rtol=0, atol=0)
    (reason,) = cg.stats(g).eager_calls
    assert reason.startswith("piecewise: 1 submodule(s)") and "Tensor.item" in reason
    # (the piece chains in the root's implicit region: its capture call replays too)
    assert (cg.stats(g.lin).captures, cg.stats(g.lin).replays) == (1, 3)


def test_item_in_forward_without_the_probe_fails_capture_cleanly():
    torch.manual_seed(0)
    m = ItemModule().to(DEV)
    g = cg.graphify(copy.deepcopy(m), probe=False)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 16, device=DEV)
            torch.testing.assert_close(g(x), m(x), rtol=0, atol=0)
    s = cg.stats(g)
    assert s.captures == 0 and s.replays == 0
    (reason,) = s.eager_calls
    assert reason.startswith("capture failed") and s.eager_calls[reason] == 4  # every call
    # CUDA is still healthy, the default generator too (a failed capture leaves it in capture mode)
    torch.cuda.synchronize()
    assert (torch.ones(3, device=DEV) * 2).sum().item() == 6
    torch.randn(4, device=DEV)
    torch.nn.functional.dropout(torch.ones(8, device=DEV), 0.5, training=True)
    assert _graph_pool_bytes() == 0  # the failed capture's pool was released


def _graph_pool_bytes() -> int:
    """Bytes reserved by private (graph) memory pools, after freeing what can be freed."""
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    segments = torch.cuda.memory._snapshot()["segments"]
    return sum(s["total_size"] for s in segments if tuple(s["segment_pool_id"]) != (0, 0))


def test_eviction_frees_graph_memory():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).to(DEV)
    g = cg.graphify(m, max_graphs=1)
    assert _graph_pool_bytes() == 0
    with torch.no_grad():
        for b in (512, 1024, 1536, 2048):
            g(torch.randn(b, 1024, device=DEV))
            g(torch.randn(b, 1024, device=DEV))
    s = cg.stats(g)
    assert (s.captures, s.evictions, s.graphs) == (4, 3, 1)
    # only the live graph's pool is left, and stats reports it
    assert _graph_pool_bytes() == s.graph_pool_bytes > 0
    cg.ungraphify(g)
    assert _graph_pool_bytes() == 0


def test_grad_mode_gets_a_training_graph_whose_output_has_history():
    torch.manual_seed(0)
    m = nn.Linear(8, 8).to(DEV)
    g = cg.graphify(copy.deepcopy(m))
    for _ in range(3):
        x = torch.randn(2, 8, device=DEV)
        y = g(x)
        assert y.requires_grad and y.grad_fn is not None
        torch.testing.assert_close(y, m(x), rtol=0, atol=0)
        y.sum().backward()
    s = cg.stats(g)
    assert (s.captures, s.replays, s.eager) == (1, 2, 0)


def test_autocast_state_is_part_of_the_key():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).to(DEV)
    g = cg.graphify(copy.deepcopy(m))
    x = torch.randn(8, 64, device=DEV)
    with torch.no_grad():
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                got, want = g(x), m(x)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            got = g(x)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, m(x), rtol=0, atol=0)
    assert cg.stats(g).captures == 2


def test_two_threads_share_one_module_safely():
    ref, graphed = _pair(_gpt(GPTConfig(128, 4, 2, 1, 8, torch.float32)))
    errors = []

    def worker(seed):
        try:
            gen = torch.Generator(device=DEV).manual_seed(seed)
            with torch.no_grad():
                for _ in range(20):
                    x = torch.randn(1, 8, 128, device=DEV, generator=gen)
                    torch.testing.assert_close(graphed(x), ref(x), rtol=0, atol=0)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert cg.stats(graphed).replays >= 38


def test_graphed_function_and_nested_modules():
    @cg.graphify
    def f(a, b):
        return torch.relu(a @ b) + 1

    for _ in range(3):
        a, b = torch.randn(16, 16, device=DEV), torch.randn(16, 16, device=DEV)
        torch.testing.assert_close(f(a, b), torch.relu(a @ b) + 1, rtol=0, atol=0)
    assert cg.stats(f).replays == 2

    torch.manual_seed(0)
    ref = GPT(128, 4, 2).to(DEV).eval()
    nested = copy.deepcopy(ref)
    for blk in nested.blocks:
        cg.graphify(blk)
    cg.graphify(nested)
    with torch.no_grad():
        _five_calls(ref, nested, lambda i: torch.randn(1, 8, 128, device=DEV))
    assert (cg.stats(nested).captures, cg.stats(nested).replays) == (1, 4)


def test_region_releases_its_graphs():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).to(DEV)
    g = cg.graphify(copy.deepcopy(m))
    assert _graph_pool_bytes() == 0
    with torch.no_grad():
        with cg.graph_region() as region:
            for _ in range(3):
                x = torch.randn(1024, 1024, device=DEV)
                torch.testing.assert_close(g(x), m(x), rtol=0, atol=0)
            inside = region.stats()
            # in a chaining region the first call returns the graph's own output: 3 replays
            assert (inside.captures, inside.replays, inside.graphs) == (1, 3, 1)
            assert _graph_pool_bytes() == inside.graph_pool_bytes > 0
        assert cg.stats(g).graphs == 0  # the region owned the graph, not the module
    assert _graph_pool_bytes() == 0
    with torch.no_grad(), cg.graph_region(enabled=False):
        g(x)
    assert cg.stats(g).eager_calls["disabled by graph_region(enabled=False)"] == 1


def test_dropout_masks_are_fresh_on_every_replay():
    m = nn.Dropout(0.5).to(DEV).train()
    g = cg.graphify(m)
    x = torch.ones(4096, device=DEV)
    with torch.no_grad():
        masks = [g(x) != 0 for _ in range(4)]
    assert cg.stats(g).replays == 3
    for a, b in zip(masks, masks[1:]):
        assert not torch.equal(a, b)
    for mask in masks:
        assert 0.45 < mask.float().mean().item() < 0.55


def test_region_chains_twelve_blocks_with_zero_copies_between_them():
    ref = _gpt(GPTConfig(768, 12, 12, 1, 16, torch.bfloat16))
    g = copy.deepcopy(ref)
    for blk in g.blocks:
        cg.graphify(blk)
    assert _graph_pool_bytes() == 0
    with torch.no_grad():
        with cg.graph_region() as region:
            for _ in range(5):
                x = torch.randn(1, 16, 768, device=DEV, dtype=torch.bfloat16)
                torch.testing.assert_close(g(x), ref(x), rtol=0, atol=0)
            s = region.stats()
            assert (s.captures, s.replays, s.eager) == (12, 60, 0)
            assert s.input_copies == 5  # the first block's input, once per forward
            assert s.moved_outputs == 0
            kept = g.blocks[0](x)  # a kept output survives the next replays
            want = ref.blocks[0](x)
            g(torch.randn_like(x))
            torch.testing.assert_close(kept, want, rtol=0, atol=0)
            assert region.stats().moved_outputs == 1
            assert _graph_pool_bytes() > 0
    assert _graph_pool_bytes() == 0


@pytest.mark.parametrize("sync", ["item", "nonzero"])
def test_gpt_with_a_sync_in_every_block_keeps_the_rest_graphed(sync):
    torch.manual_seed(0)
    ref = GPT.from_config(GPTConfig(256, 4, 12, 1, 8, torch.float32), DEV, sync=sync)
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(1, 8, 256, device=DEV)
            torch.testing.assert_close(g(x), ref(x), rtol=0, atol=0)
    (reason,) = cg.stats(g).eager_calls
    assert reason.startswith("piecewise: 49 submodule(s) graphed"), reason
    for blk in g.blocks:
        for piece in (blk.ln1, blk.attn, blk.ln2, blk.mlp):
            s = cg.stats(piece)
            assert (s.captures, s.replays, s.eager) == (1, 4, 0), s  # calls 2-5, chained
    text = str(cg.explain(g))
    assert f"Tensor.{sync}" in text and "models.py:" in text


def test_inference_mode_and_buffers_written_by_forward():
    torch.manual_seed(0)
    with torch.inference_mode():
        ref = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16)).to(DEV).train()
        g = cg.graphify(copy.deepcopy(ref), num_warmup_iters=3)
        for _ in range(5):
            x = torch.randn(32, 16, device=DEV)
            torch.testing.assert_close(g(x), ref(x), rtol=1e-6, atol=1e-6)
        # running statistics advanced once per call, as eagerly (extra warm-ups restored them)
        torch.testing.assert_close(g[1].running_mean, ref[1].running_mean, rtol=1e-6, atol=1e-6)
        assert int(g[1].num_batches_tracked) == int(ref[1].num_batches_tracked) == 5
    s = cg.stats(g)
    assert (s.captures, s.replays) == (1, 4)


def test_an_exception_during_capture_in_a_region_leaves_the_shared_pool_intact():
    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(32, 32)

        def forward(self, x):
            y = self.lin(x)
            if torch.cuda.is_current_stream_capturing():
                raise ValueError("only while capturing")
            return y

    torch.manual_seed(0)
    good, flaky = cg.graphify(nn.Linear(32, 32).to(DEV)), cg.graphify(Flaky().to(DEV))
    alone = cg.graphify(Flaky().to(DEV))
    x = torch.randn(4, 32, device=DEV)
    reserved = []
    for _ in range(2):  # the second round must not leave more memory reserved than the first
        with torch.no_grad(), cg.graph_region():
            for _ in range(3):
                y = flaky(good(x))  # flaky's capture raises; good stays graphed in the region
                want = nn.functional.linear(nn.functional.linear(x, good.weight, good.bias),
                                            flaky.lin.weight, flaky.lin.bias)
                torch.testing.assert_close(y, want)
        with torch.no_grad(), cg.graph_region():
            for _ in range(3):  # alone's failed capture is its region pool's only graph
                torch.testing.assert_close(alone(x), alone.lin(x))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved.append(torch.cuda.memory_reserved())
        torch.randn(2, device=DEV)  # the CUDA generator is not left in capture mode
    # good: 2 x (two replays, plus the chaining region's replay on its first call)
    # (flaky's counters include its graphed piece's: flaky.lin's captures are all it has)
    assert cg.stats(good).replays == 6
    assert cg.stats(flaky).captures == cg.stats(flaky.lin).captures
    assert cg.stats(flaky.lin).captures == 2 and cg.stats(alone.lin).captures == 2
    assert reserved[1] <= reserved[0]
