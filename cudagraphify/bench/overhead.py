"""``--overhead``: what cudagraphify's call path costs, in µs per call, against what it replaces.

One process, one run: every row is timed in turn, round after round, and keeps its best round
(the GPU machine's host is shared: interleaving spreads its load over all rows). A tiny
workload (``torch.nn.Linear(64, 64)`` on a (4, 64) CUDA input, ``torch.no_grad()``) makes GPU
time negligible, so the rows show the Python cost of each call path:

- eager; a hand capture's raw ``CUDAGraph.replay()``; hand copy-in + replay; hand copy-in +
  replay + clone (what ``graphify`` does on a replay);
- ``graphify``, ``graphify(copy_outputs=False)``, ``graphify`` inside a ``graph_region``;
- calls the cache decides to run eagerly: an opaque argument (a plain class instance), and a
  known-ineligible signature (``.item()`` on a CUDA tensor) keyed by a tuple of 1000 ints, each
  against the same module run eagerly;
- an HF transformers Llama decode step with its default ``DynamicCache``, eager vs ``graphify``.

Each compared row has a target (issue 15): ``graphify`` ≤ hand copy-in + replay + clone + 5 µs;
``copy_outputs=False`` and the region ≤ hand copy-in + replay + 5 µs; eager-decided calls ≤
eager + 3 µs; the HF decode step ≤ 1.03 × eager.
"""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ._common import error_text, hand_capture, progress, time_per_call

__all__ = ["LINES", "Line", "bench_overhead", "compare", "format_overhead"]


@dataclass(frozen=True)
class Line:
    """One row of the section; a compared row names its reference row and its target."""

    key: str
    label: str
    reference: str | None = None  # the key of the row it is compared with
    plus_us: float | None = None  # target: µs <= the reference's + plus_us
    times: float | None = None  # target: µs <= the reference's * times

    @property
    def target(self) -> str:
        if self.plus_us is not None:
            return f"<= ref + {self.plus_us:g} µs"
        return f"<= {self.times:g} x ref" if self.times is not None else ""


LINES = (
    Line("eager", "eager"),
    Line("raw_replay", "CUDAGraph.replay() of a hand capture"),
    Line("hand_copy", "hand copy-in + replay"),
    Line("hand_copy_clone", "hand copy-in + replay + clone"),
    Line("graphify", "graphify", "hand_copy_clone", plus_us=5),
    Line("graphify_nocopy", "graphify(copy_outputs=False)", "hand_copy", plus_us=5),
    Line("region", "graphify in a graph_region", "hand_copy", plus_us=5),
    Line("opaque_eager", "eager, an opaque argument"),
    Line("opaque_graphify", "graphify -> eager: opaque argument", "opaque_eager", plus_us=3),
    Line("ineligible_eager", "eager, .item(), 1000 ints"),
    Line("ineligible_graphify", "graphify -> eager: .item(), 1000 ints", "ineligible_eager",
         plus_us=3),
    Line("hf_decode_eager", "HF Llama decode step, eager"),
    Line("hf_decode_graphify", "HF Llama decode step, graphify", "hf_decode_eager", times=1.03),
)


class Scale:
    """A plain class: an argument of this type is opaque to the signature (runs eagerly)."""

    def __init__(self, value: float):
        self.value = value


class ScaledLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, scale: Scale) -> torch.Tensor:
        return self.lin(x) * scale.value


class SyncingLinear(nn.Linear):
    """A Linear with a host sync in its forward and no submodules: its signature is decided
    eager (unsafe, and a piecewise plan finds nothing to graph)."""

    def forward(self, x: torch.Tensor, ints: tuple[int, ...]) -> torch.Tensor:
        y = super().forward(x)
        return y if y[0, 0].item() < 1e30 else y * 0  # .item(): a host sync


def bench_overhead(calls: int, repeats: int, decode_steps: int = 32, decode_repeats: int = 7,
                   device: str = "cuda", capture=hand_capture) -> dict:
    """The section's row: ``us`` (key -> µs per call), ``lines`` (:func:`compare`), the
    graphified rows' counters (``counters``), and why a row did not run (``skipped``)."""
    import cudagraphify as cg

    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    row: dict = {"workload": "overhead", "calls": calls, "repeats": repeats, "us": {},
                 "counters": {}, "skipped": {}}
    us = row["us"]
    rows: dict[str, tuple] = {}  # key -> (fn, x, graphed or None), timed together below

    def timed(key: str, fn, x, graphed=None, into: dict | None = None) -> None:
        progress(f"overhead: {key}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", cg.CudagraphifyWarning)
            for _ in range(3):  # the first call captures (or decides), the next replay
                fn(x)
        (rows if into is None else into)[key] = (fn, x, graphed)

    torch.manual_seed(0)
    lin = nn.Linear(64, 64).to(device)
    x = torch.randn(4, 64, device=device)
    with torch.no_grad():
        timed("eager", lin, x)
        graph, static_x, static_y = capture(lin, x)
        replay = graph.replay

        def copy_in(inp):
            static_x.copy_(inp)
            replay()
            return static_y

        timed("raw_replay", lambda inp: replay(), x)
        timed("hand_copy", copy_in, x)
        timed("hand_copy_clone", lambda inp: copy_in(inp).clone(), x)
        for key, options in (("graphify", {}), ("graphify_nocopy", {"copy_outputs": False})):
            g = cg.graphify(copy.deepcopy(lin), **options)
            timed(key, g, x, g)
        scale, scaled = Scale(1.0), ScaledLinear().to(device)
        timed("opaque_eager", lambda inp: scaled(inp, scale), x)
        g = cg.graphify(copy.deepcopy(scaled))
        timed("opaque_graphify", lambda inp, g=g: g(inp, scale), x, g)

        ints, syncing = tuple(range(1000)), SyncingLinear(64, 64).to(device)
        timed("ineligible_eager", lambda inp: syncing(inp, ints), x)
        g = cg.graphify(copy.deepcopy(syncing))
        timed("ineligible_graphify", lambda inp, g=g: g(inp, ints), x, g)
        _interleaved(rows, us, calls, repeats, sync)
        # the region's row alone: its scope is entered once, around its warm-up and loops
        g = cg.graphify(copy.deepcopy(lin))
        region_rows: dict[str, tuple] = {}
        with cg.graph_region():
            timed("region", g, x, g, into=region_rows)
            region_rows["hand_copy"] = (copy_in, x, None)  # timed again beside it
            again: dict[str, float] = {}
            _interleaved(region_rows, again, calls, repeats, sync)
        us["region"] = again["region"] - again["hand_copy"] + us["hand_copy"]
        for key, (_, _, graphed) in list(rows.items()) + [("region", region_rows["region"])]:
            if graphed is not None:
                s = cg.stats(graphed)
                row["counters"][key] = {"captures": s.captures, "replays": s.replays,
                                        "eager_calls": dict(s.eager_calls)}

        _hf_decode(row, decode_steps, decode_repeats, device, sync)
    row["lines"] = compare(us)
    return row


def _interleaved(rows: dict, us: dict, calls: int, repeats: int, sync) -> None:
    """µs per call of each row: ``repeats`` rounds, each timing every row once (``calls``
    calls), in turn; each row's best round. Interleaving spreads the host's load changes over
    all rows; the best round is the one least disturbed (the call path's own cost)."""
    samples: dict[str, list[float]] = {key: [] for key in rows}
    for _ in range(repeats):
        for key, (fn, x, _) in rows.items():
            samples[key].append(time_per_call(fn, x, calls, 1, sync=sync))
    for key, values in samples.items():
        us[key] = min(values)


def _hf_decode(row: dict, steps: int, repeats: int, device: str, sync) -> None:
    """HF Llama (the decode section's config, bf16, random weights) with its default
    ``DynamicCache``: prefill once (not timed), then ``steps`` decode steps of one token;
    eager and ``graphify(model)`` take turns, ``repeats`` times; the median µs per step."""
    import cudagraphify as cg

    from .decode import DECODE_SIZES, cache_keyword

    try:
        import transformers
    except Exception as e:  # noqa: BLE001 - a broken install raises more than ImportError
        row["skipped"]["hf_decode"] = f"transformers is not importable ({error_text(e, 160)})"
        return
    try:
        prompt_len = 32
        config = transformers.LlamaConfig(**DECODE_SIZES,
                                          max_position_embeddings=prompt_len + steps + 8)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).to(device=device,
                                                         dtype=torch.bfloat16).eval()
        graphed = cg.graphify(copy.deepcopy(model))
        prompt = torch.randint(0, config.vocab_size, (1, prompt_len), device=device)
        keyword = cache_keyword(model)

        def decode(m) -> float:
            out = m(input_ids=prompt, use_cache=True)  # the prefill makes the DynamicCache
            cache, token = out[keyword], out.logits[:, -1:].argmax(-1)
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                out = m(input_ids=token, use_cache=True, **{keyword: cache})
                token = out.logits[:, -1:].argmax(-1)
            sync()
            return (time.perf_counter() - t0) / steps * 1e6

        progress(f"overhead: HF Llama decode ({steps} steps x {repeats}, eager and graphify)")
        samples: dict[str, list[float]] = {"hf_decode_eager": [], "hf_decode_graphify": []}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            decode(model), decode(graphed)  # first calls: warm-ups, captures, decisions
            for _ in range(repeats):
                samples["hf_decode_eager"].append(decode(model))
                samples["hf_decode_graphify"].append(decode(graphed))
        for key, values in samples.items():
            row["us"][key] = sorted(values)[len(values) // 2]
        s = cg.stats(graphed)
        row["counters"]["hf_decode_graphify"] = {"captures": s.captures, "replays": s.replays,
                                                 "eager_calls": dict(s.eager_calls)}
    except Exception as e:  # an API this code did not foresee: say so, keep the other rows
        row["skipped"]["hf_decode"] = error_text(e)


def compare(us: dict) -> list[dict]:
    """Each line of :data:`LINES` with its µs, its reference's, the difference, the ratio, the
    target and whether it is met (None where a number is missing)."""
    out = []
    for line in LINES:
        mine, ref = us.get(line.key), us.get(line.reference) if line.reference else None
        item = {"key": line.key, "label": line.label, "us": mine, "reference": line.reference,
                "reference_us": ref, "diff_us": None, "ratio": None, "target": line.target,
                "met": None}
        if mine is not None and ref is not None:
            item["diff_us"], item["ratio"] = mine - ref, mine / ref
            bound = ref + line.plus_us if line.plus_us is not None else ref * line.times
            item["met"] = mine <= bound
        out.append(item)
    return out


def format_overhead(row: dict) -> str:
    """The section as a table: µs, reference, difference, ratio, target and whether it is met."""
    labels = {line.key: line.label for line in LINES}
    lines = [f"overhead: µs per call, best of {row['repeats']} interleaved rounds of "
             f"{row['calls']} calls (Linear(64, 64), (4, 64) input, no_grad; the region's row: "
             "its own rounds beside hand copy-in + replay, shifted to this table's; HF decode: "
             "median µs per step)",
             f"  {'row':<38}{'µs':>8}  {'reference':<31}{'ref µs':>8}{'diff':>9}{'ratio':>8}"
             f"  target"]
    for item in row["lines"]:
        if item["us"] is None:
            why = next((v for k, v in row["skipped"].items() if item["key"].startswith(k)),
                       "not run")
            lines.append(f"  {item['label']:<38}{'-':>8}  skipped: {why}")
            continue
        text = f"  {item['label']:<38}{item['us']:>8.1f}"
        if item["reference"] is not None and item["reference_us"] is not None:
            verdict = "ok" if item["met"] else "MISSED"
            text += (f"  {labels[item['reference']]:<31}{item['reference_us']:>8.1f}"
                     f"{item['diff_us']:>+9.1f}{item['ratio']:>8.3f}  {item['target']} {verdict}")
        lines.append(text)
    for key, c in row["counters"].items():
        eager = "; ".join(f"{r} (x{n})" for r, n in c["eager_calls"].items()) or "none"
        lines.append(f"  {labels[key]}: captures {c['captures']}, replays {c['replays']}, "
                     f"eager calls: {eager}")
    return "\n".join(lines)
