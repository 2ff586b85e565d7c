"""#16: what a segments replay costs per torch call, against the floor of its design.

On workload A's GPT with an ``.item()`` in every block (``--sync item`` or ``item-inline``),
prints µs per forward, best of interleaved rounds, for:

- eager;
- ``bare mode``: eager under a ``TorchFunctionMode`` that only calls through;
- ``floor``: a ``TorchFunctionMode`` that answers every call but ``.item()`` with the output
  recorded at that position (no check, no graph): what any interception of every call costs;
- ``module floor``: as ``floor``, but the calls of the block's submodules (Attention, MLP,
  LayerNorm) are answered whole, at the module call, with the output recorded there, their
  own Python and ops not run: what matching a submodule call as one member of a segment (its
  state guarded as a piece's is) could reach;
- ``pieces``: ``graphify`` (its piecewise plan, pieces chained);
- ``segments``: ``graphify(segments=True)`` with the segments kept (no trial);

then, with ``--parts``, where the segments' forward spends its time (timers around the replay's
parts, unprofiled: a timer pair costs about 0.1 µs): to its first torch call (the entry), the
member calls met one by one, the boundaries run eagerly (a host sync's wait among them), the
module calls answered whole, the graph launches, the output copy; with ``--profile``, a
cProfile of the segments' replays (top functions by own time) and the total of the compiled
member checks. On a machine without CUDA (or ``--cpu``) the CPU double
(tests/conftest.py's SimBackend, its replay a no-op) stands in: host time only.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import sys
import time
import warnings

import torch
from torch.overrides import TorchFunctionMode

import cudagraphify as cg
from cudagraphify.bench.models import WORKLOADS, GPT, model_and_input

p = argparse.ArgumentParser()
p.add_argument("--cpu", action="store_true")
p.add_argument("--sync", default="item-inline")
p.add_argument("--dim", type=int, default=None)
p.add_argument("--rounds", type=int, default=5)
p.add_argument("--calls", type=int, default=30)
p.add_argument("--profile", action="store_true")
p.add_argument("--parts", action="store_true")
opts = p.parse_args()
warnings.simplefilter("ignore")

DEV = "cuda" if torch.cuda.is_available() and not opts.cpu else "cpu"
if DEV == "cpu":
    sys.path.insert(0, "tests")
    from conftest import SimBackend, SimGraph
    from cudagraphify import _capture
    SimGraph.replay = lambda self: None
    _capture.set_backend(SimBackend())  # (no clock: no trial, segments and pieces kept)
    torch.set_num_threads(1)
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
cfg = WORKLOADS["A"]
if opts.dim:
    cfg = dataclasses.replace(cfg, dim=opts.dim, heads=12 if opts.dim % 12 == 0 else 1)


class Bare(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class Record(TorchFunctionMode):
    def __init__(self, outs):
        super().__init__()
        self.outs = outs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.outs.append(out)
        return out


class Floor(TorchFunctionMode):
    def __init__(self, outs):
        super().__init__()
        self.outs, self.i = outs, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        i = self.i
        self.i = i + 1
        if func is torch.Tensor.item:
            return func(*args, **(kwargs or {}))
        out = self.outs[i]
        return out.detach() if type(out) is torch.Tensor else out


class ModuleFloor:
    """Submodule calls answered whole with the outputs recorded at them (``record`` first),
    the remaining top-level calls by :class:`Floor`'s rule (their own outputs)."""

    def __init__(self):
        from cudagraphify.bench import models
        self.kinds = (models.Attention, models.MLP, torch.nn.LayerNorm)
        self.orig = {k: k.forward for k in self.kinds}
        self.outs: list = []
        self.ops: list = []
        self.i = 0

    def record(self, model, x):
        def rec(k):
            def forward(m, *a):
                out = self.orig[k](m, *a)
                self.outs.append(out)
                return out
            return forward
        for k in self.kinds:
            k.forward = rec(k)
        try:
            class Ops(TorchFunctionMode):  # (the calls outside the submodules)
                def __torch_function__(mode, func, types, args=(), kwargs=None):
                    out = func(*args, **(kwargs or {}))
                    mode_outs.append(out)
                    return out
            mode_outs = self.ops
            for k in self.kinds:  # (their own ops are not recorded: run outside the mode)
                k.forward = (lambda k: lambda m, *a: _outside(lambda: rec(k)(m, *a)))(k)
            with Ops():
                model(x)
        finally:
            for k in self.kinds:
                k.forward = self.orig[k]

    def run(self, model, x):
        def replay(m, *a):
            i = self.i
            self.i = i + 1
            return _outside(self.outs[i].detach)  # (not a call the Floor mode answers)
        for k in self.kinds:
            k.forward = replay
        self.i = 0
        try:
            with Floor(self.ops):
                return model(x)
        finally:
            for k in self.kinds:
                k.forward = self.orig[k]


def _outside(fn):
    """``fn()`` with the current TorchFunctionMode off."""
    from torch.overrides import _pop_mode_temporarily
    with _pop_mode_temporarily():
        return fn()


def per_call(fn, x) -> float:
    sync()
    t = time.perf_counter()
    for _ in range(opts.calls):
        fn(x)
    sync()
    return (time.perf_counter() - t) / opts.calls * 1e6


def main() -> None:
    model, x = model_and_input(cfg, DEV, opts.sync)
    print(f"device {DEV} ({torch.cuda.get_device_name() if DEV == 'cuda' else 'CPU double'}), "
          f"torch {torch.__version__}, sync {opts.sync}, {cfg}")
    with torch.no_grad():
        ref = model(x)
        outs: list = []
        with Record(outs):
            model(x)

        def bare(x):
            with Bare():
                return model(x)

        def floor(x):
            with Floor(outs):
                return model(x)

        mf = ModuleFloor()
        mf.record(model, x)
        variants = {"eager": model, "bare mode": bare, "floor": floor,
                    "module floor": lambda x: mf.run(model, x)}
        for name, segs in (("pieces", False), ("segments", True)):
            g = GPT.from_config(cfg, DEV, sync=opts.sync)
            g.load_state_dict(model.state_dict())
            cg.graphify(g, segments=segs)
            if segs:  # (kept whatever their trial would say: the cost of the design is asked)
                from cudagraphify import _trial
                _trial.MARGIN = float("inf")
            for _ in range(30):
                g(x)
            s = cg.stats(g)
            print(f"{name}: bitwise eager's: {torch.equal(g(x), ref)}; graphs {s.graphs}, "
                  f"segments {s.segments}, segment replays {s.segment_replays}")
            variants[name] = g
        samples = {k: [] for k in variants}
        for _ in range(opts.rounds):
            for k, fn in variants.items():
                samples[k].append(per_call(fn, x))
        best_eager = min(samples["eager"])
        for k, v in samples.items():
            print(f"  {k:<12} {min(v):8.0f} µs  ({min(v) / best_eager:.3f} of eager; "
                  f"{min(v) / len(outs):.2f} µs per call of the forward's {len(outs)})")
        if opts.parts:
            parts(variants["segments"], x)
        if opts.profile:
            g = variants["segments"]
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(opts.calls):
                g(x)
            sync()
            pr.disable()
            st = pstats.Stats(pr)
            own = [v for k, v in st.stats.items() if k[0].startswith("<segment call")]
            print(f"compiled member checks: {sum(v[1] for v in own)} calls, "
                  f"{sum(v[2] for v in own) / opts.calls * 1e6:.0f} µs a forward (profiled)")
            st.sort_stats("tottime").print_stats(22)


def parts(g, x) -> None:
    """Timers around the parts of the segments' replay (see the module's docstring)."""
    from cudagraphify import _segmodes, _segrun
    clock = time.perf_counter_ns
    acc: dict[str, list[int]] = {}
    first: list[int] = []
    saved = []

    def wrap(cls, name, key, split=None):
        fn = cls.__dict__[name]
        saved.append((cls, name, fn))
        acc[key] = [0, 0]

        def timed(*args, **kwargs):
            which = split(args) if split else key
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                a = acc[which]
                a[0] += clock() - t
                a[1] += 1
        setattr(cls, name, timed)

    def member_or_boundary(args):
        run = args[0].run
        if not first:
            first.append(clock())
        calls = run.plan.calls
        i = run.cursor
        return "member calls" if i < len(calls) and calls[i].segment is not None \
            and not run.diverged else "eager calls"
    acc["member calls"] = [0, 0]
    wrap(_segmodes._Replayer, "__torch_function__", "eager calls", member_or_boundary)
    wrap(_segmodes._Replayer, "module", "module calls (inclusive)")
    wrap(_segmodes._Run, "whole", "answered whole")
    wrap(_segmodes._Run, "flush", "graph launches")
    wrap(_segrun.SegmentPlan, "owned", "output copy")
    try:
        rounds = []
        for _ in range(opts.rounds):
            for a in acc.values():
                a[:] = [0, 0]
            entry = total = 0
            for _ in range(opts.calls):
                first.clear()
                sync()
                t = clock()
                g(x)
                sync()
                total += clock() - t
                entry += first[0] - t if first else 0
            rounds.append((total, entry, {k: list(v) for k, v in acc.items()}))
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)
    total, entry, best = min(rounds, key=lambda r: r[0])
    n = opts.calls
    print(f"segments' parts (the fastest of {opts.rounds} rounds; µs a forward, timers on):")
    print(f"  total {total / n / 1e3:8.0f}")
    print(f"  entry {entry / n / 1e3:8.0f}  (the call to its first torch call)")
    for k, (ns, count) in best.items():
        print(f"  {k:<26} {ns / n / 1e3:8.0f}  over {count / n:5.0f} a forward "
              f"({ns / max(count, 1) / 1e3:.2f} µs each)")


main()
