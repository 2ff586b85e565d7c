"""GPU diagnosis (#18): share_graph over an HF Llama's layers, decoding with a StaticCache, no
options. Eager model and shared copy side by side: logits and every cache tensor compared
bitwise at every step; the group's counters and refusal reasons."""
import copy, sys, time, warnings
import torch, transformers
import cudagraphify as cg

warnings.simplefilter("ignore")


def run(layers):
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=layers,
                                 num_attention_heads=8, num_key_value_heads=4, vocab_size=32000)
  ref = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
  model = copy.deepcopy(ref)
  group = cg.share_graph(model.model.layers)
  steps = 8
  rc = transformers.StaticCache(config=cfg, max_cache_len=8 + steps + 1)
  c = transformers.StaticCache(config=cfg, max_cache_len=8 + steps + 1)
  ids = torch.randint(0, 32000, (1, 8), device="cuda")
  bad = []
  with torch.no_grad():
      want = ref(input_ids=ids, past_key_values=rc, use_cache=True).logits
      got = model(input_ids=ids, past_key_values=c, use_cache=True).logits
      bad += [] if torch.equal(want, got) else [("prefill", 0)]
      tok = want[:, -1:].argmax(-1)
      times, etimes = [], []
      for s in range(steps):
          pos = torch.tensor([8 + s], device="cuda")
          want = ref(input_ids=tok, past_key_values=rc, cache_position=pos, use_cache=True).logits
          torch.cuda.synchronize(); t0 = time.perf_counter()
          got = model(input_ids=tok, past_key_values=c, cache_position=pos, use_cache=True).logits
          torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
          if not torch.equal(want, got):
              bad.append(("logits", s))
          for i, (a, b) in enumerate(zip(rc.layers, c.layers)):
              if not (torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)):
                  bad.append(("cache", s, i))
          tok = want[:, -1:].argmax(-1)
  s = group.stats()
  print(f"layers {layers}: captures {s.captures} retargets {s.retargets} per_layer {s.per_layer} "
        f"replays {[cg.stats(l).replays for l in model.model.layers]}")
  print("reasons", s.reasons)
  print("unproven", s.unproven_slots)
  print("step ms", [round(t * 1e3, 2) for t in times], "eager", [round(t * 1e3, 2) for t in etimes])
  print("BAD" if bad else "OK: logits and caches bitwise eager's", bad[:8])


for n in ([int(sys.argv[1])] if len(sys.argv) > 1 else [4, 16]):
  run(n)
