"""The probe and the piecewise plan: findings per submodule, control flow, non-op calls."""

from __future__ import annotations

import random

import torch
from torch import nn

from cudagraphify.bench.models import GPT
from cudagraphify._policy import OpPolicy, op_name
from cudagraphify._probe import Probe, control_flow_findings, differing_paths, plan_pieces

ACC = frozenset({"cuda", "cpu"})


def run(model, *args, policy=None):
    probe = Probe(model, policy or OpPolicy(), accel=ACC)
    with torch.no_grad(), probe:
        model(*args)
    return probe


def test_item_in_a_block_keeps_attention_and_mlp_graphed():
    model = GPT(32, 2, 2, sync="item").eval()
    probe = run(model, torch.randn(1, 4, 32))
    found = probe.unsafe_paths()
    assert set(found) == {"blocks.0", "blocks.1"}
    (f,) = found["blocks.0"]
    assert f.op == "Tensor.item" and f.tags == ("HOST_SYNC",) and f.where.startswith("cudagraphify/bench/models.py:")
    assert f.file == "cudagraphify/bench/models.py" and f.where == f"{f.file}:{f.line}"
    pieces = plan_pieces(model, set(found), set(probe.sequences))
    assert pieces == ["blocks.0.ln1", "blocks.0.attn", "blocks.0.ln2", "blocks.0.mlp",
                      "blocks.1.ln1", "blocks.1.attn", "blocks.1.ln2", "blocks.1.mlp", "ln_f"]


def test_nonzero_is_found_too_and_a_safe_model_is_graphed_whole():
    found = run(GPT(32, 2, 1, sync="nonzero").eval(), torch.randn(1, 4, 32)).unsafe_paths()
    assert [f.op for f in found["blocks.0"]][:1] == ["Tensor.nonzero"]
    model = GPT(32, 2, 2).eval()
    probe = run(model, torch.randn(1, 4, 32))
    assert probe.findings == [] and plan_pieces(model, set(), set(probe.sequences)) == [""]


class Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
        self.b = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        x = self.a(x)
        if x.sum() > 0:  # Tensor.__bool__: a sync in the root's own code
            x = x * 2
        return self.b(x)


def test_plan_for_nested_modules_skips_what_never_ran():
    model = Deep()
    probe = run(model, torch.randn(2, 4))
    assert set(probe.unsafe_paths()) == {""}
    assert plan_pieces(model, {""}, probe.ran()) == ["a", "b"]
    # a sync deep inside: only its ancestors run eagerly
    assert plan_pieces(model, {"a.1.1"}, {"a", "a.0", "a.1", "a.1.0", "a.1.1", "b"}) == \
        ["a.0", "a.1.0", "b"]


def test_plan_descends_into_a_module_whose_children_its_parent_calls_directly():
    class Inline(nn.Module):
        """Calls ``self.attn.qkv`` and ``self.attn.proj`` itself: ``attn`` never runs."""

        def __init__(self):
            super().__init__()
            self.attn = nn.Module()
            self.attn.qkv, self.attn.proj = nn.Linear(4, 4), nn.Linear(4, 4)
            self.mlp = nn.Sequential(nn.Linear(4, 4), nn.GELU())

        def forward(self, x):
            h = self.attn.proj(self.attn.qkv(x))
            if h.sum().item() > 1e9:  # a host sync
                h = h * 0
            return self.mlp(h)

    model = Inline()
    probe = run(model, torch.randn(2, 4))
    assert "attn" not in probe.ran() and "mlp" in probe.ran()
    # (before: "attn" was planned, a piece nobody calls, and its Linears stayed eager)
    assert plan_pieces(model, set(probe.unsafe_paths()), probe.ran()) == \
        ["attn.qkv", "attn.proj", "mlp"]


def test_data_dependent_control_flow_shows_as_differing_sequences():
    class Coin(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x).relu() if random.random() < 0.5 else self.lin(x).tanh()

    model = nn.Sequential(Coin(), nn.Linear(4, 4))
    random.seed(1)
    runs = [run(model, torch.randn(1, 4)) for _ in range(6)]
    diffs = set().union(*(differing_paths(runs[0], r) for r in runs[1:]))
    assert diffs == {"0"}


def test_a_control_flow_finding_names_the_first_op_where_two_runs_part():
    class Branch(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.long = False

        def forward(self, x):
            y = self.lin(x).relu()
            return y.tanh().sigmoid() if self.long else y

    model = nn.Sequential(Branch(), nn.Linear(4, 4))
    short = run(model, torch.randn(1, 4))
    model[0].long = True
    longer = run(model, torch.randn(1, 4))
    (path, finding), = control_flow_findings(short, longer, "why").items()
    i = len(short.sequences["0"])
    assert path == "0" and finding.op == "control flow" and finding.tags == ()
    assert str(finding) == (f"control flow at op {i} (its end in the first run, "
                            f"{longer.sequences['0'][i]} in the second): why"), str(finding)
    model[0].long = False
    assert control_flow_findings(short, run(model, torch.randn(1, 4)), "why") == {}

    class Either(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.use_a = nn.Linear(4, 4), nn.Linear(4, 4), True

        def forward(self, x):
            return self.a(x) if self.use_a else self.b(x)

    either = Either()
    with_a = run(either, torch.randn(1, 4))
    either.use_a = False
    found = control_flow_findings(with_a, run(either, torch.randn(1, 4)), "why")
    assert set(found) == {"a", "b"}
    assert "(nothing (it did not run) in the first run," in str(found["b"]), str(found["b"])


def test_non_op_calls_are_seen_and_restored():
    original = torch.manual_seed
    sync = vars(torch.cuda.Stream).get("synchronize")

    class Seeds(nn.Module):
        def forward(self, x):
            torch.manual_seed(0)
            return x + 1

    probe = run(Seeds(), torch.ones(1))
    assert [(f.op, f.tags) for f in probe.findings] == [("torch.manual_seed", ("CPU_RNG",))]
    assert torch.manual_seed is original
    assert vars(torch.cuda.Stream).get("synchronize") is sync


def test_probe_hooks_are_removed_and_overrides_apply():
    from torch.nn.modules import module as M

    before = (len(M._global_forward_pre_hooks), len(M._global_forward_hooks))
    pol = OpPolicy()
    pol.mark_safe(torch.Tensor.__bool__)
    probe = run(Deep(), torch.randn(2, 4), policy=pol)
    assert probe.findings == []
    assert (len(M._global_forward_pre_hooks), len(M._global_forward_hooks)) == before


def test_another_threads_modules_do_not_enter_the_probe():
    import threading

    model = GPT(16, 2, 1).eval()
    probe = Probe(model, OpPolicy(), accel=ACC)
    go, done = threading.Event(), threading.Event()

    def other():
        go.wait()
        with torch.no_grad():
            model(torch.randn(1, 2, 16))
            torch.manual_seed(0)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with torch.no_grad(), probe:
        go.set()
        done.wait()
        model(torch.randn(1, 2, 16))
    t.join()
    assert probe.findings == [] and probe._stack == []
    assert set(probe.sequences) == {
        "", "blocks.0", "blocks.0.ln1", "blocks.0.attn", "blocks.0.attn.qkv", "blocks.0.attn.proj",
        "blocks.0.ln2", "blocks.0.mlp", "blocks.0.mlp.fc", "blocks.0.mlp.out", "blocks.0.drop",
        "ln_f"}
    # the other thread's torch.manual_seed was not recorded, and its ops were not counted twice
    assert probe.sequences["blocks.0.mlp.fc"] == ["F.linear"]


def test_probes_on_two_threads_interleaved_restore_torch():
    import threading

    original = torch.manual_seed
    a = Probe(None, OpPolicy(), accel=ACC)
    b = Probe(None, OpPolicy(), accel=ACC)
    b_in, a_out = threading.Event(), threading.Event()

    def other():
        with b:
            b_in.set()
            a_out.wait()  # A leaves first
            torch.manual_seed(1)

    t = threading.Thread(target=other)
    a.__enter__()
    t.start()
    b_in.wait()
    torch.manual_seed(0)
    a.__exit__(None, None, None)
    a_out.set()
    t.join()
    assert torch.manual_seed is original
    assert [f.op for f in a.findings] == ["torch.manual_seed"]
    assert [f.op for f in b.findings] == ["torch.manual_seed"]


def test_the_policy_is_asked_about_every_call_so_it_can_refuse_an_untagged_op(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU torch

    class NoTanh(OpPolicy):
        def __init__(self):
            super().__init__()
            self.asked = []

        def can_graph(self, func, tags):
            self.asked.append((func, tags))
            return func is not torch.Tensor.tanh and super().can_graph(func, tags)

    class Squash(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            torch.cuda.is_current_stream_capturing()  # a non-op call, with no tags either
            return self.lin(x).tanh()

    model, policy = Squash(), NoTanh()
    probe = run(model, torch.randn(2, 4), policy=policy)
    asked = {op_name(f) for f, tags in policy.asked if not tags}
    assert {"Tensor.tanh", "F.linear", "torch.cuda.is_current_stream_capturing"} <= asked
    (f,) = probe.findings
    assert (f.path, f.op, f.tags) == ("", "Tensor.tanh", ())
    assert plan_pieces(model, set(probe.unsafe_paths()), set(probe.sequences)) == ["lin"]
    assert run(model, torch.randn(2, 4)).findings == []  # the default policy graphs it whole


def test_a_finding_names_its_file_from_the_project_or_site_packages(tmp_path):
    from cudagraphify._probe import _relative

    lib = tmp_path / "venv" / "lib" / "python3.12" / "site-packages" / "transformers" / "models"
    assert _relative(str(lib / "llama" / "modeling_llama.py")) == (
        "transformers/models/llama/modeling_llama.py")
    (tmp_path / "proj" / "pkg").mkdir(parents=True)
    (tmp_path / "proj" / "pyproject.toml").write_text("")
    assert _relative(str(tmp_path / "proj" / "pkg" / "model.py")) == "pkg/model.py"
    assert _relative(__file__) == "tests/test_probe.py"  # this project's own root


# -- the probe's per-function shortcuts and the read recorder's --------------------------------

class _ReadsAndWrites(nn.Module):
    """Reads a shape (a property: a new method-wrapper per read), writes an intermediate in
    place, and writes a buffer from before the call through ``out=`` and through ``add_``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("acc", torch.zeros(2, 4))

    def forward(self, x):
        n = x.shape[0]
        y = self.lin(x)
        y.mul_(2)
        torch.add(y, 1, out=self.acc)
        self.acc.add_(n)
        return y


def test_property_reads_and_writes_are_recorded_the_same_on_every_run():
    from cudagraphify._signature import storage_of

    model, x = _ReadsAndWrites(), torch.randn(2, 4)
    runs = []
    for _ in range(3):  # the later runs take the probe's cached answers per function
        probe = Probe(model, OpPolicy(), accel=ACC)
        probe.known = {storage_of(t) for t in model.parameters()} | {storage_of(x)}
        probe.known.add(storage_of(model.acc))
        probe.written = set()
        with torch.no_grad(), probe:
            model(x)
        runs.append(probe)
    assert [dict(p.sequences) for p in runs[1:]] == [dict(runs[0].sequences)] * 2
    assert runs[0].sequences[""][:1] == ["Tensor.shape"]
    assert "Tensor.mul_" in runs[0].sequences[""] and "F.linear" in runs[0].sequences["lin"]
    for p in runs:
        # the buffer (memory from before the call) and the intermediate are written; only the
        # buffer was not made by the run
        assert storage_of(model.acc) in p.written and len(p.written) == 2
        assert p.written_before_made == {storage_of(model.acc)}
        assert p.findings == [] and p.outside == {}


class _Shadowed(nn.Module):
    """A submodule whose name is also a class attribute: ``self.lin`` is the class's value
    (object.__getattribute__ finds it before Module.__getattr__ looks in the registries)."""

    lin = 3.0

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)  # registered in _modules; the class attribute still wins
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x) * self.lin


class _Forwarding(nn.Module):
    """A module whose ``__getattr__`` is its own (as PEFT's wrappers): left to it."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.seen: list[str] = []

    def __getattr__(self, name):
        if name not in ("seen", "_parameters", "_buffers", "_modules"):
            self.seen.append(name)
        return super().__getattr__(name)

    def forward(self, x):
        return self.proj(x)


def test_the_read_recorder_returns_what_attribute_lookup_returns():
    from cudagraphify._watch import Recorder, recording

    x = torch.randn(2, 4)
    shadowed, forwarding = _Shadowed(), _Forwarding()
    want = (shadowed(x), forwarding(x))
    forwarding.seen.clear()
    rec = Recorder()
    with torch.no_grad(), recording(rec):
        got = (shadowed(x), forwarding(x))
        assert shadowed.lin == 3.0 and isinstance(shadowed.proj, nn.Linear)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert forwarding.seen == ["proj"]  # its __getattr__ still ran for the submodule
    # the class attribute is a read (its value drives forward); registries are not
    reads = {(type(r.module).__name__, name) for (_, name), r in rec.reads.items()}
    assert ("_Shadowed", "lin") in reads and ("_Shadowed", "proj") not in reads
    assert rec.reads[(id(shadowed), "lin")].value == 3.0
