"""Hunt-8d review on CUDA: common models keep the plans they had before the attribute patch
(the same stats with ``_probe._missing_attribute`` a plain raise and ``_note_attributes`` a
no-op, which is what c672b9e added for Python attributes), and stay close to eager (allclose:
eager takes torch's fused fast paths, a probed run does not). LSTM, TransformerEncoderLayer
(train), ``torch.utils.checkpoint``, ``parametrize``, an HF GPT-2 / Llama (tiny, random; also
``labels=input_ids``, a tensor passed twice: another key, no fast path), a timm ResNet / ViT."""
import copy
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DEV, check, finish, info, skip_without_cuda, sync_all  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

skip_without_cuda("b_models")
import cudagraphify as cg  # noqa: E402
from cudagraphify import _probe  # noqa: E402

_real_missing, _real_note = _probe._missing_attribute, _probe._note_attributes


def _plain_missing(self, name):
    raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def patches(on: bool) -> None:
    _probe._missing_attribute = _real_missing if on else _plain_missing
    _probe._note_attributes = _real_note if on else (lambda on: None)


def first(o):
    for k in ("logits", "last_hidden_state"):
        if hasattr(o, k):
            return getattr(o, k)
    return o[0] if isinstance(o, (tuple, list)) else o


def run(make, inp, grad, call):
    torch.manual_seed(0)
    ref = make().to(DEV)
    g = cg.graphify(copy.deepcopy(ref))
    close = True
    ctx = torch.enable_grad if grad else torch.no_grad
    for i in range(4):
        torch.manual_seed(10 + i)
        x = inp()
        with ctx():
            a, b = first(call(g, x)), first(call(ref, x))
            if grad:
                a.float().sum().backward()
                b.float().sum().backward()
        sync_all()
        close = close and torch.allclose(a.detach().float(), b.detach().float(),
                                         atol=1e-4, rtol=1e-4)
    s = cg.stats(g)
    return close, (s.captures, s.replays, tuple(sorted(k[:90] for k in s.eager_calls)))


class Ckpt(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return self.b(checkpoint(lambda t: self.a(t).relu(), x, use_reentrant=False))


class Sym(nn.Module):
    def forward(self, w):
        return (w + w.t()) / 2


def parametrized():
    from torch.nn.utils import parametrize
    lin = nn.Linear(64, 64)
    parametrize.register_parametrization(lin, "weight", Sym())
    return lin


def seq():
    return torch.randn(2, 5, 64, device=DEV)


plain = (lambda m, x: m(x))
CASES = [
    ("LSTM no_grad", lambda: nn.LSTM(64, 64, batch_first=True), seq, False, plain),
    ("TransformerEncoderLayer train+backward",
     lambda: nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True),
     seq, True, plain),
    ("checkpoint(use_reentrant=False)+backward", Ckpt,
     lambda: torch.randn(8, 64, device=DEV, requires_grad=True), True, plain),
    ("parametrize (symmetric weight) no_grad", parametrized,
     lambda: torch.randn(8, 64, device=DEV), False, plain),
]
try:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    ids = (lambda: torch.randint(0, 100, (2, 12), device=DEV))
    gpt2 = (lambda: GPT2LMHeadModel(GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=64)).eval())
    llama = (lambda: LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=100, max_position_embeddings=64)).eval())
    CASES += [
        ("HF GPT2LMHeadModel (tiny) eval", gpt2, ids, False,
         lambda m, x: m(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False)),
        ("HF LlamaForCausalLM (tiny) eval", llama, ids, False,
         lambda m, x: m(input_ids=x, use_cache=False)),
        ("HF LlamaForCausalLM (tiny) eval, labels=input_ids", llama, ids, False,
         lambda m, x: m(input_ids=x, labels=x, use_cache=False)),
    ]
except ImportError as e:
    info(f"no transformers: {e}")
try:
    import timm
    CASES.append(("timm resnet18 eval", lambda: timm.create_model("resnet18", pretrained=False,
                                                                   num_classes=10).eval(),
                  lambda: torch.randn(2, 3, 64, 64, device=DEV), False, plain))
    CASES.append(("timm vit_tiny_patch16_224 (img 32) eval", lambda: timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=32).eval(),
        lambda: torch.randn(2, 3, 32, 32, device=DEV), False, plain))
except ImportError as e:
    info(f"no timm: {e}")

for label, make, inp, grad, call in CASES:
    t0 = time.perf_counter()
    try:
        patches(True)
        close_now, now = run(make, inp, grad, call)
        patches(False)  # (as before c672b9e's attribute patches)
        close_before, before = run(make, inp, grad, call)
    except Exception as e:  # noqa: BLE001 - one model's failure is one FAIL line
        check(False, f"[control] {label}", f"raised {type(e).__name__}: {str(e)[:200]}")
        continue
    finally:
        patches(True)
    check(now == before and close_now,
          f"[control] {label}: the same plan as without the attribute patches",
          f"now {now} close={close_now}; before {before} close={close_before}")
    info(f"{label}: {now[0]} captures, {now[1]} replays, reasons {list(now[2])} "
         f"({time.perf_counter() - t0:.1f} s)")

finish("b_models")
