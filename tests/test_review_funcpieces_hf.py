"""Review of 586773d (function pieces), HF part: real transformers Llama on the CPU double,
``generate()`` with its DynamicCache (a plan around the opaque cache, HF's
``apply_rotary_pos_emb`` graphed as a function piece), compared with an eager twin bitwise."""

from __future__ import annotations

import copy

import pytest
import torch

import cudagraphify as cg

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402
from test_review_hfcache import _GEN, _config, _same_generate  # noqa: E402


def _model(**kw):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config(**kw)).eval()
    model.generation_config.pad_token_id = 0
    return model


def _rotary_replays():
    fn = modeling_llama.apply_rotary_pos_emb
    return cg.stats(fn).replays if cg._funcpieces.states_of(fn) is not None else 0


def test_control_two_llama_configs_padded_batches_generate_as_eager(sim):
    """Two configs (head dims 16 and 8) in one process, prompts of two lengths, a padded
    batch of two: tokens and logits equal eager's, the rotary graphs replayed."""
    pairs = []
    for kw in ({}, dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)):
        ref = _model(**kw)
        pairs.append((ref, cg.graphify(copy.deepcopy(ref))))
    torch.manual_seed(5)
    before = None
    with torch.no_grad():
        for n in range(6):
            for ref, g in pairs:
                ids = torch.randint(1, 64, (2, 4 if n % 2 else 6))
                mask = torch.ones_like(ids)
                mask[0, :2] = 0
                want = ref.generate(ids, attention_mask=mask, disable_compile=True, **_GEN)
                got = g.generate(ids, attention_mask=mask, **_GEN)
                assert _same_generate(got, want), n
                if before is None:
                    before = _rotary_replays()
    assert _rotary_replays() - before >= 8


def test_control_eager_twin_interleaved_and_ungraphified(sim):
    """The eager twin's generates between the graphified one's (through the wrapper, plain),
    and the root ungraphified afterwards: equal to eager's."""
    ref = _model()
    g = cg.graphify(copy.deepcopy(ref))
    torch.manual_seed(7)
    with torch.no_grad():
        for n in range(4):
            ids = torch.randint(1, 64, (1, 5))
            want = ref.generate(ids, disable_compile=True, **_GEN)
            assert _same_generate(g.generate(ids, **_GEN), want), n
        cg.ungraphify(g)
        ids = torch.randint(1, 64, (1, 5))
        assert _same_generate(g.generate(ids, **_GEN),
                              ref.generate(ids, disable_compile=True, **_GEN))
