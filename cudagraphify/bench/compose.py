"""Composability benchmark: each combination of cudagraphify with another system, against the
same stack without cudagraphify, on workload A (or another), in one process and run.

    python -m cudagraphify.bench.compose [--workload A] [--quick] [--json out.json]

FSDP2 and DDP run over NCCL with world size 1 (this process). Each row says whether the
combination works (graphs replayed, outputs equal), runs eagerly with cudagraphify's reason, or
failed (the error); then µs per call (an inference call or a training step) of both stacks and
their ratio, and the time to the first graphed call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

import torch

from ._common import progress, time_per_call
from .models import GPT, WORKLOADS, GPTConfig

__all__ = ["main"]


def _progress(message: str) -> None:
    progress(f"compose: {message}")


def _model(cfg: GPTConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT.from_config(cfg, "cuda")


def _training_step(model: torch.nn.Module):
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step(x):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _graph_counters(blocks) -> tuple[int, int, dict]:
    """Captures, replays and eager calls by reason, over the graphed stack's blocks."""
    import cudagraphify as cg

    total = sum((cg.stats(b) for b in blocks), cg.Stats())
    return total.captures, total.replays, total.eager_calls


def _measure(name: str, build_plain, build_graphed, call, x, calls: int, repeats: int,
             blocks_of=lambda m: m.blocks) -> dict:
    """Build both stacks, check outputs agree, time both; the graphed stack's blocks report."""
    row: dict = {"combination": name}
    try:
        _progress(f"{name}: stack without cudagraphify")
        plain = build_plain()
        fn_plain = call(plain)
        t0 = time.perf_counter()
        want = fn_plain(x)
        torch.cuda.synchronize()
        row["plain_first_call_s"] = time.perf_counter() - t0
        row["plain_us"] = time_per_call(fn_plain, x, calls, repeats)
        _progress(f"{name}: with cudagraphify")
        graphed = build_graphed()
        fn = call(graphed)
        t0 = time.perf_counter()
        fn(x), fn(x)
        torch.cuda.synchronize()
        row["first_call_s"] = time.perf_counter() - t0
        got = fn(x)
        if want is not None:
            row["max_abs_err"] = (got.float() - want.float()).abs().max().item()
        row["graphed_us"] = time_per_call(fn, x, calls, repeats)
        row["ratio"] = row["graphed_us"] / row["plain_us"]
        captures, replays, reasons = _graph_counters(blocks_of(graphed))
        row.update(captures=captures, replays=replays, eager_reasons=reasons)
        row["outcome"] = ("works (graphs replayed)" if replays and not reasons else
                          "eager: " + "; ".join(sorted(reasons)) if reasons else "no graphs")
    except Exception as e:  # a combination that fails is a result, not the end of the run
        row["outcome"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        torch.cuda.synchronize()
    return row


def _inference(model):
    def run(x):
        with torch.no_grad():
            return model(x)
    return run


def _returns_none(step):
    def run(x):
        step(x)
        return None
    return run


def run_all(cfg: GPTConfig, calls: int, repeats: int, only: list[str] | None,
            on_row=lambda rows: None) -> list[dict]:
    """Every combination's row (``on_row(rows)`` after each: a run cut short keeps its rows)."""
    import cudagraphify as cg
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(cfg.batch, cfg.seq, cfg.dim, device="cuda", dtype=cfg.dtype)
    mesh = init_device_mesh("cuda", (1,))

    def fsdp(reshard: bool, graphed: bool):
        def build():
            m = _model(cfg)
            for b in m.blocks:
                fully_shard(b, mesh=mesh, reshard_after_forward=reshard)
                if graphed:
                    cg.graphify(b)
            fully_shard(m, mesh=mesh, reshard_after_forward=reshard)
            return m
        return build

    def blocks(graphed: bool, wrap=lambda b: b, model_wrap=lambda m: m, train=False):
        def build():
            m = _model(cfg)
            if train:
                m.train()
            for i, b in enumerate(m.blocks):
                b = wrap(b)
                m.blocks[i] = cg.graphify(b) if graphed else b
            return model_wrap(m)
        return build

    class Checkpointed(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.blocks = inner.blocks

        def forward(self, x):
            for b in self.inner.blocks:
                x = checkpoint(b, x, use_reentrant=False)
            return self.inner.ln_f(x)

    def train(m):
        return _returns_none(_training_step(m))

    ddp_blocks = lambda m: m.module.blocks  # noqa: E731
    compiled_blocks = lambda m: m._orig_mod.blocks  # noqa: E731
    combos = {
        "fsdp2_keep": ("FSDP2 reshard_after_forward=False, inference",
                       fsdp(False, False), fsdp(False, True), _inference, {}),
        "fsdp2_reshard": ("FSDP2 reshard_after_forward=True, inference",
                          fsdp(True, False), fsdp(True, True), _inference, {}),
        "fsdp2_train": ("FSDP2 reshard_after_forward=False, training step",
                        fsdp(False, False), fsdp(False, True), train, {}),
        "ddp_train": ("DDP, graphified blocks, training step",
                      blocks(False, model_wrap=DDP, train=True),
                      blocks(True, model_wrap=DDP, train=True), train,
                      {"blocks_of": ddp_blocks}),
        "compile_over": ("torch.compile (inductor) over graphified blocks, inference",
                         blocks(False, model_wrap=torch.compile),
                         blocks(True, model_wrap=torch.compile), _inference,
                         {"blocks_of": compiled_blocks}),
        "over_compile": ("graphify over torch.compile'd blocks, inference",
                         blocks(False, wrap=torch.compile), blocks(True, wrap=torch.compile),
                         _inference, {}),
        "over_compiled_model": ("graphify over torch.compile'd whole model, inference",
                                lambda: torch.compile(_model(cfg)),
                                lambda: cg.graphify(torch.compile(_model(cfg))), _inference,
                                {"blocks_of": lambda m: [m]}),
        "checkpoint_train": ("checkpoint(graphified block), training step",
                             lambda: Checkpointed(blocks(False, train=True)()),
                             lambda: Checkpointed(blocks(True, train=True)()), train, {}),
    }
    try:
        import thunder

        combos["over_thunder"] = ("graphify over thunder.jit'd whole model, inference",
                                  lambda: thunder.jit(_model(cfg)),
                                  lambda: cg.graphify(thunder.jit(_model(cfg))), _inference,
                                  {"blocks_of": lambda m: [m]})
    except Exception as e:  # noqa: BLE001 - any import failure means: not available here
        _progress(f"thunder not importable ({type(e).__name__}): its row is skipped")
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for key, (name, plain, graphed, call, extra) in combos.items():
            if only and key not in only:
                continue
            rows.append({"key": key, **_measure(name, plain, graphed, call, x, calls, repeats,
                                                **extra)})
            on_row(rows)
            torch._dynamo.reset()
        if not only or "reduce_overhead" in only:
            rows.append({"key": "reduce_overhead", **_reduce_overhead(cfg, x, calls, repeats)})
            on_row(rows)
    return rows


def _reduce_overhead(cfg: GPTConfig, x, calls: int, repeats: int) -> dict:
    """torch.compile(mode="reduce-overhead") of the whole model: the row to compare
    graphify-over-compiled-blocks with (µs, and the time to the first fast call)."""
    row: dict = {"combination": 'torch.compile(mode="reduce-overhead"), whole model, inference'}
    try:
        _progress("torch.compile reduce-overhead (compiling)")
        m = torch.compile(_model(cfg), mode="reduce-overhead")
        run = _inference(m)
        t0 = time.perf_counter()
        for _ in range(3):  # cudagraph trees record on the 2nd/3rd call
            run(x)
        torch.cuda.synchronize()
        row["first_call_s"] = time.perf_counter() - t0
        row["graphed_us"] = time_per_call(run, x, calls, repeats)
        row["outcome"] = "works"
    except Exception as e:  # noqa: BLE001
        row["outcome"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    torch._dynamo.reset()
    return row


def _table(rows: list[dict]) -> str:
    lines = [f"{'combination':62} {'plain µs':>9} {'graphed µs':>10} {'ratio':>6} "
             f"{'1st s':>6}  outcome"]
    for r in rows:
        def num(k, fmt):
            return format(r[k], fmt) if isinstance(r.get(k), (int, float)) else "-"
        lines.append(f"{r['combination'][:62]:62} {num('plain_us', '9.0f')} "
                     f"{num('graphed_us', '10.0f')} {num('ratio', '6.3f')} "
                     f"{num('first_call_s', '6.2f')}  {r['outcome']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cudagraphify.bench.compose",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="A", choices=sorted(WORKLOADS))
    p.add_argument("--only", nargs="*", default=None, help="combination keys to run")
    p.add_argument("--quick", action="store_true", help="fewer calls and repeats")
    p.add_argument("--json", help="write the rows as JSON to this file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("cudagraphify.bench.compose: no CUDA GPU here; FSDP2/DDP/compile with CUDA graphs need one.")
        return 0
    import torch.distributed as dist

    calls, repeats = (20, 3) if args.quick else (50, 5)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 'pg')}",
                                rank=0, world_size=1, device_id=torch.device("cuda", 0))
        print(f"workload {args.workload}: {WORKLOADS[args.workload]}; torch "
              f"{torch.__version__}, {torch.cuda.get_device_name()}", flush=True)

        def on_row(rows):
            lines = _table(rows[-1:]).splitlines()  # the header before the first row only
            print("\n".join(lines if len(rows) == 1 else lines[1:]), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1, default=str)

        try:
            run_all(WORKLOADS[args.workload], calls, repeats, args.only, on_row)
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
