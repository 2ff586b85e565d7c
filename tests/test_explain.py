"""explain(): the plan as a tree that names unsafe ops and their lines; the module is left alone."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch import nn

import cudagraphify as cg
from cudagraphify.bench.models import GPT


class Logger(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        y = self.drop(self.bn(self.lin(x)))
        print_me = f"{y.mean():.3f}"  # LINE_FORMAT
        return y + len(print_me) * 0


def test_explain_names_the_op_its_tags_and_its_line():
    model = Logger().train()
    line = next(i for i, t in enumerate(open(__file__), 1) if "LINE_FORMAT" in t)
    report = cg.explain(model, torch.randn(8, 4))
    text = str(report)
    assert f"Tensor.__format__ [HOST_SYNC] at tests/test_explain.py:{line}" in text
    assert "Logger (Logger): eager" in text
    assert "lin (Linear): graphed" in text and "bn (BatchNorm1d): graphed" in text
    data = report.to_dict()
    statuses = {m["path"]: m["status"] for m in data["modules"]}
    assert statuses == {"": "eager", "lin": "graphed", "bn": "graphed", "drop": "graphed"}
    # the reason as fields, for programs
    (reason,) = json.loads(report.to_json())["modules"][0]["reasons"]
    assert reason == {"text": f"Tensor.__format__ [HOST_SYNC] at tests/test_explain.py:{line}",
                      "op": "Tensor.__format__", "tags": ["HOST_SYNC"],
                      "file": "tests/test_explain.py", "line": line}


def test_explain_leaves_the_module_and_rng_as_they_were():
    model = Logger().train()
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(8, 4)
    rng = torch.random.get_rng_state()
    cg.explain(model, x)
    assert model.training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert "_cudagraphify_state" not in model.__dict__


class Stateful(nn.Module):
    """Keeps state outside its buffers: a step counter, a plain tensor attribute it adds to, a
    cache it sets on first use; and writes its argument in place."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.steps = 0
        self.acc = torch.zeros(4)

    def forward(self, x):
        self.steps += 1
        self.acc.add_(1)
        if getattr(self, "cache", None) is None:
            self.cache = torch.ones(4)
        x.mul_(2)
        return self.lin(x) + self.acc + self.cache


def test_explain_leaves_attributes_plain_tensors_and_inputs_as_they_were():
    model = Stateful()
    x = torch.randn(2, 4)
    x0, v0 = x.clone(), model.acc._version
    cg.explain(model, x)
    assert model.steps == 0
    assert torch.equal(model.acc, torch.zeros(4)) and model.acc._version == v0
    assert "cache" not in model.__dict__
    assert torch.equal(x, x0)


class WritesWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.mul_(0.5)
        return self.lin(x)


def test_explain_names_a_parameter_its_runs_wrote():
    model = WritesWeight()
    with pytest.warns(cg.CudagraphifyWarning, match=r"wrote parameter\(s\).*lin\.weight"):
        cg.explain(model, torch.randn(2, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cg.explain(Stateful(), torch.randn(2, 4))  # (writes none)


def test_explain_gpt_with_item_keeps_attention_and_mlp_graphed():
    text = str(cg.explain(GPT(32, 2, 2, sync="item").eval(), torch.randn(1, 4, 32)))
    assert "blocks.0 (SyncBlock): eager" in text
    assert "Tensor.item [HOST_SYNC] at cudagraphify/bench/models.py:" in text
    # the root and the ModuleList are eager because of their children, and say which
    assert "GPT (GPT): eager\n  - unsafe ops in its submodule(s) blocks.0, blocks.1\n" in text
    assert "  blocks (ModuleList): eager\n    - unsafe ops in its submodule(s) blocks.0, " \
           "blocks.1\n" in text
    assert "blocks.1.attn (Attention): graphed" in text
    assert text.count("(Attention): graphed") == 2 and text.count("(MLP): graphed") == 2


def test_explain_a_safe_model_is_graphed_whole():
    report = cg.explain(GPT(32, 2, 1).eval(), torch.randn(1, 4, 32))
    assert [(m["path"], m["status"]) for m in report.to_dict()["modules"]] == [("", "graphed")]


def test_explain_after_calls_shows_the_plan_and_live_counters(sim):
    torch.manual_seed(0)
    ref = GPT(32, 2, 2, sync="item").eval()
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(4):
            x = torch.randn(1, 4, 32)
            torch.testing.assert_close(g(x), ref(x), rtol=0, atol=0)
    text = str(cg.explain(g))
    # the attention and MLP pieces (in the root's implicit region, calls 2-4 replay)
    assert "captures=1 replays=3" in text
    assert "piecewise: 9 submodule(s) graphed" in text
    assert cg.stats(g.blocks[1].mlp).replays == 3
    cg.ungraphify(g)
    assert "forward" not in g.blocks[0].attn.__dict__  # pieces are undone with their root


def test_explain_after_eager_calls_says_why_nothing_was_planned():
    g = cg.graphify(Logger().eval())
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            g(torch.randn(8, 4))
    report = cg.explain(g)
    text = str(report)
    assert "no plan" not in text
    assert text.splitlines()[:2] == [
        "Logger.forward (Logger): eager, nothing planned",
        "  - ran eagerly: tensors are on cpu, not on a CUDA device (2 calls)"]
    (root,) = report.to_dict()["modules"]  # its submodules ran inside its eager calls
    assert root["reasons"] == [{"text": "ran eagerly: tensors are on cpu, not on a CUDA device "
                                        "(2 calls)",
                                "reason": "tensors are on cpu, not on a CUDA device", "calls": 2}]


def test_explain_without_a_plan_and_of_functions():
    @cg.graphify
    def f(x):
        return x + 1

    assert "no plan" not in str(cg.explain(f))
    assert "no plan yet" in str(cg.explain(cg.graphify(nn.Linear(2, 2))))
    with pytest.raises(cg.CudagraphifyError, match="Module"):
        cg.explain(f, torch.ones(1))


@pytest.mark.parametrize("trusted", [False, True])
@pytest.mark.parametrize("sync_always", [False, True])
def test_explain_plans_trusted_code_that_asks_whether_it_is_captured_on_its_captured_path(
        monkeypatch, sync_always, trusted):
    from test_engine import _CaptureAware

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    model = _CaptureAware(sync_always)
    policy = cg.OpPolicy()
    if trusted:
        policy.TRUSTED_CAPTURED_PATHS = (_CaptureAware.__module__,)
    graphed = cg.graphify(model, op_policy=policy)
    calls = model.calls.clone()
    statuses = {m["path"]: m["status"]
                for m in cg.explain(graphed, torch.randn(2, 4)).to_dict()["modules"]}
    # the plain runs sync (the shortcut); the path taken while captured syncs only if
    # sync_always, and is the plan only where the code that asks is trusted
    assert statuses == ({"": "graphed"} if trusted and not sync_always  # whole: parts unlisted
                        else {"": "eager", "lin": "graphed"}), statuses
    assert torch.equal(model.calls, calls)  # left as it was


def test_explain_with_inputs_shows_where_refused_calls_cut_the_forward():
    report = cg.explain(GPT(32, 2, 2, sync="item").eval(), torch.randn(1, 4, 32))
    runs = report.to_dict()["runs"]
    # two blocks, an .item() in each: three runs of graphable calls, the first two cut by it
    assert [r["cut_by"]["op"] if r["cut_by"] else None for r in runs] == \
        ["Tensor.item", "Tensor.item", None]
    assert all(r["cut_by"]["tags"] == ["HOST_SYNC"] for r in runs[:2])
    assert runs[0]["start"] == 0 and runs[1]["start"] == runs[0]["end"] + 1
    assert runs[2]["end"] == runs[2]["start"] + runs[2]["calls"]
    # a run spans module boundaries: the second holds block 0's MLP and block 1's attention
    assert "blocks.0.mlp" in runs[1]["modules"] and "blocks.1.attn" in runs[1]["modules"]
    assert runs[0]["first"].startswith("cudagraphify/bench/models.py:")
    text = str(report)
    assert "runs of graphable calls between refused ones (3;" in text
    assert "then Tensor.item [HOST_SYNC] at cudagraphify/bench/models.py:88" in text


def test_explain_of_a_safe_model_lists_no_runs():
    report = cg.explain(GPT(32, 2, 1).eval(), torch.randn(1, 4, 32))
    assert report.runs == [] and "runs of graphable" not in str(report)


def test_runs_of_a_trace():
    from cudagraphify._probe import Finding
    from cudagraphify._segments import runs

    stop = Finding("a", "Tensor.item", ("HOST_SYNC",), "f.py:3")
    trace = [("add", "a", "f.py:1", None), ("mul", "a", "f.py:2", None),
             ("Tensor.item", "a", "f.py:3", stop), ("Tensor.item", "a", "f.py:4", stop),
             ("relu", "b", "f.py:5", None)]
    got = runs(trace)
    assert [(r.start, r.end, r.first, r.last, r.modules, r.cut_by) for r in got] == \
        [(0, 2, "f.py:1", "f.py:2", ("a",), stop), (4, 5, "f.py:5", "f.py:5", ("b",), None)]
    assert runs([]) == [] and runs(trace[2:4]) == []


def test_explain_without_room_for_its_copies_warns_and_still_puts_attributes_back(monkeypatch):
    import contextlib

    from cudagraphify import _writes

    @contextlib.contextmanager
    def short_of_memory(tensors):
        raise torch.OutOfMemoryError("simulated")
        yield

    monkeypatch.setattr(_writes, "undone", short_of_memory)
    model = Stateful()
    with pytest.warns(cg.CudagraphifyWarning, match="out of memory"):
        cg.explain(model, torch.randn(2, 4))
    assert model.steps == 0 and "cache" not in model.__dict__
