"""Hunt-8c review on CUDA: common models keep the plans they had before 3ca76f2 (the same
stats with ``Probe.read_metadata`` switched off, which is what the change added), and stay
close to eager (allclose: eager takes torch's fused fast paths, a probed run does not).
LSTM/GRU (their own ``data_ptr`` reads of their weights), MHA, TransformerEncoderLayer (eval
and train), ``torch.utils.checkpoint``, a full backward hook (its ``grad_fn`` reads), an HF
GPT-2 and Llama (tiny, random), a timm ResNet."""
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

_real = _probe.Probe.read_metadata


def first(o):
    if hasattr(o, "last_hidden_state"):
        return o.last_hidden_state
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


def hooked():
    m = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
    m.register_full_backward_hook(lambda mod, gi, go: None)
    return m


def seq():
    return torch.randn(2, 5, 64, device=DEV)


plain = (lambda m, x: m(x))
CASES = [
    ("LSTM no_grad", lambda: nn.LSTM(64, 64, batch_first=True), seq, False, plain),
    ("GRU no_grad", lambda: nn.GRU(64, 64, batch_first=True), seq, False, plain),
    ("MHA self-attention eval", lambda: nn.MultiheadAttention(64, 4, batch_first=True).eval(),
     seq, False, lambda m, x: m(x, x, x, need_weights=False)),
    ("TransformerEncoderLayer eval",
     lambda: nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True).eval(),
     seq, False, plain),
    ("TransformerEncoderLayer train+backward",
     lambda: nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True),
     seq, True, plain),
    ("checkpoint(use_reentrant=False)+backward", Ckpt,
     lambda: torch.randn(8, 64, device=DEV, requires_grad=True), True, plain),
    ("full backward hook+backward", hooked,
     lambda: torch.randn(8, 64, device=DEV, requires_grad=True), True, plain),
]
try:
    from transformers import GPT2Config, GPT2Model, LlamaConfig, LlamaModel
    ids = (lambda: torch.randint(0, 100, (2, 12), device=DEV))
    CASES.append(("HF GPT2 (tiny) eval", lambda: GPT2Model(GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=64)).eval(), ids, False,
        lambda m, x: m(x, use_cache=False)))
    CASES.append(("HF Llama (tiny) eval", lambda: LlamaModel(LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=100, max_position_embeddings=64)).eval(), ids, False,
        lambda m, x: m(x, use_cache=False)))
except ImportError as e:
    info(f"no transformers: {e}")
try:
    import timm
    CASES.append(("timm resnet18 eval", lambda: timm.create_model("resnet18", pretrained=False,
                                                                   num_classes=10).eval(),
                  lambda: torch.randn(2, 3, 64, 64, device=DEV), False, plain))
except ImportError as e:
    info(f"no timm: {e}")

for label, make, inp, grad, call in CASES:
    t0 = time.perf_counter()
    _probe.Probe.read_metadata = _real
    close_now, now = run(make, inp, grad, call)
    _probe.Probe.read_metadata = lambda self, name, args: None  # (as before 3ca76f2)
    close_before, before = run(make, inp, grad, call)
    _probe.Probe.read_metadata = _real
    check(now == before and close_now,
          f"[control] {label}: the same plan as before the change (captures, replays, reasons)",
          f"now {now} close={close_now}; before {before} close={close_before}")
    info(f"{label}: {now[0]} captures, {now[1]} replays, reasons {list(now[2])} "
         f"({time.perf_counter() - t0:.1f} s)")

finish("b_models")
