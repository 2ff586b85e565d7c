"""GPU diagnosis (#18): HF generate() with a StaticCache kept across calls, the model's layers
through share_graph (no option) against eager and against graphify(model). Llama 8 layers,
hidden 512, bf16, 64 new tokens, greedy; tokens compared with eager's; tokens/s of the best of
the later calls, and the first call's seconds; the group's counters."""
import copy, sys, time, warnings
import torch, transformers
import cudagraphify as cg

sys.path.insert(0, "examples")
from hf_generate import timed_generate  # noqa: E402

warnings.simplefilter("ignore")
torch.manual_seed(0)
cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                               num_attention_heads=8, num_key_value_heads=8, vocab_size=32000,
                               max_position_embeddings=256)
base = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
prompt = torch.randint(0, cfg.vocab_size, (1, 32), device="cuda")
greedy = dict(max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0,
              disable_compile=True)
rows = {}
for name in ("eager", "share_graph(layers)", "graphify(model)"):
    model = copy.deepcopy(base)
    group = None
    if name.startswith("share"):
        group = cg.share_graph(model.model.layers)
    elif name.startswith("graphify"):
        cg.graphify(model)
    cache = transformers.StaticCache(config=cfg, max_cache_len=32 + 64)
    rows[name] = timed_generate(model, prompt, 5, past_key_values=cache, **greedy)
    if group is not None:
        s = group.stats()
        print(f"{name}: captures {s.captures} retargets {s.retargets} per_layer {s.per_layer} "
              f"replays {s.replays} eager {s.eager} reasons {dict(list(s.reasons.items())[:3])}")
e_tokens, _, e_s = rows["eager"]
for name, (tokens, first, best) in rows.items():
    print(f"{name}: tokens equal eager's {torch.equal(tokens, e_tokens)}; "
          f"{64 / best:.0f} tokens/s ({e_s / best:.2f}x eager); first generate {first:.2f} s")
