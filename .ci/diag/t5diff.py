"""T5 static-cache generate, eager vs graphify: tokens, and the largest logit difference per
generate (b_blocked counts any difference; is it a stale replay or another kernel?)."""
import copy
import torch
import transformers
import cudagraphify as cg

torch.manual_seed(0)
cfg = transformers.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                            num_decoder_layers=2, num_heads=4, pad_token_id=0,
                            decoder_start_token_id=0, eos_token_id=1)
model = transformers.T5ForConditionalGeneration(cfg).to("cuda").eval()
ref = copy.deepcopy(model)
g = cg.graphify(model)
gen = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=0,
           output_logits=True, return_dict_in_generate=True, cache_implementation="static")
with torch.no_grad():
    for n in (5, 5, 7, 5):
        ids = torch.randint(4, 256, (1, n), device="cuda")
        a, a2, b = ref.generate(ids, **gen), ref.generate(ids, **gen), g.generate(ids, **gen)
        d = max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits))
        d2 = max(float((x - y).abs().max()) for x, y in zip(a.logits, a2.logits))
        neq = sum(not torch.equal(x, y) for x, y in zip(a.logits, b.logits))
        print(f"T5 n={n}: tokens equal {torch.equal(a.sequences, b.sequences)}; logits steps "
              f"differing {neq}/24, max|diff| {d:.3e}; eager vs eager {d2:.3e}")
s = cg.stats(g)
print("T5 stats", s.captures, s.replays, {k[:50]: v for k, v in s.eager_calls.items()})
