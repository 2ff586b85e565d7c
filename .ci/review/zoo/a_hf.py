"""Zoo: graphify(model) on HF architectures no one here wrote, tiny configs, against an eager
twin (one GPU, about a minute; DEV=cpu: a smoke test on the CPU double, ZOO=gpt2,bert picks).

Per model: 6 no_grad calls on fresh inputs, then 3 at another length (bitwise equal, the path
taken in INFO); causal LMs: ``generate()`` greedy, default cache, twice (tokens identical);
then 3 training steps (dropout off, SGD): loss, every parameter's gradient and the updated
weights bitwise eager's. One line per check: PASS/FAIL [zoo] ...; a check off in the last bits
only is a [documented] FAIL (see ``verdict``)."""
import copy
import os
import sys
import time

# (the callables review's helpers: eager twins, bitwise checks, the CPU double with DEV=cpu)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "callables"))
from common import DEV, check, finish, info, same, skip_without_cuda, stats_line  # noqa: E402

import torch  # noqa: E402

skip_without_cuda("a_hf")
try:
    import transformers as tf
except ImportError:
    print("SKIP a_hf: needs transformers", flush=True)
    sys.exit(0)
import cudagraphify as cg  # noqa: E402

V = 256
_DEC = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
_ENC = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=128)
_NODROP = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
# name -> (model class, config class, config kwargs, kind)
MODELS = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config",
             dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "lm"),
    "llama": ("LlamaForCausalLM", "LlamaConfig", _DEC, "lm"),
    "mistral": ("MistralForCausalLM", "MistralConfig", _DEC, "lm"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", _DEC, "lm"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(_DEC, head_dim=16), "lm"),
    "phi": ("PhiForCausalLM", "PhiConfig", dict(_DEC, resid_pdrop=0.0, embd_pdrop=0.0), "lm"),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(_DEC, pad_token_id=0), "lm"),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(_DEC, head_dim=16), "lm"),
    "opt": ("OPTForCausalLM", "OPTConfig",
            dict(vocab_size=V, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=64,
                 dropout=0.0, attention_dropout=0.0), "lm"),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig",
                 dict(_ENC, hidden_dropout=0.0, attention_dropout=0.0), "lm"),
    "bloom": ("BloomForCausalLM", "BloomConfig",
              dict(vocab_size=V, hidden_size=64, n_layer=2, n_head=4, hidden_dropout=0.0,
                   attention_dropout=0.0), "lm"),
    "falcon": ("FalconForCausalLM", "FalconConfig",
               dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    hidden_dropout=0.0, attention_dropout=0.0), "lm"),
    "bert": ("BertModel", "BertConfig", dict(_ENC, **_NODROP), "enc"),
    "roberta": ("RobertaModel", "RobertaConfig", dict(_ENC, pad_token_id=1, **_NODROP), "enc"),
    "distilbert": ("DistilBertModel", "DistilBertConfig",
                   dict(vocab_size=V, dim=64, hidden_dim=128, n_layers=2, n_heads=4,
                        dropout=0.0, attention_dropout=0.0), "enc"),
    "deberta_v2": ("DebertaV2Model", "DebertaV2Config", dict(_ENC, **_NODROP), "enc"),
    "t5": ("T5ForConditionalGeneration", "T5Config",
           dict(vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                dropout_rate=0.0, decoder_start_token_id=0), "seq2seq"),
    "bart": ("BartForConditionalGeneration", "BartConfig",
             dict(vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2,
                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                  decoder_ffn_dim=128, max_position_embeddings=128, dropout=0.0,
                  attention_dropout=0.0, activation_dropout=0.0), "seq2seq"),
}


def build(name):
    model_cls, cfg_cls, kwargs, kind = MODELS[name]
    cfg = getattr(tf, cfg_cls)(**kwargs)
    torch.manual_seed(0)
    return getattr(tf, model_cls)(cfg).to(DEV), kind


def inputs(kind, batch, seq, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (batch, seq), generator=g).to(DEV)
    if kind == "seq2seq":
        dec = torch.randint(3, V, (batch, max(2, seq // 2)), generator=g).to(DEV)
        return dict(input_ids=ids, decoder_input_ids=dec)
    return dict(input_ids=ids)


def close(got, want) -> bool:
    return got.shape == want.shape and torch.allclose(got.double(), want.double(), rtol=1e-5,
                                                      atol=1e-5)


def verdict(ok, why, name, label, close_enough):
    """Bitwise: PASS. Off in the last bits only: a [documented] FAIL (README: HF's mask built
    differently while a capture runs, in encoders' whole graphs; gradient contributions summed
    in another order through a piecewise plan). Else a [zoo] FAIL."""
    if ok or not close_enough:
        check(ok, f"[zoo] {name} {label}", why)
    else:
        check(False, f"[documented] {name} {label} (README; close, not bitwise)", why)


def main_tensor(out):
    for key in ("logits", "last_hidden_state"):
        t = getattr(out, key, None)
        if t is not None:
            return t
    return out[0]


def run_model(name):
    try:
        ref, kind = build(name)
    except Exception as e:  # noqa: BLE001 - this version of transformers lacks it
        info(f"{name}: not built here ({type(e).__name__}: {str(e)[:100]})")
        return
    ref.eval()
    g = cg.graphify(copy.deepcopy(ref))
    t0 = time.perf_counter()
    with torch.no_grad():
        for label, calls, seq in (("no_grad", 6, 12), ("longer", 3, 20)):
            ok, why, near = True, "", True
            for i in range(calls):
                x = inputs(kind, 2, seq, 100 * seq + i)
                got, want = main_tensor(g(**x)), main_tensor(ref(**x))
                ok, why = same(got, want)
                if not ok:
                    why, near = f"call {i}: {why}", close(got, want)
                    break
            verdict(ok, why, name, label, near)
        info(f"{name} inference: {stats_line(g)}")
        if kind == "lm":
            prompt = inputs(kind, 1, 8, 7)["input_ids"]
            kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
            try:
                want = ref.generate(prompt, **kw)
                got = [g.generate(prompt, **kw) for _ in range(2)]
                check(all(torch.equal(t, want) for t in got), f"[zoo] {name} generate",
                      f"tokens {[t.tolist() for t in got]} vs eager's {want.tolist()}")
            except Exception as e:  # noqa: BLE001
                check(False, f"[zoo] {name} generate", f"{type(e).__name__}: {str(e)[:160]}")
    # training: dropout is off in every config, so train() draws nothing
    ref.train()
    g.train()
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(g.parameters(), lr=0.1)
    ok, why, near = True, "", True
    try:
        for step in range(3):
            x = inputs(kind, 2, 12, 900 + step)
            for m, opt in ((ref, opt_r), (g, opt_g)):
                opt.zero_grad(set_to_none=True)
                loss = main_tensor(m(**x)).float().square().mean()
                loss.backward()
                m._zoo_loss = loss.detach()
                opt.step()
            ok, why = same(g._zoo_loss, ref._zoo_loss)
            near = close(g._zoo_loss, ref._zoo_loss)
            if ok:
                for (n, p), q in zip(g.named_parameters(), ref.parameters()):
                    if (p.grad is None) != (q.grad is None):
                        ok, why = False, f"{n}: grad None vs not"
                    elif p.grad is not None:
                        ok, why = same(p.grad, q.grad)
                        why, near = f"{n}.grad: {why}", close(p.grad, q.grad)
                    if ok:
                        ok, why = same(p.detach(), q.detach())
                        why, near = f"{n}: {why}", close(p.detach(), q.detach())
                    if not ok:
                        break
            if not ok:
                why = f"step {step}: {why}"
                break
    except Exception as e:  # noqa: BLE001
        ok, why, near = False, f"{type(e).__name__}: {str(e)[:160]}", False
    verdict(ok, why, name, "training", near)
    info(f"{name} all: {stats_line(g)} ({time.perf_counter() - t0:.1f} s)")
    cg.ungraphify(g)


picks = os.environ.get("ZOO")
for name in (picks.split(",") if picks else MODELS):
    try:
        run_model(name)
    except Exception as e:  # noqa: BLE001 - a loud failure of the library is a finding too
        check(False, f"[zoo] {name}", f"raised {type(e).__name__}: {str(e)[:200]}")
finish("a_hf")
