"""The benchmark CLI on a machine without a GPU: it says so, times the eager model on the CPU,
writes JSON and a chart."""

from __future__ import annotations

import json

import pytest
import torch

from cudagraphify import bench


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
