"""#16's A-item row (workload A's GPT, an ``.item()`` in every block, run piecewise): where a
forward's host time goes under ``graphify``, block by block.

Builds the model as the bench's ``--sync item`` section does (``model_and_input(WORKLOADS["A"],
sync="item")``, ``graphify`` with no option, 24 calls under ``no_grad`` to settle the plan,
its pieces' trials and the plan's trial), then prints:

- µs per forward, eager and graphify, best of interleaved rounds;
- the plan: each piece graphed or given back, and why (``cg.explain``'s lines);
- an instrumented run: per block, the block's whole call; per piece (ln1, attn, ln2, mlp), its
  call from the block (``Module.__call__`` on), split into the dispatch before the fast path
  (DirectCall), the fast path's checks and output hand-out (what is left of ``Fast.call``),
  copy-in and replay; a given-back piece's plain forward; and the block's own eager ops
  (its ``add``, ``abs``, ``amax``, ``.item()``, ``mul``, ``add`` and the Python around them:
  the block's call less its pieces' calls). Each timer costs about 0.1 µs, included;
- with ``--segments``, the same model with segments on: µs per forward, the segments' plan
  and their trial's verdict.

``--cpu`` (the default without a GPU): the CPU double (tests/conftest.py's SimBackend, its
replay a no-op, timed with the host clock). Eager on the CPU computes in bf16 for real, so the
eager/graphify ratio means nothing there: read the host-time parts. ``--give-back-norms``
gives every LayerNorm piece back after the settling calls, as the H100 trial did (24 of 49).
``--dim N`` shrinks the model (heads kept at 12 where they divide N, else 1).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import sys
import time
import warnings

import torch

import cudagraphify as cg
from cudagraphify import _fast, _wrap
from cudagraphify.bench.models import WORKLOADS, GPT, SyncBlock, model_and_input

p = argparse.ArgumentParser()
p.add_argument("--cpu", action="store_true")
p.add_argument("--give-back-norms", action="store_true")
p.add_argument("--segments", action="store_true")
p.add_argument("--dim", type=int, default=None)
p.add_argument("--rounds", type=int, default=5)
p.add_argument("--calls", type=int, default=20)
opts = p.parse_args()

DEV = "cuda" if torch.cuda.is_available() and not opts.cpu else "cpu"
if DEV == "cpu":
    sys.path.insert(0, "tests")
    from conftest import SimBackend, SimGraph
    from cudagraphify import _capture
    SimGraph.replay = lambda self: None
    backend = SimBackend()
    backend.clock = lambda device: time.perf_counter
    _capture.set_backend(backend)
    torch.set_num_threads(1)  # (eager's bf16 kernels fight any other process for the cores)
warnings.simplefilter("ignore")
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
clock = time.perf_counter

cfg = WORKLOADS["A"]
if opts.dim:
    cfg = dataclasses.replace(cfg, dim=opts.dim, heads=12 if opts.dim % 12 == 0 else 1)

# -- timers (installed before graphify: DirectCall binds its __call__ at install) ----------
spent: dict[str, float] = collections.defaultdict(float)
counts: dict[str, int] = collections.defaultdict(int)
names: dict[int, str] = {}  # id(GraphedState) -> piece kind (ln1, attn, ...)
current = ["-"]  # the graphed callable whose call runs now
PIECES = ("ln1", "attn", "ln2", "mlp", "ln_f")
timing = [False]

_direct_call = _wrap.DirectCall.__call__
_fast_call = _fast.Fast.call
_block_forward = SyncBlock.forward
_norm_forward = torch.nn.LayerNorm.forward


def direct_call(self, *args, **kwargs):
    if not timing[0]:
        return _direct_call(self, *args, **kwargs)
    kind = names.get(id(self.state), "other")
    outer, current[0] = current[0], kind
    t = clock()
    try:
        return _direct_call(self, *args, **kwargs)
    finally:
        spent[f"{kind}.call"] += clock() - t
        counts[f"{kind}.call"] += 1
        current[0] = outer


def fast_call(self, fn, args, kwargs):
    if not timing[0]:
        return _fast_call(self, fn, args, kwargs)
    kind = current[0]
    t = clock()
    out = _fast_call(self, fn, args, kwargs)
    spent[f"{kind}.fast"] += clock() - t
    if out is _fast.MISS:
        counts[f"{kind}.miss"] += 1
    return out


def block_forward(self, x):
    if not timing[0]:
        return _block_forward(self, x)
    t = clock()
    try:
        return _block_forward(self, x)
    finally:
        spent["block"] += clock() - t
        counts["block"] += 1


def norm_forward(self, x):
    if not timing[0] or current[0] in PIECES:
        return _norm_forward(self, x)
    kind = names.get(id(self.__dict__.get("_cudagraphify_state")), "other")
    t = clock()
    try:
        return _norm_forward(self, x)
    finally:
        spent[f"{kind}.plain"] += clock() - t


_wrap.DirectCall.__call__ = direct_call
torch.nn.LayerNorm.forward = norm_forward
_fast.Fast.call = fast_call
SyncBlock.forward = block_forward


class _TimedCopy:
    __slots__ = ("buf", "kind")

    def __init__(self, buf, kind):
        self.buf, self.kind = buf, kind

    def copy_(self, x):
        t = clock()
        self.buf.copy_(x)
        spent[f"{self.kind}.copy_in"] += clock() - t
        counts[f"{self.kind}.copy_in"] += 1


def timed_replay(replay, kind):
    def run():
        t = clock()
        replay()
        spent[f"{kind}.replay"] += clock() - t
    return run


def instrument(model) -> None:
    """Name each piece's state; wrap its fast path's entry's copy-in and replay."""
    for name, m in model.named_modules():
        st = m.__dict__.get("_cudagraphify_state")
        if st is None or m is model:
            continue
        kind = name.rsplit(".", 1)[-1]
        names[id(st)] = kind
        fast = st._fast
        if type(fast) is _fast.Fast:
            e = fast.entry
            e._copy_in = [(i, _TimedCopy(buf, kind), ptr) for i, buf, ptr in e._copy_in]
            e._replay = timed_replay(e._replay, kind)


def per_call(fn, x, calls) -> float:
    sync()
    t = clock()
    for _ in range(calls):
        fn(x)
    sync()
    return (clock() - t) / calls * 1e6


def settle(m, x) -> None:
    for _ in range(24):  # as the bench: the plan, its pieces' trials, the plan's trial
        m(x)


def plan_lines(model) -> list[str]:
    out = []
    for name, m in model.named_modules():
        st = m.__dict__.get("_cudagraphify_state")
        if st is None or m is model:
            continue
        out.append((name, "given back" if st.given_back is not None else
                    ("graphed" if type(st._fast) is _fast.Fast else f"eager ({type(st._fast).__name__})"),
                    st.given_back or ""))
    return out


def main() -> None:
    model, x = model_and_input(cfg, DEV, "item")
    print(f"device {DEV}; config {cfg}")
    with torch.no_grad():
        ref = model(x)
        g = GPT.from_config(cfg, DEV, sync="item")
        g.load_state_dict(model.state_dict())
        cg.graphify(g)
        settle(g, x)
        if opts.give_back_norms:
            for name, m in g.named_modules():
                st = m.__dict__.get("_cudagraphify_state")
                if isinstance(m, torch.nn.LayerNorm) and st is not None and st.given_back is None:
                    with st.lock:
                        st.give_back("given back by aitem_cpu.py (--give-back-norms)")
            settle(g, x)
        print("graphify output bitwise eager's:", torch.equal(g(x), ref))
        variants = {"eager": model, "graphify": g}
        seg = None
        if opts.segments:
            from cudagraphify import _segrun
            seg = GPT.from_config(cfg, DEV, sync="item")
            seg.load_state_dict(model.state_dict())
            cg.graphify(seg, segments=True)
            settle(seg, x)
            variants["segments"] = seg
        samples = {k: [] for k in variants}
        for _ in range(opts.rounds):
            for k, fn in variants.items():
                samples[k].append(per_call(fn, x, opts.calls))
        for k, v in samples.items():
            print(f"  {k:<10} best {min(v):9.0f} µs  median {statistics.median(v):9.0f} µs"
                  f"  ({min(v) / min(samples['eager']):.3f} of eager's best)")
        print("plan (pieces):")
        kinds = collections.Counter()
        for name, how, why in plan_lines(g):
            kinds[(name.rsplit(".", 1)[-1], how)] += 1
        for (kind, how), n in sorted(kinds.items()):
            print(f"  {kind:<5} {how:<12} x{n}")
        whys = collections.Counter(why.split(" (")[0] for _, _, why in plan_lines(g) if why)
        for why, n in whys.items():
            print(f"    x{n}: {why}")
        print("  root:", getattr(g._cudagraphify_state, "plan_verdict", None))
        if seg is not None:
            s = cg.stats(seg)
            print(f"segments: {s.segments} graphed, {s.segment_replays} replays")
            for plan in seg._cudagraphify_state.segments.plans():
                for line in plan.describe()[:8]:
                    print("   ", line)

        # -- the instrumented run ----------------------------------------------------------
        instrument(g)
        n = opts.calls * opts.rounds
        timing[0] = True
        t = clock()
        for _ in range(n):
            g(x)
        sync()
        total = clock() - t
        timing[0] = False
        blocks = counts["block"] or 1
        us = lambda key: spent[key] / blocks * 1e6  # µs per block
        print(f"instrumented graphify: {total / n * 1e6:.0f} µs a forward "
              f"({spent['block'] / n * 1e6:.0f} in its {blocks // n} blocks); µs per block:")
        pieces = 0.0
        for kind in ("ln1", "attn", "ln2", "mlp"):
            call, fastt = us(f"{kind}.call"), us(f"{kind}.fast")
            copy, replay = us(f"{kind}.copy_in"), us(f"{kind}.replay")
            pieces += call
            if fastt:
                print(f"  {kind:<5} call {call:6.1f} = dispatch {call - fastt:5.1f} + checks and "
                      f"hand-out {fastt - copy - replay:5.1f} + copy-in {copy:5.1f} (x"
                      f"{counts[f'{kind}.copy_in'] / blocks:.1f}) + replay {replay:5.1f}"
                      f"{'; fast-path misses ' + str(counts[kind + '.miss']) if counts[kind + '.miss'] else ''}")
            else:
                plain = us(f"{kind}.plain")
                pieces += plain
                print(f"  {kind:<5} call {plain:6.1f} (its plain forward, given back; "
                      "Module.__call__ not included)")
        print(f"  block's own ops and Python {us('block') - pieces:6.1f}")
        print(f"  block total {us('block'):6.1f}")
        print(f"  root and ln_f, per forward: {(total - spent['block']) / n * 1e6:.1f} µs")


main()
