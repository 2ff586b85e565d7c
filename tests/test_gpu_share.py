"""GPU tests of share_graph: every layer's output equals eager, counters prove one template
capture (plus one diff capture) per signature, weights are read in place, fallbacks are real."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import cudagraphify as cg
from conftest import assert_chain_matches
from cudagraphify.bench.models import GPT, GPTConfig

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("quiet_gpu")]

DEV = "cuda"



def _layer_outputs(model, layers):
    """Record every layer's output of the next forward (forward hooks on the layers)."""
    got: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda m, a, out: got.append(out.detach().clone()))
             for m in layers]
    return got, hooks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_blocks_share_one_capture_and_match_eager_layer_by_layer(dtype):
    torch.manual_seed(0)
    ref = GPT.from_config(GPTConfig(256, 4, 6, 1, 16, dtype), DEV)
    model = copy.deepcopy(ref)
    group = cg.share_graph(model.blocks)
    with torch.no_grad():
        for seq in (16, 8):
            for _ in range(5):
                x = torch.randn(2, seq, 256, device=DEV, dtype=dtype)
                got, h1 = _layer_outputs(model, model.blocks)
                want, h2 = _layer_outputs(ref, ref.blocks)
                y, y_ref = model(x), ref(x)
                for h in h1 + h2:
                    h.remove()
                assert len(got) == len(want) == 6
                for k, (a, b) in enumerate(zip(got, want)):
                    torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"layer {k}, T={seq}")
                torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    s = group.stats()
    assert s.per_layer == 0, (s.reasons, s.unproven_slots)
    # per shape: the template, a second layer (and the first again, if the diff needs it)
    assert 2 * 2 <= s.captures <= 3 * 2 and s.retargets == 6 * 2, s
    assert all(cg.stats(b).captures == 0 and cg.stats(b).retargets == 2 for b in model.blocks)
    assert all(cg.stats(b).replays == 8 for b in model.blocks)  # 5 calls x 2 shapes, minus firsts
    # No weights live in graph memory: the templates' pool holds activations only.
    weight_bytes = sum(p.numel() * p.element_size() for p in model.blocks.parameters())
    assert 0 < s.template_pool_bytes < weight_bytes
    assert sum(cg.stats(b).graph_pool_bytes for b in model.blocks) == 0
    group.release()
    assert all(cg.stats(b).graphs == 0 for b in model.blocks)


def test_weights_are_read_in_place_and_a_replaced_parameter_retargets_one_layer():
    torch.manual_seed(0)
    ref = GPT.from_config(GPTConfig(256, 4, 4, 1, 16, torch.float32), DEV)
    model = copy.deepcopy(ref)
    group = cg.share_graph(model.blocks)
    x = torch.randn(1, 16, 256, device=DEV)
    with torch.no_grad():
        model(x), model(x)
        for m in (ref, model):  # an in-place optimizer-like update of layer 2's weight
            m.blocks[2].mlp.fc.weight.mul_(0.5)
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
        for m in (ref, model):  # a replaced parameter: layer 1 alone is retargeted again
            w = m.blocks[1].attn.qkv.weight
            m.blocks[1].attn.qkv.weight = nn.Parameter(w.detach() * 2)
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    s = group.stats()
    assert 2 <= s.captures <= 3 and (s.retargets, s.per_layer) == (5, 0), s
    assert cg.stats(model.blocks[1]).invalidations == 1


class _WithTable(nn.Module):
    """Reads a plain tensor attribute (not a buffer): its address differs per layer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.table = torch.randn(64)

    def forward(self, x):
        return self.lin(x) + self.table


def test_an_unproven_difference_falls_back_to_per_layer_graphs_in_one_pool():
    torch.manual_seed(0)
    layers = nn.ModuleList(_WithTable() for _ in range(3)).to(DEV)
    for m in layers:
        m.table = m.table.to(DEV)
    ref = copy.deepcopy(layers)
    group = cg.share_graph(layers)
    x = torch.randn(4, 64, device=DEV)
    with torch.no_grad():
        for _ in range(3):
            assert_chain_matches(layers, ref, x)
    s = group.stats()
    assert s.retargets == 0 and s.per_layer == 3
    (reason,) = s.reasons
    assert "not a rebased parameter address" in reason
    assert [cg.stats(m).captures for m in layers] == [1, 1, 1]
    assert [cg.stats(m).replays for m in layers] == [2, 2, 2]


def test_dropout_in_train_mode_refuses_sharing():
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5)) for _ in range(3))
    layers = layers.to(DEV).train()
    group = cg.share_graph(layers)
    x = torch.randn(64, 64, device=DEV)
    with torch.no_grad():
        outs = [layers[0](x) for _ in range(3)]
        for m in layers[1:]:
            m(x)
    assert "random ops" in " ".join(group.stats().reasons)
    assert not torch.equal(outs[1], outs[2])  # fresh masks per replay (per-layer graphs)
    kept = (outs[2] != 0).float().mean().item()
    assert 0.4 < kept < 0.6


def test_hf_llama_layers_share_one_capture():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                                   num_attention_heads=8, num_key_value_heads=4,
                                   vocab_size=1000, max_position_embeddings=256)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).to(DEV).eval()
    model, strict_model = copy.deepcopy(ref), copy.deepcopy(ref)
    # RMSNorm's reduction kernel takes a struct whose unused tail holds host-stack bytes that
    # differ between layers: strict (the default) refuses them, strict=False keeps them and
    # relies on the per-layer check against eager.
    # (layer_idx differs between layers: each layer is proven by its own capture)
    group = cg.share_graph(model.model.layers, strict=False)
    strict = cg.share_graph(strict_model.model.layers)
    seqs = (12, 20, 16, 24)
    with torch.no_grad():
        for seq in seqs:
            for _ in range(5):
                ids = torch.randint(0, 1000, (1, seq), device=DEV)
                want = ref(ids, use_cache=False).logits
                for m in (model, strict_model):
                    torch.testing.assert_close(m(ids, use_cache=False).logits, want,
                                               rtol=1e-5, atol=1e-5)
    n = 6 * len(seqs)  # layer graphs: 6 layers x the lengths
    s = group.stats()
    # strict=False keeps such bytes unless one of the two is an address of memory the layers
    # read (stack garbage can hold a stale pointer: byte 104 of the mean reduction's argument in
    # one H200 run, for one length of two; any device address refused until Dec 2026). That
    # length then goes per layer, with the reason; the other lengths share (at least half).
    # (kept unproven: none since the bytes that differed are known unread, the reductions'
    # tails and pow(2)'s lambda among them; seen on the H100, 2026-12-05)
    assert s.retargets >= n // 2 and s.retargets + s.per_layer == n, s
    assert all("not a rebased parameter address" in r for r in s.reasons), s.reasons
    # per length: the template, its partner, perhaps the template again, and a proof of each
    # other layer (its layer_idx differs)
    assert 2 * len(seqs) <= s.captures <= (3 + 5) * len(seqs), s
    s = strict.stats()
    # strict keeps only bytes that hold a host address in one of the two captures (a kernel
    # launched with a host address there does not read them): a signature whose layers differ
    # in other bytes goes per layer (all 6 layers of it), with the reason
    assert s.retargets + s.per_layer == n, s
    assert all("not a rebased parameter address" in r for r in s.reasons), s.reasons


@pytest.mark.parametrize("arch", ["gpt2", "bert", "llama"])
def test_hf_layers_share_with_no_option(arch):
    """GPT-2's, BERT's and Llama's layers differ in layer_idx only: share_graph with no option
    proves each layer (its own capture diffed with the template's) and every layer shares
    (Llama's since the bytes its elementwise, cat and copy kernels never read are known)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_embd=256, n_layer=6, n_head=8, vocab_size=1000,
                                      n_positions=256, bos_token_id=0, eos_token_id=0)
        ref = transformers.GPT2LMHeadModel(cfg).to(DEV).eval()
        kw = dict(use_cache=False)
    elif arch == "llama":
        cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688,
                                       num_hidden_layers=6, num_attention_heads=8,
                                       num_key_value_heads=4, vocab_size=1000,
                                       max_position_embeddings=256)
        ref = transformers.LlamaForCausalLM(cfg).to(DEV).eval()
        kw = dict(use_cache=False)
    else:
        cfg = transformers.BertConfig(hidden_size=256, num_hidden_layers=6,
                                      num_attention_heads=8, intermediate_size=688,
                                      vocab_size=1000, max_position_embeddings=256)
        ref = transformers.BertModel(cfg).to(DEV).eval()
        kw = {}
    model = copy.deepcopy(ref)
    layers = {"gpt2": lambda: model.transformer.h, "llama": lambda: model.model.layers,
              "bert": lambda: model.encoder.layer}[arch]()
    group = cg.share_graph(layers)
    seqs = (12, 20)
    with torch.no_grad():
        for seq in seqs:
            for _ in range(3):
                ids = torch.randint(0, 1000, (1, seq), device=DEV)
                want, got = ref(ids, **kw), model(ids, **kw)
                want = want.last_hidden_state if arch == "bert" else want.logits
                got = got.last_hidden_state if arch == "bert" else got.logits
                assert torch.equal(got, want)
    s = group.stats()
    # (the reasons first: the Stats repr is cut short in pytest's report. Known to fail now and
    # then for GPT-2 (2026-12-05, H100: 1 run in 5, passed on a rerun of the same code): a
    # layer's capture holds other host-stack leftovers in bytes of a kernel argument no kernel
    # reads, which strict mode cannot tell from a per-layer value; see the README's share_graph
    # paragraph and .ci/diag/share_slots.py)
    assert (s.retargets, s.per_layer) == (6 * len(seqs), 0), (list(s.reasons), s)
    assert s.replays >= 6 * len(seqs) * 2, s  # the later calls replay the shared graphs


def test_blocks_with_a_host_sync_share_each_graphed_piece():
    torch.manual_seed(0)
    ref = GPT(256, 4, 4, sync="item").to(DEV).eval()
    model = copy.deepcopy(ref)
    group = cg.share_graph(model.blocks)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(1, 16, 256, device=DEV)
            torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    s = group.stats()
    assert set(s.pieces) == {"ln1", "attn", "ln2", "mlp"}
    for path, piece in s.pieces.items():
        assert 2 <= piece.captures <= 3 and (piece.retargets, piece.per_layer) == (4, 0), \
            (path, piece)
    # call 1 decides piecewise, call 2 makes the pieces, calls 3 and 4 replay them
    assert all(cg.stats(b.attn).replays == 2 for b in model.blocks)


def test_a_reductions_unread_tails_are_found_in_real_captures():
    # (share_graph's diff keeps the bytes past the offset calculators' dims as the template has
    # them: host-stack leftovers, another value in every HF Llama layer's capture)
    from cudagraphify._cugraph import driver_available, read_graph
    from cudagraphify._unread import _reduce_layout, reduce_unread

    if not driver_available():
        pytest.skip("the CUDA driver cannot report kernel argument sizes")
    chunks, name = [], None
    for _ in range(2):
        x = torch.randn(16, 512, device=DEV)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.pow(2).mean(-1, keepdim=True)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(g):
            x.pow(2).mean(-1, keepdim=True)
        torch.cuda.synchronize()
        node = next(n for n in read_graph(int(g.raw_cuda_graph()))[0]
                    if n.name.startswith("_ZN2at6native13reduce_kernel"))
        chunks.append(node.chunks[0])
        name = node.name
    at, d_in, d_out = _reduce_layout(chunks[0])
    assert (d_in, d_out) == (1, 1) and len(chunks[0]) - at in (972, 976)
    unread = reduce_unread(name, chunks)
    n = len(chunks[0])
    padding = {at - 7, at - 6, at - 5} | set(range(at + 908, n - 64)) | {n - 6, n - 5}
    assert padding <= unread
    assert len(unread) == (300 - 12 + 100 - 4) + (300 - 12 + 200 - 8) + len(padding)
    # what the kernel reads is not in it: the head (functor, identity, config), each
    # calculator's dims, first divider and first row of strides, the pointers and flags after
    read = set(range(at + 16)) | set(range(at + 304, at + 308)) \
        | set(range(at + 404, at + 420)) | set(range(at + 708, at + 716)) \
        | set(range(at + 908, n))
    assert not (read - padding) & unread


def _two_captures(fn, prefix):
    """The first node named ``prefix...`` in each of two captures of ``fn`` (fresh graphs)."""
    from cudagraphify._cugraph import read_graph

    found = []
    for _ in range(2):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize()
        found.append(next(n for n in read_graph(int(g.raw_cuda_graph()))[0]
                          if prefix in n.name))
    return found


@pytest.mark.parametrize("op", ["mul", "cat", "cat_contig", "to"])
def test_kernels_unread_bytes_are_found_in_real_captures(op):
    # (the layouts _unread recognises, on PyTorch's own launches: HF Llama's strided mul, its
    # rotary cat of two slices, a cat of contiguous tensors, its bf16 -> fp32 copy)
    from cudagraphify._cugraph import driver_available
    from cudagraphify._unread import _CAT, unread_bytes

    if not driver_available():
        pytest.skip("the CUDA driver cannot report kernel argument sizes")
    x = torch.randn(2, 8, 16, 32, device=DEV, dtype=torch.bfloat16)
    y = torch.randn(2, 1, 16, 32, device=DEV, dtype=torch.bfloat16)
    fn, prefix, c = {
        "mul": (lambda: x.transpose(1, 2) * y.transpose(1, 2), "gpu_kernel_impl_nocast", 1),
        "cat": (lambda: torch.cat((-x[..., 16:], x[..., :16]), dim=-1), "CatArrayBatchedCopy", 1),
        "cat_contig": (lambda: torch.cat((x, y), dim=1), "CatArrayBatchedCopy", 1),
        "to": (lambda: x.to(torch.float32), "unrolled_elementwise_kernel", 5),
    }[op]
    nodes = _two_captures(fn, prefix)
    chunks = [n.chunks[c] for n in nodes]
    unread = unread_bytes(nodes[0], c, chunks)
    assert unread, (nodes[0].name, nodes[0].grid, [len(ch) for ch in nodes[0].chunks])
    if op == "mul":  # the calculator's dims, its first divider and strides row: read
        assert not unread & {*range(16), *range(304, 304 + 12)}
        dims = int.from_bytes(chunks[0][:4], "little")
        assert 4 + 12 * dims in unread and 4 + 12 * dims - 1 not in unread
    elif op.startswith("cat"):  # two inputs: their entries are read, the third's not
        n = int(_CAT.fullmatch(nodes[0].name)[4])  # entries the metadata holds
        assert nodes[0].grid[1] == 2 and not unread & {*range(16), 8 * n, 8 * n + 4}
        assert {16, 8 * n + 8} <= unread
    else:  # the dtype and the element size are read, the three bytes between are not
        assert unread == frozenset({1, 2, 3}) and chunks[0][0] == 15  # bfloat16
    # what differs between the two captures past the operands' addresses is unread
    addresses = {p for ch in chunks for p in range(0, len(ch) - 7, 8)
                 if int.from_bytes(ch[p:p + 8], "little") >> 40 in (0x7f, 0x7e)}
    differ = {p for p in range(len(chunks[0])) if chunks[0][p] != chunks[1][p]}
    assert not {p for p in differ - unread if p - p % 8 not in addresses}, sorted(differ - unread)


def test_hf_llama_decode_with_a_static_cache_shares_layers_each_with_its_own_cache_part():
    """A static-cache decode step through share_graph, no option: a layer's graph made from
    the template reads and writes its own keys and values (rebased like its weights; proven by
    captures in one memory state, since its layer_idx picks them). Logits and every cache
    tensor bitwise eager's at every step; the group's runs leave the cache as eager left it."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4,
                                   vocab_size=1000)
    ref = transformers.LlamaForCausalLM(cfg).to(DEV, torch.bfloat16).eval()
    model = copy.deepcopy(ref)
    group = cg.share_graph(model.model.layers)
    steps, prompt = 6, 8
    caches = [transformers.StaticCache(config=cfg, max_cache_len=prompt + steps)
              for _ in range(2)]
    ids = torch.randint(0, 1000, (1, prompt), device=DEV)
    with torch.no_grad():
        want = ref(input_ids=ids, past_key_values=caches[0]).logits
        assert torch.equal(model(input_ids=ids, past_key_values=caches[1]).logits, want)
        for s in range(steps):
            tok, pos = want[:, -1:].argmax(-1), torch.tensor([prompt + s], device=DEV)
            want = ref(input_ids=tok, past_key_values=caches[0], cache_position=pos).logits
            got = model(input_ids=tok, past_key_values=caches[1], cache_position=pos).logits
            assert torch.equal(got, want), s
            for a, b in zip(caches[0].layers, caches[1].layers):
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), s
    s = group.stats()
    # (layer 0's graph and others made from it: on the H100 every layer's, since index_copy_'s,
    # arange's, where's and pow(2)'s lambdas' unread bytes are known; a host-heap leftover in
    # a kernel argument no rule covers would refuse a layer, never anything else)
    assert s.retargets >= 2 and s.retargets + s.per_layer == 4, (list(s.reasons), s)
    assert all("in one memory state" in r for r in s.reasons), list(s.reasons)
    assert s.replays >= 4 * (steps - 1), s
