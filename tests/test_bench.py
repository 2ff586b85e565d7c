"""The benchmark CLI on a machine without a GPU: it says so, times the eager model on the CPU,
writes JSON and a chart; its arguments, the ratios and the table of the columns, the decode row;
the column bookkeeping with CUDA calls stood in for; the graphed decode step through the
simulated capture backend (when transformers is installed)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from cudagraphify import bench
from cudagraphify.bench import decode as bench_decode, overhead, workloads


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only mode")
def test_cpu_mode_times_eager_only_and_writes_json_and_a_chart(tmp_path, capsys):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    assert bench.main(["--quick", "--workloads", "T", "--json", str(out), "--chart", str(png)]) == 0
    text = capsys.readouterr()
    assert "no CUDA GPU here" in text.out and "T: timing the eager model" in text.err
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert data["device"] == "cpu" and row["workload"] == "T" and row["eager_us"] > 0
    assert set(row) == {"workload", "config", "device", "eager_us"}  # no graph columns on a CPU
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chart_draws_every_timed_column_and_says_when_it_cannot(tmp_path, monkeypatch):
    rows = [{"workload": "A", "eager_us": 2700.0, "graphify_us": 510.0, "first_call_s": 0.03},
            {"workload": "B", "eager_us": 4600.0, "graphify_us": 980.0}]
    png = tmp_path / "c.png"
    assert bench.draw_chart(rows, str(png)) == f"chart written to {png}"
    assert png.stat().st_size > 1000
    assert bench.draw_chart([{"workload": "A"}], str(png)) == "no chart: no timed rows"
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert bench.draw_chart(rows, str(png)).startswith("no chart: matplotlib is not installed")


def test_arguments_pick_columns_decode_and_sizes():
    a = bench.parse_args([])
    assert a.columns is None and a.workloads is None and not a.decode and a.decode_tokens == 64
    a = bench.parse_args(["--columns", "mgc", "compile", "--workloads", "A", "--decode",
                          "--decode-tokens", "16", "--decode-batch", "2", "--quick"])
    assert a.columns == ["mgc", "compile"] and a.workloads == ["A"] and a.decode
    assert (a.decode_tokens, a.decode_batch, a.quick) == (16, 2, True)
    assert bench.parse_args(["--workloads"]).workloads == []  # only the other options' rows
    for bad in (["--columns", "xla"], ["--decode-tokens", "1"], ["--columns"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    assert set(workloads.COLUMNS) == {"graphify", "nocopy", "layers", "region", "share", "mgc",
                                  "compile", "thunder"}


def _full_row():
    row = {"workload": "A", "config": "GPTConfig(...)", "eager_us": 2700.0, "eager_peak_mb": 3.0,
           "manual_graph_us": 500.0, "manual_graph_first_call_s": 0.02,
           "manual_graph_peak_mb": 4.0, "manual_graph_max_abs_err": 0.0,
           "graphify_us": 510.0, "graphify_first_call_s": 0.03, "graphify_peak_mb": 5.0,
           "graphify_max_abs_err": 0.0,
           "make_graphed_callables_error": "RuntimeError: capture failed",
           "torch_compile_us": 520.0, "torch_compile_first_call_s": 41.5,
           "torch_compile_compile_s": 40.2, "torch_compile_peak_mb": 9.0,
           "torch_compile_max_abs_err": 0.0078125,
           "thunder_skipped": "not importable (ModuleNotFoundError: No module named 'thunder')"}
    return workloads.add_ratios(row)


def test_ratios_to_eager_and_to_the_manual_graph():
    row = _full_row()
    assert row["manual_graph_vs_eager"] == pytest.approx(500 / 2700)
    assert row["graphify_vs_eager"] == pytest.approx(510 / 2700)
    assert row["graphify_vs_manual"] == pytest.approx(510 / 500)
    assert row["torch_compile_vs_manual"] == pytest.approx(520 / 500)
    assert "manual_graph_vs_manual" not in row and "make_graphed_callables_vs_eager" not in row


def test_table_prints_every_column_with_its_numbers_or_why_not():
    text = workloads.format_workload(_full_row())
    lines = text.splitlines()
    assert lines[0] == "A: GPTConfig(...)" and "µs/call" in lines[1] and "peak MB" in lines[1]
    by_heading = {h: next(ln for ln in lines if ln.strip().startswith(h))
                  for _, h in list(workloads.ALWAYS) + list(workloads.COLUMNS.values())}
    assert by_heading["graphify"].split()[1:] == ["510", "0.189", "1.020", "0.030", "5.0",
                                                 "0.0e+00"]
    assert by_heading["manual graph (floor)"].split()[3:6] == ["500", "0.185", "1.000"]
    assert by_heading["eager"].split()[1:] == ["2700", "1.000", "5.400", "-", "3.0", "-"]
    assert "error: RuntimeError: capture failed" in by_heading["make_graphed_callables"]
    assert "(first call, compiling: 40.2 s)" in by_heading["torch.compile reduce-overhead"]
    assert "skipped: not importable" in by_heading["thunder.jit + CUDAGraphTransform"]
    assert by_heading["share_graph(blocks)"].endswith("not run")
    only = workloads.format_workload(_full_row(), ["graphify"])
    assert len(only.splitlines()) == 2 + 3 and "thunder" not in only


def test_decode_row_in_words():
    row = {"workload": "llama-decode", "config": "Llama {...}", "device": "cuda", "batch": 1,
           "prompt": 32, "new_tokens": 64, "eager_us": 1900.0, "eager_tokens_per_s": 526.0,
           "graphify_us": 300.0, "graphify_tokens_per_s": 3333.0, "graphify_speedup": 6.34,
           "tokens_identical": True, "graphify_first_call_s": 0.21, "graphify_peak_mb": 3.5,
           "graphify_captures": 1, "graphify_replays": 440, "graphify_eager_calls": {}}
    text = bench_decode.format_decode(row)
    assert "eager 526 tokens/s" in text and "graphify 3333 tokens/s" in text
    assert "speed-up 6.34x" in text and "tokens identical to eager: True" in text
    cpu = {k: v for k, v in row.items() if not k.startswith(("graphify", "tokens"))}
    assert bench_decode.format_decode({**cpu, "device": "cpu"}).endswith("on the cpu")
    assert bench_decode.format_decode({"error": "transformers is not importable (x)"}) == (
        "llama-decode: not run: transformers is not importable (x)")


def test_generate_lines_hold_each_form_to_its_own_targets():
    row = {"workload": "llama-decode", "config": "Llama {...}", "device": "cuda", "batch": 1,
           "prompt": 32, "new_tokens": 64, "eager_us": 1900.0, "eager_tokens_per_s": 526.0,
           "graphify_us": 300.0, "graphify_tokens_per_s": 3333.0, "graphify_speedup": 6.34,
           "tokens_identical": True, "graphify_first_call_s": 0.21, "graphify_peak_mb": 3.5,
           "graphify_captures": 1, "graphify_replays": 440, "graphify_eager_calls": {}}
    for key, speedup, first in (("static", 4.9, 0.25), ("dynamic", 1.6, 0.7)):
        row.update({f"generate_{key}_speedup": speedup, f"generate_{key}_first_s": first,
                    f"generate_{key}_eager_tokens_per_s": 90.0,
                    f"generate_{key}_graphify_tokens_per_s": 90.0 * speedup,
                    f"generate_{key}_tokens_identical": True, f"generate_{key}_captures": 3,
                    f"generate_{key}_rebased": 0, f"generate_{key}_build_s": 0.05})
    static, dynamic = bench_decode.format_decode(row).splitlines()[1:]
    assert "4.90x (target >= 5x: MISSED)" in static
    assert "first graphified generate 0.250 s (target <= 0.3 s: met);" in static
    # (issue 18's first-generate target is a static cache's: a DynamicCache row states none)
    assert "1.60x (target >= 1.5x: met)" in dynamic
    assert "first graphified generate 0.700 s;" in dynamic and "0.3 s" not in dynamic


def test_generates_call_the_forms_in_turn_with_their_own_chaining():
    """The decode row's generate forms are called in turn, round by round (a host whose speed
    drifts during the row moves them alike), each with its own keywords and chaining."""
    from cudagraphify import _pieces

    calls = []

    class Model:
        def __init__(self, name):
            self.name = name

        def generate(self, prompt, **kwargs):
            calls.append((self.name, kwargs["n"], _pieces.CHAIN_PIECES))
            return prompt + len(calls)

    runs = [("eager", Model("eager"), lambda: {"n": 1}, True),
            ("graphify", Model("graphify"), lambda: {"n": 2}, True),
            ("unchained", Model("unchained"), lambda: {"n": 3}, False)]
    synced = []
    results = bench_decode._generates(runs, torch.zeros(1), 2, lambda: synced.append(1))
    assert calls == [("eager", 1, True), ("graphify", 2, True), ("unchained", 3, False)] * 3
    assert _pieces.CHAIN_PIECES  # (put back after each call)
    assert list(results) == ["eager", "graphify", "unchained"]
    outs, seconds = results["graphify"]
    assert [int(o) for o in outs] == [2, 5, 8] and len(seconds) == 3
    assert all(s >= 0 for s in seconds) and len(synced) == 2 * 9


def _no_transformers(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def without(name, *args, **kwargs):
        if name.startswith("transformers"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only mode")
def test_cpu_mode_decode_without_transformers_says_so(tmp_path, capsys, monkeypatch):
    _no_transformers(monkeypatch)
    out = tmp_path / "d.json"
    assert bench.main(["--quick", "--workloads", "--decode", "--json", str(out)]) == 0
    assert "llama-decode: not run: transformers is not importable" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    assert row["workload"] == "llama-decode" and "error" in row


def test_decode_on_cpu_times_eager_only():
    pytest.importorskip("transformers")
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    row = bench_decode.bench_decode(new_tokens=6, repeats=2, prompt_len=4, device="cpu",
                             dtype=torch.float32, sizes=sizes)
    assert "error" not in row, row.get("error")
    assert row["eager_us"] > 0 and row["eager_tokens_per_s"] > 0 and row["eager_runs_identical"]
    assert "graphify_us" not in row  # graphs need CUDA
    assert bench_decode.format_decode(row).endswith("on the cpu")


def test_decode_step_gives_eager_tokens_and_a_cpu_counter_keeps_it_eager(sim):
    """Through the simulated capture backend (conftest): the tokens equal eager's. On a CPU
    the cache's position counter (transformers 5: ``cumulative_length``) is a CPU scalar
    tensor, whose value a replay could not see change (host state, guarded by value): every
    step runs eagerly, with that reason (on CUDA it is a device tensor and one capture serves
    every step: tests/test_gpu_hf.py). Its "capture" runs the step for real, which a CUDA
    capture does not: the cache's state is put back as a real capture would leave it."""
    transformers = pytest.importorskip("transformers")
    import cudagraphify as cg

    config, model = _tiny_llama(transformers, positions=16)
    step = bench_decode.decode_step(model)
    graphed = cg.graphify(step, static_argnames=("cache",))
    prompt, positions = torch.randint(0, 128, (1, 4)), torch.arange(4, 16)
    caches = [bench_decode.static_cache(transformers, config, 1, 16, "cpu", torch.float32)
              for _ in range(2)]
    real_capture = sim.capture

    def capture_without_effects(fn, device, pool=None, keep_graph=False):
        state = [t.clone() for t in _cache_tensors(caches[1])]
        try:
            return real_capture(fn, device, pool, keep_graph)
        finally:
            for t, s in zip(_cache_tensors(caches[1]), state, strict=True):
                t.copy_(s)

    sim.capture = capture_without_effects
    with torch.no_grad():
        want, _, _ = bench_decode._generate(step, step, caches[0], prompt, positions, 12, lambda: None)
        for _ in range(2):
            got, _, _ = bench_decode._generate(graphed, step, caches[1], prompt, positions, 12,
                                        lambda: None)
            assert torch.equal(got, want)
    s = cg.stats(graphed)
    if "cumulative_length" not in vars(caches[1].layers[0]):  # (older transformers)
        assert (s.captures, s.replays, s.eager) == (1, 21, 0), s.eager_calls
        return
    assert (s.captures, s.replays, s.eager) == (0, 0, 22), s.eager_calls
    # (the first call met the model's modules, and their buffers: decided on the next one)
    deferred, why = s.eager_calls
    assert deferred.startswith("capture deferred") and s.eager_calls[deferred] == 1, deferred
    assert why.startswith("forward changes argument 2 (not its tensors' values")


def _cache_tensors(cache) -> list:
    """The tensors of a static cache (transformers 5: per layer; 4.x: key/value lists)."""
    out = []
    for layer in getattr(cache, "layers", []):
        out += [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None),
                            getattr(layer, "cumulative_length", None))
                if isinstance(t, torch.Tensor)]
    return out + list(getattr(cache, "key_cache", [])) + list(getattr(cache, "value_cache", []))


@pytest.mark.skipif(torch.cuda.is_available(), reason="stands in for CUDA calls: CPU only")
def test_workload_columns_on_cpu_record_numbers_errors_and_skips(monkeypatch, capsys):
    """bench_workload's bookkeeping on a CPU: the CUDA calls stand in as no-ops, the manual
    graph as the model itself; graphify runs eagerly there; make_graphed_callables fails (it
    needs CUDA) and the row says so; --quick compiles A only; thunder may not import."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 2**20)
    monkeypatch.setattr(workloads, "_manual_graph", lambda model, x: model)
    monkeypatch.setattr(workloads, "_thunder_missing", lambda: "not importable (test)")
    cfg = workloads.GPTConfig(32, 2, 2, 1, 4, torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = workloads.bench_workload("B", cfg, calls=2, repeats=1, quick=True, device="cpu")
    for prefix in ("eager", "manual_graph", "graphify", "graphify_nocopy", "per_layer",
                   "per_layer_region", "share_graph"):
        assert row[f"{prefix}_us"] > 0 and row[f"{prefix}_peak_mb"] == 1.0, prefix
        if prefix != "eager":
            assert row[f"{prefix}_max_abs_err"] == 0.0 and row[f"{prefix}_first_call_s"] > 0
            assert row[f"{prefix}_vs_eager"] > 0
    assert row["graphify_vs_manual"] == row["graphify_us"] / row["manual_graph_us"]
    assert row["make_graphed_callables_error"] and "make_graphed_callables_us" not in row
    assert row["torch_compile_skipped"].startswith("--quick compiles workload A only")
    assert row["thunder_skipped"].startswith("--quick compiles workload A only")
    assert row["per_layer_region_input_copies"] >= 0 and "share_graph_captures" in row
    assert "B: make_graphed_callables failed" in capsys.readouterr().err
    json.dumps(row)  # the row goes into --json as it is
    assert "error: " in workloads.format_workload(row)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = workloads.bench_workload("A", cfg, calls=2, repeats=1, columns=["thunder"],
                                       quick=True, device="cpu")
    assert row["thunder_skipped"] == "not importable (test)" and "graphify_us" not in row


def test_overhead_argument_runs_alone_unless_workloads_are_named():
    assert not bench.parse_args([]).overhead
    a = bench.parse_args(["--overhead"])
    assert a.overhead and a.workloads == []  # only the overhead section
    assert bench.parse_args(["--overhead", "--workloads", "A"]).workloads == ["A"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only mode")
def test_cpu_mode_overhead_says_it_needs_a_gpu(tmp_path, capsys):
    out = tmp_path / "o.json"
    assert bench.main(["--overhead", "--json", str(out)]) == 0
    assert "overhead: not run: needs a CUDA GPU" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    assert row["workload"] == "overhead" and "needs a CUDA GPU" in row["not_run"]


def test_overhead_rows_compare_each_with_its_reference_and_target():
    us = {"eager": 20.0, "raw_replay": 3.0, "hand_copy": 6.0, "hand_copy_clone": 9.0,
          "graphify": 14.0, "graphify_nocopy": 11.5, "region": 10.0, "opaque_eager": 21.0,
          "opaque_graphify": 23.0, "ineligible_eager": 30.0, "ineligible_graphify": 40.0,
          "hf_decode_eager": 1000.0, "hf_decode_graphify": 1020.0}
    lines = {item["key"]: item for item in overhead.compare(us)}
    assert list(lines) == [line.key for line in overhead.LINES]
    g = lines["graphify"]
    assert (g["reference"], g["reference_us"], g["diff_us"], g["met"]) == (
        "hand_copy_clone", 9.0, 5.0, True)  # hand copy-in + replay + clone + 5 µs: just met
    assert lines["graphify_nocopy"]["met"] is False  # 11.5 > hand copy-in + replay + 5
    assert lines["region"]["reference"] == "hand_copy" and lines["region"]["met"]
    assert lines["opaque_graphify"]["met"] and not lines["ineligible_graphify"]["met"]
    assert lines["hf_decode_graphify"]["ratio"] == pytest.approx(1.02)
    assert lines["hf_decode_graphify"]["met"] and lines["hf_decode_graphify"]["target"] == (
        "<= 1.03 x ref")
    assert lines["eager"]["met"] is None and lines["eager"]["target"] == ""
    del us["hf_decode_graphify"]
    row = {"calls": 10, "repeats": 3, "us": us, "lines": overhead.compare(us),
           "counters": {"graphify": {"captures": 1, "replays": 12, "eager_calls": {}}},
           "skipped": {"hf_decode": "transformers is not importable (x)"}}
    text = overhead.format_overhead(row)
    by_label = {line.label: next(ln for ln in text.splitlines()
                                 if ln.strip().startswith(line.label)) for line in overhead.LINES}
    assert by_label["graphify"].split()[1:] == ["14.0", "hand", "copy-in", "+", "replay", "+",
                                               "clone", "9.0", "+5.0", "1.556", "<=", "ref",
                                               "+", "5", "µs", "ok"]
    assert by_label["graphify(copy_outputs=False)"].endswith("MISSED")
    assert "skipped: transformers is not importable (x)" in by_label[
        "HF Llama decode step, graphify"]
    assert "graphify: captures 1, replays 12, eager calls: none" in text


def test_overhead_section_runs_every_row_on_a_cpu_with_a_stand_in_capture():
    """The section's bookkeeping, with the hand capture stood in for (graphify runs eagerly on
    a CPU): every row has a number or a reason, and the graphified rows their counters."""
    def capture(fn, x):
        static_x = x.clone()
        static_y = fn(static_x)

        class Graph:
            def replay(self):
                static_y.copy_(fn(static_x))
        return Graph(), static_x, static_y

    row = overhead.bench_overhead(2, 1, decode_steps=2, decode_repeats=1, device="cpu",
                                  capture=capture)
    timed = [line.key for line in overhead.LINES if not line.key.startswith("hf_decode")]
    # (the region's row is a difference shifted onto hand copy-in's: with 2 calls on a busy CPU
    # it can come out at or below zero; it must still be a number)
    assert all(row["us"][k] > 0 for k in timed if k != "region")
    assert row["us"]["region"] == row["us"]["region"] and abs(row["us"]["region"]) < 1e9
    assert set(row["counters"]) >= {"graphify", "graphify_nocopy", "region", "opaque_graphify",
                                    "ineligible_graphify"}
    assert "of type Scale" in next(iter(row["counters"]["opaque_graphify"]["eager_calls"]))
    assert ("hf_decode_eager" in row["us"]) != ("hf_decode" in row["skipped"])
    json.dumps(row)
    text = overhead.format_overhead(row)
    assert all(line.label in text for line in overhead.LINES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only mode")
def test_cpu_mode_says_which_sections_need_a_gpu(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert bench.main(["--workloads", "--train", "A", "--share", "12", "24", "--share-hf",
                       "--sync", "item", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = ["A-train", "A-share-L12", "A-share-L24", "hf-share", "A-item"]
    for workload in names:
        assert any(ln.startswith(f"{workload}: not run: needs a CUDA GPU (") for ln in lines), (
            workload, lines)
    rows = json.loads(out.read_text())["rows"]
    assert [r["workload"] for r in rows] == names
    assert all(r["not_run"].startswith("needs a CUDA GPU") for r in rows)


def test_chart_without_matplotlib_is_an_error_before_anything_runs(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        bench.main(["--workloads", "T", "--chart", "out.png"])
    assert e.value.code != 0
    assert "--chart needs matplotlib: pip install matplotlib" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only mode")
def test_a_chart_that_is_not_written_exits_non_zero(tmp_path, capsys):
    assert bench.main(["--overhead", "--chart", str(tmp_path / "c.png")]) == 1
    assert "cudagraphify.bench: no chart: no timed rows" in capsys.readouterr().err
    assert not (tmp_path / "c.png").exists()


def test_serve_argument_runs_alone_and_says_it_needs_a_gpu_on_a_cpu(tmp_path, capsys):
    a = bench.parse_args(["--serve"])
    assert a.serve and a.workloads == []
    if torch.cuda.is_available():
        return
    out = tmp_path / "s.json"
    assert bench.main(["--serve", "--json", str(out)]) == 0
    assert "serve: not run: needs a CUDA GPU" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    assert row["workload"] == "serve"


def test_serve_rows_in_words():
    from cudagraphify.bench.serve import format_serve

    a = format_serve({"workload": "A-sizes", "sizes": [1, 2], "hand_mb": 60.0,
                      "up_front_mb": 63.0, "up_front_s": 1.5, "up_front_equal": True,
                      "on_demand_mb": 70.0, "on_demand_equal": True,
                      "up_front_over_hand": 1.05, "on_demand_over_hand": 70 / 60})
    assert "capture_sizes 63.0 MB (1.05x hand" in a and "on demand smallest first 70.0 MB" in a
    assert format_serve({"workload": "llama-sizes", "error": "boom"}) == \
        "llama-sizes: error: boom"
    b = format_serve({"workload": "A-buckets", "sizes": "1-16", "buckets": [2, 4, 8, 16],
                      "eager_us": 900.0, "exact_us": 120.0, "exact_graphs": 16,
                      "exact_mb": 40.0, "bucketed_us": 140.0, "bucketed_graphs": 4,
                      "bucketed_mb": 12.0, "refused": 0, "bucketed_max_diff": 1e-6,
                      "exact_max_diff": 0.0})
    assert "bucketed 140 (4 graphs of [2, 4, 8, 16], 12.0 MB, 0 buckets refused)" in b


def test_share_hf_rows_in_words():
    from cudagraphify.bench.sections import format_share_hf

    row = {"workload": "hf-share-llama-L16", "eager_us": 9000.0, "per_layer_us": 2100.0,
           "per_layer_pool_mb": 40.0, "per_layer_equal": True, "share_graph_us": 2150.0,
           "share_graph_pool_mb": 6.0, "share_graph_equal": True, "shared": 0, "per_layer": 16,
           "reasons": ["node 3 (reduce): argument 1 at byte 104 differs"],
           "share_vs_per_layer_us": 2150.0 / 2100.0}
    text = format_share_hf(row)
    assert text.startswith("hf-share-llama-L16: eager 9000 µs | per-layer graphify 2100 µs")
    assert "0 layer graphs shared, 16 per layer ['node 3 (reduce)" in text
    assert text.endswith("share/per-layer µs 1.024 (target <= 1.05)")
    assert format_share_hf({"workload": "hf-share-gpt2-L12", "not_run": "ImportError: x"}) == \
        "hf-share-gpt2-L12: not run: ImportError: x"


def _tiny_llama(transformers, positions: int):
    """A 2-layer, 32-wide HF Llama (vocabulary 128) with random weights, on the CPU."""
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=128, max_position_embeddings=positions)
    torch.manual_seed(0)
    return config, transformers.LlamaForCausalLM(config).eval()


def test_sliding_window_generate_rows_through_the_cpu_double(sim):
    """The decode section's Mistral rows (a sliding window that fills during the prompt), on
    the simulated backend: tokens equal eager's, pieces replayed, the cache's side effect
    learnt on at most two caches per form, and the lines that say so."""
    transformers = pytest.importorskip("transformers")
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    row: dict = {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bench_decode._sliding_rows(row, transformers, sizes, torch.randint(0, 128, (1, 8)), 6,
                                   3, lambda: None, torch.float32)
    assert row["sliding_window"] == 4
    for key in ("static", "dynamic"):
        assert row[f"sliding_{key}_tokens_identical"], key
        assert row[f"sliding_{key}_replays"] > 0, (key, row)
    assert row["sliding_static_side_effects"] <= 2 * 4, row  # (two per generate's cache)
    text = bench_decode.format_decode(dict(
        row, config="c", batch=1, prompt=8, new_tokens=6, eager_tokens_per_s=1.0, eager_us=1.0,
        device="cpu", graphify_us=1.0, graphify_tokens_per_s=1.0, graphify_speedup=1.0,
        tokens_identical=True, graphify_first_call_s=0.1, graphify_peak_mb=0.0,
        graphify_captures=1, graphify_replays=1, graphify_eager_calls={}))
    assert "Mistral (sliding window 4) model.generate(), no cache option" in text, text


def test_generate_forms_give_eager_tokens_through_the_cpu_double(sim):
    """Every generate() form of the decode section, through the simulated backend: tokens equal
    eager's, the dynamic form's pieces chained and not (the section's side-by-side)."""
    transformers = pytest.importorskip("transformers")
    config, model = _tiny_llama(transformers, positions=64)
    row: dict = {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bench_decode._generate_rows(row, transformers, config, model,
                                    torch.randint(0, 128, (1, 4)), 6, 2, lambda: None)
    for key, *_ in bench_decode.GENERATE_FORMS:
        assert row[f"generate_{key}_tokens_identical"], key
    assert row["generate_dynamic_unchained_tokens_identical"]
    assert row["generate_dynamic_replays"] > 0  # the pieces around the cache
    assert "its pieces not chained" in bench_decode.format_decode(
        dict(row, config="c", batch=1, prompt=4, new_tokens=6, eager_tokens_per_s=1.0,
             eager_us=1.0, device="cpu", graphify_us=1.0, graphify_tokens_per_s=1.0,
             graphify_speedup=1.0, tokens_identical=True, graphify_first_call_s=0.1,
             graphify_peak_mb=0.0, graphify_captures=1, graphify_replays=1,
             graphify_eager_calls={}))


def test_differential_section_times_every_step_and_says_what_the_calls_did(sim):
    """On the CPU double (replays run the recorded ops): our GPT through every step of the
    differential script; each step has both timings, their ratio and the graphified path."""
    from cudagraphify.bench import differential

    (row,) = differential.bench_differential(calls=2, rounds=1, warm=3, device="cpu",
                                             models=["ours"])
    names = [s["step"] for s in row["steps"]]
    assert names == [step[0] for step in differential.steps("cpu")]
    for s in row["steps"]:
        assert s["eager_us"] > 0 and s["graphify_us"] > 0
        assert s["ratio"] == pytest.approx(s["graphify_us"] / s["eager_us"])
        assert s["max_abs_err"] < 1e-4, s
    by = {s["step"]: s["path"] for s in row["steps"]}
    assert by["first call"].startswith("1 capture(s)"), by
    assert "replay(s)" in by["same signature"] and "capture" not in by["same signature"], by
    assert "invalidation(s)" in by["parameter reassigned"], by
    assert row["worst_ratio"] == max(s["ratio"] for s in row["steps"])
    assert row["over_target"] == [s["step"] for s in row["steps"] if s["ratio"] > 1.02]
    text = differential.format_differential(row)
    assert text.startswith("differential-ours: worst step ") and "p.data = ..." in text
    json.dumps(row)


def test_differential_section_says_why_a_model_did_not_run(monkeypatch):
    from cudagraphify.bench import differential

    def missing(device):
        raise ImportError("No module named 'torchvision'")

    monkeypatch.setitem(differential.MODELS, "resnet18", missing)
    (row,) = differential.bench_differential(device="cpu", models=["resnet18"])
    assert row["skipped"] == "ImportError: No module named 'torchvision'"
    assert differential.format_differential(row) == (
        "differential-resnet18: skipped: ImportError: No module named 'torchvision'")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only mode")
def test_cpu_mode_says_the_differential_section_needs_a_gpu(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert bench.main(["--differential", "--json", str(out)]) == 0
    assert "differential: not run: needs a CUDA GPU (graphify against eager" in \
        capsys.readouterr().out
    assert [r["workload"] for r in json.loads(out.read_text())["rows"]] == ["differential"]
