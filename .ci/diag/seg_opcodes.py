"""#16: a deterministic measure of what the segments' replay costs on the host, for machines
whose timings are too noisy to compare two versions of the per-call path: the Python opcodes,
C calls and Python calls executed in one forward (``sys.settrace`` with opcode events and
``sys.setprofile``), on the CPU double (tests/conftest.py's SimBackend, its replay a no-op).

Prints, for workload A with a ``.item()`` in every block (``--sync item`` or ``item-inline``):
the plain model's counts, the segments' counts (``graphify(segments=True)``, its segments kept
whatever their trial says), then the functions that executed the most opcodes in a segments
forward (``--top N``), and with ``--lines NAME`` the opcodes per line of the functions called
NAME (e.g. ``__torch_function__``, ``whole``).

A rough rule from 2026-12-08 (this machine, 2 cores): about 8 ns of host time an opcode on top
of the C work; on the GPU machine's slower host, more. Compare versions by their counts.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import linecache
import sys
import warnings

import torch

sys.path.insert(0, "tests")
from conftest import SimBackend, SimGraph  # noqa: E402

import cudagraphify as cg  # noqa: E402
from cudagraphify import _capture, _trial  # noqa: E402
from cudagraphify.bench.models import GPT, WORKLOADS, model_and_input  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--sync", default="item-inline", choices=["item", "item-inline", "nonzero"])
p.add_argument("--dim", type=int, default=None)
p.add_argument("--top", type=int, default=20)
p.add_argument("--lines", default=None, metavar="NAME")
opts = p.parse_args()
warnings.simplefilter("ignore")
SimGraph.replay = lambda self: None
_capture.set_backend(SimBackend())
_trial.MARGIN = float("inf")  # (kept whatever their trial would say)
torch.set_num_threads(1)


def counted(fn, x, lines_of=None):
    """(opcodes, C calls, Python calls, opcodes by function, opcodes by line of ``lines_of``)."""
    n = [0, 0, 0]
    by_fn: collections.Counter = collections.Counter()
    by_line: collections.Counter = collections.Counter()

    def tracer(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            n[0] += 1
            code = frame.f_code
            by_fn[(code.co_filename, code.co_name, code.co_firstlineno)] += 1
            if code.co_name == lines_of:
                by_line[(code.co_filename, frame.f_lineno)] += 1
        return tracer

    def profiler(frame, event, arg):
        if event == "c_call":
            n[1] += 1
        elif event == "call":
            n[2] += 1

    sys.settrace(tracer)
    sys.setprofile(profiler)
    try:
        fn(x)
    finally:
        sys.settrace(None)
        sys.setprofile(None)
    return n[0], n[1], n[2], by_fn, by_line


def main() -> None:
    cfg = WORKLOADS["A"]
    if opts.dim:
        cfg = dataclasses.replace(cfg, dim=opts.dim, heads=12 if opts.dim % 12 == 0 else 1)
    model, x = model_and_input(cfg, "cpu", opts.sync)
    g = GPT.from_config(cfg, "cpu", sync=opts.sync)
    g.load_state_dict(model.state_dict())
    cg.graphify(g, segments=True)
    with torch.no_grad():
        for _ in range(30):
            g(x)
        s = cg.stats(g)
        assert torch.equal(g(x), model(x))
        print(f"sync {opts.sync}, {cfg}: segments {s.segments}, segment replays "
              f"{s.segment_replays} in 31 calls (bitwise eager's)")
        for name, fn in (("plain model", model), ("segments", g)):
            ops, c_calls, py_calls, by_fn, by_line = counted(fn, x, opts.lines)
            print(f"  {name:<12} {ops:7d} opcodes, {c_calls:5d} C calls, {py_calls:5d} Python "
                  "calls a forward")
        print(f"functions with the most opcodes in a segments forward (of {ops}):")
        for (path, func, line), k in by_fn.most_common(opts.top):
            where = path.split("/")[-1]
            print(f"  {k:7d} {100 * k / ops:5.1f}%  {where}:{line} {func}")
        if opts.lines:
            print(f"opcodes by line of {opts.lines}:")
            for (path, line), k in sorted(by_line.items(),
                                          key=lambda kv: (kv[0][0], kv[0][1] or 0)):
                text = linecache.getline(path, line or 0).strip()[:90]
                print(f"  {k:6d}  {path.split('/')[-1]}:{line}  {text}")


main()
