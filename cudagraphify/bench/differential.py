"""``--differential``: the differential suite's models, step by step, timed against eager.

The GPU differential suite (tests/test_gpu_differential.py) runs a script of changes on models
no one here wrote (HF GPT-2, Llama and BERT, torchvision's ResNet-18) and on our GPT, and checks
every output against an eager twin. This section runs the same script and, after each step's
change, times that step's call: a few calls first (the step's capture, its trial or its
decision; eager as many times), then eager and ``graphify(model)`` in turn, ``rounds`` rounds
of ``calls`` calls, each its best round. The outputs kept from the first calls stay referenced
while the step is timed (a grad-mode step's backward is then pending: its calls run eagerly).
Issue 16's target: in every step, ``graphify`` ≤ 1.02 × eager.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable

import torch
from torch import nn

from ._common import error_text, progress, time_per_call
from .models import GPT

__all__ = ["MODELS", "TARGET", "apply_step", "bench_differential", "format_differential",
           "path_taken", "steps"]

TARGET = 1.02  # graphify / eager, in every step


def _ids(vocab: int, device: str) -> Callable:
    def make(batch=2, seq=12, contiguous=True, wide=False):
        dtype = torch.int32 if wide else torch.int64  # "wide": the other dtype of each model
        if contiguous:
            return torch.randint(0, vocab, (batch, seq), device=device, dtype=dtype)
        return torch.randint(0, vocab, (seq, batch), device=device, dtype=dtype).t()
    return make


def _gpt2(device: str):
    import transformers
    cfg = transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=500, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg), _ids(500, device), lambda out: out.logits


def _llama(device: str):
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=500, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg), _ids(500, device), lambda out: out.logits


def _bert(device: str):
    import transformers
    cfg = transformers.BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=256, vocab_size=500,
                                  max_position_embeddings=64)
    return transformers.BertModel(cfg), _ids(500, device), lambda out: out.last_hidden_state


def _resnet(device: str):
    import torchvision

    def make(batch=2, seq=32, contiguous=True, wide=False):  # batch 2: BatchNorm in train mode
        x = torch.randn(batch, 3, seq, seq, device=device,
                        dtype=torch.float64 if wide else torch.float32)
        return x if contiguous else x.to(memory_format=torch.channels_last)
    return torchvision.models.resnet18(num_classes=10), make, lambda out: out


def _ours(device: str):
    def make(batch=2, seq=12, contiguous=True, wide=False):
        dtype = torch.float64 if wide else torch.float32
        if contiguous:
            return torch.randn(batch, seq, 64, device=device, dtype=dtype)
        return torch.randn(seq, batch, 64, device=device, dtype=dtype).transpose(0, 1)
    return GPT(64, 2, 2), make, lambda out: out


# name -> builder(device) -> (model, make(batch, seq, contiguous, wide), pick(output))
MODELS: dict[str, Callable] = {"gpt2": _gpt2, "llama": _llama, "bert": _bert,
                               "resnet18": _resnet, "ours": _ours}


def _first_linear(model: nn.Module) -> nn.Module:
    return next(m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d)))


def _some_param(model: nn.Module) -> nn.Parameter:
    params = list(model.parameters())
    return params[len(params) // 2]


def _reassign(m: nn.Module) -> None:
    lin = _first_linear(m)
    lin.weight = nn.Parameter(lin.weight.detach() * 0.5)


def _assign_state(m: nn.Module) -> None:
    m.load_state_dict({k: v.detach().clone() for k, v in m.state_dict().items()}, assign=True)


def _data(m: nn.Module) -> None:
    p = _some_param(m)
    p.data = p.data.clone() * 1.01


def _autocast(device_type: str) -> Callable:
    def enter():
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.autocast(device_type, dtype=torch.bfloat16))
        return stack
    return enter


def steps(device_type: str = "cuda") -> list[tuple]:
    """(name, change made to both models, input keywords, context) of each step, in order."""
    return [
        ("first call", None, {}, torch.no_grad),
        ("same signature", None, {}, torch.no_grad),
        ("batch size 3", None, {"batch": 3}, torch.no_grad),
        ("longer input", None, {"seq": 20}, torch.no_grad),
        ("non-contiguous input", None, {"contiguous": False}, torch.no_grad),
        ("first signature again", None, {}, torch.no_grad),
        ("parameter reassigned", _reassign, {}, torch.no_grad),
        ("load_state_dict(assign=True)", _assign_state, {}, torch.no_grad),
        ("p.data = ...", _data, {}, torch.no_grad),
        ("train mode", lambda m: m.train(), {}, torch.no_grad),
        ("eval mode", lambda m: m.eval(), {}, torch.no_grad),
        ("grad mode", None, {}, torch.enable_grad),
        ("inference_mode", None, {}, torch.inference_mode),
        ("autocast bf16", None, {}, _autocast(device_type)),
        ("autocast off", None, {}, torch.no_grad),
        # token models take int32 ids; the others run in float64 (every parameter moves)
        ("other dtype", lambda m: m.double(), {"wide": True}, torch.no_grad),
        ("back to float32", lambda m: m.float(), {}, torch.no_grad),
    ]


def apply_step(step: str, change: Callable | None, make: Callable, kwargs: dict,
               *models: nn.Module) -> torch.Tensor:
    """Make a step's change to each model (dropout off from train mode on: it draws
    differently in two models) and its input (seeded)."""
    for m in models:
        if change is not None:
            change(m)
        if step == "train mode":
            for mod in m.modules():
                if isinstance(mod, nn.Dropout):
                    mod.p = 0.0
    torch.manual_seed(1)
    return make(**kwargs)


def bench_differential(calls: int = 20, rounds: int = 5, warm: int = 6, device: str = "cuda",
                       models: list[str] | None = None) -> list[dict]:
    """One row per model: each step's µs per call, eager and ``graphify``, their ratio, the
    largest difference between the two outputs and what the graphified calls did."""
    import cudagraphify as cg

    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    rows = []
    for name in models or list(MODELS):
        row: dict = {"workload": f"differential-{name}", "steps": [], "target": TARGET}
        rows.append(row)
        try:
            ref, make, pick = MODELS[name](device)
        except Exception as e:  # noqa: BLE001 - a library missing or broken: say so
            row["skipped"] = error_text(e, 160)
            continue
        progress(f"differential: {name}")
        torch.manual_seed(0)
        ref = ref.to(device).eval()
        graphed = cg.graphify(copy.deepcopy(ref))
        for step, change, kwargs, ctx in steps(torch.device(device).type):
            x = apply_step(step, change, make, kwargs, ref, graphed)
            before = cg.stats(graphed)
            with ctx():
                for _ in range(warm):  # its capture, its pieces' trials, its decision
                    # (eager as often: train-mode BatchNorm updates its statistics every call)
                    got, want = pick(graphed(x)), pick(ref(x))
                best = {"eager": float("inf"), "graphify": float("inf")}
                for _ in range(rounds):
                    for key, fn in (("eager", ref), ("graphify", graphed)):
                        best[key] = min(best[key], time_per_call(fn, x, calls, 1, sync=sync))
            err = (got.detach().double() - want.detach().double()).abs().max().item()
            row["steps"].append({"step": step, "eager_us": best["eager"],
                                 "graphify_us": best["graphify"],
                                 "ratio": best["graphify"] / best["eager"],
                                 "max_abs_err": err,
                                 "path": path_taken(before, cg.stats(graphed))})
        ratios = [s["ratio"] for s in row["steps"]]
        row["worst_ratio"] = max(ratios) if ratios else None
        row["over_target"] = [s["step"] for s in row["steps"] if s["ratio"] > TARGET]
    return rows


def path_taken(before, after) -> str:
    """What the calls between two snapshots of counters (``cg.Stats``) did, in words."""
    parts = [f"{n} {what}" for what, n in (
        ("capture(s)", after.captures - before.captures),
        ("retarget(s)", after.retargets - before.retargets),
        ("replay(s)", after.replays - before.replays),
        ("invalidation(s)", after.invalidations - before.invalidations)) if n]
    for reason, n in after.eager_calls.items():
        if n > before.eager_calls.get(reason, 0):
            parts.append(f"{n - before.eager_calls.get(reason, 0)} eager ({reason})")
    return "; ".join(parts) or "nothing counted"


def format_differential(row: dict) -> str:
    if "skipped" in row:
        return f"{row['workload']}: skipped: {row['skipped']}"
    over = ", ".join(row["over_target"]) or "none"
    lines = [f"{row['workload']}: worst step {row['worst_ratio']:.3f}x eager (target <= "
             f"{row['target']:g} in every step; over it: {over})"]
    for s in row["steps"]:
        lines.append(f"  {s['step']:<30} eager {s['eager_us']:8.0f} µs  graphify "
                     f"{s['graphify_us']:8.0f} µs  {s['ratio']:6.3f}x  max abs err "
                     f"{s['max_abs_err']:.1e}  {s['path'][:160]}")
    return "\n".join(lines)
