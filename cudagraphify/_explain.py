"""``explain``: the plan for a module as a tree, for people (``str``) and programs (``to_dict``).

Each module node says: graphed (a graph of its own), part of a graph (inside a graphed
ancestor), eager (and why: op, tags, file:line), or not run. Nodes with live graphs also show
captures, replays, pool MB and capture ms. ``explain(module, *example_args)`` plans from a probe
run on the example inputs (on a CPU too), restoring the module's buffers, attributes, plain tensor
attributes, the example inputs and the RNG state after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import warnings
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.nn.parameter import is_lazy

from . import _statics, _watch, _writes
from ._errors import CudagraphifyUsageError, CudagraphifyWarning
from ._guards import WRAPPERS
from ._nested import Nested
from ._rehearsal import restored
from ._options import Stats
from ._wrap import share_of, state_of_module
from ._policy import default_policy
from ._probe import Probe, control_flow_findings, plan_pieces
from ._segments import TracingProbe, runs
from ._signature import storage_of
from ._state import tensors_in as _tensors_in
from ._statics import REGISTRIES, _WatchedDict, watch

__all__ = ["Explanation", "probe_plan", "build"]

class Explanation:
    """The report :func:`cudagraphify.explain` returns."""

    def __init__(self, name: str, nodes: list[dict], stats: Stats, decisions: list,
                 runs: list | None = None):
        self.name = name
        self.nodes = nodes
        self.stats = stats
        self.decisions = decisions
        # with example inputs and refused calls: where the forward is cut (see _segments)
        self.runs = runs or []

    def to_dict(self) -> dict:
        return {"name": self.name, "modules": self.nodes,
                "signatures": [{"key": repr(k), "decision": d} for k, d in self.decisions],
                "stats": dataclasses.asdict(self.stats),
                "runs": [r.to_dict() for r in self.runs]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=str)

    def __str__(self) -> str:
        lines = []
        for node in self.nodes:
            depth = node["path"].count(".") + (1 if node["path"] else 0)
            label = node["path"] or self.name
            line = f"{'  ' * depth}{label} ({node['type']}): {node['status']}"
            live = node.get("stats")
            if live:
                made = (f"retargets={live['retargets']} " if live.get("retargets") else "")
                made += (f"seen_once={live['seen_once']} " if live.get("seen_once") else "")
                line += (f" [captures={live['captures']} {made}replays={live['replays']} "
                         f"pool={live['graph_pool_bytes'] / 2**20:.1f}MB "
                         f"capture={live['capture_seconds'] * 1e3:.1f}ms]")
            lines.append(line)
            share = node.get("share")
            if share:
                why = "; ".join(f"{r} (x{n})" for r, n in share["reasons"].items())
                lines.append(f"{'  ' * depth}  - share_graph layer {share['layer']} of "
                             f"{share['layers']}: the group made {share['retargets']} graphs "
                             f"from {share['captures']} captures, {share['per_layer']} per "
                             f"layer{': ' + why if why else ''}")
            for reason in node.get("reasons", []):
                lines.append(f"{'  ' * depth}  - {reason['text']}")
            if node.get("plan"):
                lines.append(f"{'  ' * depth}  - {node['plan']}")
            for line in node.get("segments", []):
                lines.append(f"{'  ' * depth}  - segments: {line}")
        if self.runs:
            lines.append(f"runs of graphable calls between refused ones ({len(self.runs)}; "
                         "graphed today only where a safe submodule holds them):")
            lines.extend(f"  {r}" for r in self.runs)
        s = self.stats
        if s.captures or s.replays or s.eager:
            lines.append(f"calls: {s.captures} captures, {s.replays} replays, {s.eager} eager")
            for reason, n in s.eager_calls.items():
                lines.append(f"  eager x{n}: {reason}")
        return "\n".join(lines)

    __repr__ = __str__


def probe_plan(module: torch.nn.Module, args: tuple, kwargs: dict, policy=None):
    """Run ``module`` twice on the example inputs under a probe; restore its state after.

    Returns (findings by path, pieces, paths that ran, the first run's runs
    of calls between refused ones, see :mod:`._segments`).
    """
    policy = policy or default_policy
    on_gpu = any(t.is_cuda for t in list(module.parameters()) + list(module.buffers())) or any(
        isinstance(a, torch.Tensor) and a.is_cuda for a in list(args) + list(kwargs.values()))
    # planned as if on a GPU: on a CPU, CPU tensors stand for CUDA tensors
    accel = frozenset({"cuda"}) if on_gpu else frozenset({"cuda", "cpu"})
    buffers = [b for b in module.buffers() if not is_lazy(b)]
    device = next((t.device for t in (*module.parameters(), *buffers) if not is_lazy(t)),
                  torch.device("cpu"))

    statics = {storage_of(t) for t in (*module.parameters(), *buffers)}
    tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]

    def two_runs(rehearse: bool) -> list[Probe]:
        probes = []
        for _ in range(2):
            probe = (TracingProbe if not probes else Probe)(module, policy, accel=accel,
                                                            thunder=True)
            probe.rehearse = rehearse
            # (refused as graphify's first call refuses them: none is marked static here)
            probe.watch_arguments(tensors, [False] * len(tensors), statics)
            if probes:  # (the second run looks at writes too: a layout changed, RELAYOUT)
                probe.known = statics | {storage_of(a) for a in (*args, *kwargs.values())
                                         if isinstance(a, torch.Tensor)}
                probe.written = set()
            # each run leaves the buffers and the random state as they were
            with restored(buffers, [True] * len(buffers), [], device), torch.no_grad(), \
                    Nested(), probe:
                module(*args, **kwargs)
            probes.append(probe)
        return probes

    with left_as_they_were(module, args, kwargs), _lazy_refused(module):
        probes = two_runs(False)
        if probes[0].findings and probes[0].may_rehearse():
            # As graphify does: code that asks whether it is being captured takes another path
            # while captured; where that path is safe, that path is the plan.
            try:
                rehearsed = two_runs(True)
            except Exception:  # noqa: BLE001 - that path fails here: keep the plain runs
                rehearsed = None
            if rehearsed is not None and not any(p.findings for p in rehearsed):
                probes = rehearsed
    findings = probes[0].unsafe_paths()
    for f in probes[1].findings:
        if "RELAYOUT" in f.tags:
            findings.setdefault(f.path, []).append(f)
    for p, f in control_flow_findings(*probes, "the op sequence differs between two "
                                      "runs").items():
        findings.setdefault(p, []).append(f)
    ran = probes[0].ran()
    cut = runs(probes[0].trace) if probes[0].findings else []
    return findings, plan_pieces(module, set(findings), ran), ran, cut


@contextlib.contextmanager
def _lazy_refused(module: torch.nn.Module):
    """Inside the block, a lazy submodule not yet initialized that explain's runs reach raises
    a usage error before it initializes itself (which cannot be undone); one they do not
    reach (a head used on request) is no matter."""
    def refuse(m, args):
        raise CudagraphifyUsageError(
            f"explain with example inputs reaches {type(m).__name__}, a lazy module not "
            "initialized yet: its run would initialize it; call the model once, then explain")

    handles = [m.register_forward_pre_hook(refuse, prepend=True) for m in module.modules()
               if any(is_lazy(t) for t in (*m.parameters(recurse=False),
                                           *m.buffers(recurse=False)))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def left_as_they_were(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Around explain's runs (not calls): the modules' attributes (a step counter, a cache set
    on first use), what their dicts hold (registered parameters, buffers and submodules,
    hooks), their classes, the tensors kept as plain attributes and the example inputs hold
    again what they held (values and versions). Parameters are not copied (a model's worth of memory):
    one the runs wrote in place is named in a warning."""
    modules = list(module.modules())
    # (their registries watched first, as the runs' scan would: the snapshots below refer to
    # them, and a registry kept elsewhere is not swapped for a watching copy)
    for m in modules:
        watch(m)
    dicts = [(m, dict(m.__dict__)) for m in modules]
    # (and what the dicts a module holds hold, by name: its parameters, buffers and
    # submodules registered (a ``register_buffer`` in forward, a dynamic rotary embedding's
    # rescaled ``inv_freq``), its hooks (one registered on first use, or removing itself after
    # it), a dict attribute; and its class: a parametrization swaps it)
    named = [(m, k, dict(v)) for m in modules for k, v in m.__dict__.items()
             if isinstance(v, dict) and not _own_state(k, v)]
    # (and what the containers and objects it keeps hold, a record's attributes included)
    held = _writes.contents([v for m in modules for k, v in m.__dict__.items()
                             if not _own_state(k, v)])
    classes = [(m, type(m)) for m in modules]
    # (by memory: a view of a parameter kept in a list is the parameter's, whose writes are
    # named in the warning below, not put back)
    registered = {storage_of(t) for m in modules for k in REGISTRIES
                  for t in m.__dict__[k].values() if isinstance(t, torch.Tensor)
                  and not is_lazy(t)}
    # (the tensors kept as plain attributes, and in the containers and objects kept there: a
    # layer's KV cache as ``self.caches = [k, v]``)
    tensors = [t for m in modules for k, v in m.__dict__.items()
               if k not in REGISTRIES and not _own_state(k, v)
               and not isinstance(v, torch.nn.Module)
               for t in _tensors_in(v) if storage_of(t) not in registered]
    tensors += [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    params = [(name, p, p._version) for name, p in module.named_parameters()
              if not is_lazy(p) and not p.is_inference()]
    try:
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(_writes.undone(tensors))
            except torch.OutOfMemoryError:
                warnings.warn("cudagraphify: explain could not copy the tensors kept as plain "
                              "attributes and the example inputs (out of memory): what its runs "
                              "write in them is not put back", CudagraphifyWarning,
                              stacklevel=4)
            yield
    finally:
        for m, cls in classes:
            if type(m) is not cls:
                m.__class__ = cls
        for m, before in dicts:
            now = m.__dict__
            for name in [k for k in now if k not in before and not _ours(k, now[k])]:
                del now[name]
            for name, value in before.items():
                current = now.get(name, _watch.MISSING)
                if current is not value and not _ours(name, current):
                    now[name] = value
        for m, name, before in named:
            d = m.__dict__.get(name)
            if isinstance(d, dict):  # (the same dict, or cudagraphify's watched copy of it)
                _writes.refill(d, before)
        _writes.put_back(held)
        _watch.bump()
        _statics.generation_bump()  # (refill writes a watched registry past its report)
        wrote = [name for name, p, version in params if p._version != version]
        if wrote:
            warnings.warn(f"cudagraphify: explain's runs of {type(module).__name__} wrote "
                          f"parameter(s) in place, which it does not put back: "
                          f"{', '.join(wrote[:8])}", CudagraphifyWarning, stacklevel=4)


def _own_state(name: str, value: Any) -> bool:
    """Whether a module attribute is cudagraphify's own state, call or forward wrapper (made by
    a graphed module's first call, or a piece's): left as runs that are not calls leave it,
    and not looked into."""
    return name.startswith("_cudagraphify") \
        or (name == "_compiled_call_impl" and _watch.own_call_impl(value)) \
        or (name == "forward" and type(value) in WRAPPERS)


def _ours(name: str, value: Any) -> bool:
    """:func:`_own_state`, or a registry cudagraphify watches (the object stays; what it
    holds is put back)."""
    return _own_state(name, value) or isinstance(value, _WatchedDict)


def _live(module: torch.nn.Module) -> dict | None:
    state = state_of_module(module)
    if state is None:
        return None
    return dataclasses.asdict(state.stats())


def build(name: str, module: torch.nn.Module | None, plan, stats: Stats,
          decisions: list) -> Explanation:
    """The report for ``module`` under ``plan`` = (findings, pieces, ran) or None."""
    nodes: list[dict] = []
    if module is None:
        return Explanation(name, nodes, stats, decisions)
    findings, pieces, ran = plan[:3] if plan is not None else ({}, None, None)
    findings, graphed = _with_own_plans(module, findings, pieces or ())
    # called, but every call ran eagerly before anything was planned (no CUDA, disabled...)
    unplanned = plan is None and stats.eager > 0
    for path, sub in module.named_modules():
        node: dict[str, Any] = {"path": path, "type": type(sub).__name__}
        inside = next((g for g in graphed if g and path.startswith(g + ".")), None)
        if inside is not None or ("" in graphed and path) or (unplanned and path):
            continue  # part of an ancestor's graph, or of its eager run: not listed
        if unplanned:
            node["status"] = "eager, nothing planned"
            node["reasons"] = [{"text": f"ran eagerly: {reason} ({n} call{'s' * (n != 1)})",
                                "reason": reason, "calls": n}
                               for reason, n in stats.eager_calls.items()]
        elif plan is None:
            # (a piece given back before it made a plan of its own: segments answered its
            # calls, or its trial ran on calls another run planned)
            given_back = getattr(state_of_module(sub), "given_back", None) if not path \
                else None
            node["status"] = "given back (eager)" if given_back else \
                "no plan yet (call it, or explain it with example inputs)"
            if given_back:
                node["reasons"] = [{"text": given_back, "reason": given_back}]
        elif path in graphed or (path == "" and "" in graphed):
            given_back = getattr(state_of_module(sub), "given_back", None)
            node["status"] = "given back (eager)" if given_back else "graphed"
            if given_back:
                node["reasons"] = [{"text": given_back, "reason": given_back}]
        elif path in findings or any(_below(path, f) for f in findings):
            node["status"] = "eager"
            node["reasons"] = [f.to_dict() for f in findings.get(path, [])]
            below = sorted(f for f in findings if _below(path, f))
            if below:
                node["reasons"].append({"text": "unsafe ops in its submodule(s) "
                                                + ", ".join(below), "submodules": below})
        elif ran is not None and not any(r == path or r.startswith(path + ".") for r in ran):
            node["status"] = "not run"
        elif ran is not None and path and path not in ran:
            node["status"] = "not called (its submodules are, directly)"
        else:
            node["status"] = "eager (no ops of its own)"
        live = _live(sub)
        if live and (live["captures"] or live["replays"] or live["retargets"]
                     or live.get("seen_once")):
            node["stats"] = live
        state = state_of_module(sub)
        if state is not None and state.plan_verdict is not None:
            node["plan"] = state.plan_verdict
        plans = state.segments.plans() if state is not None else []
        if plans:  # its eager runs graph the runs of calls between refused ones
            node["segments"] = [line for p in plans for line in p.describe()]
        share = share_of(sub)
        if share is not None:
            group, k = share.group, share.layer
            s = group.stats()
            node["share"] = {"layer": k, "layers": s.layers, "captures": s.captures,
                             "retargets": s.retargets, "per_layer": s.per_layer,
                             "reasons": s.reasons}
        nodes.append(node)
    return Explanation(name, nodes, stats, decisions, plan[3] if plan and len(plan) > 3 else None)


def _with_own_plans(module: torch.nn.Module, findings: dict,
                    pieces) -> tuple[dict, set[str]]:
    """The plan with the plans of its pieces merged in: a piece that plans pieces of its own (it
    gets an argument no signature holds, and runs eagerly) is eager, for its own findings, and its
    pieces are listed under it (recursively)."""
    findings = {p: list(fs) for p, fs in findings.items()}
    graphed, todo = set(pieces), list(pieces)
    while todo:
        path = todo.pop()
        try:
            sub = module.get_submodule(path) if path else module
        except AttributeError:  # removed since it was planned (a pruned layer)
            graphed.discard(path)
            continue
        state = state_of_module(sub)
        own = state.last_plan if state is not None and sub is not module else None
        if own is None:
            continue
        graphed.discard(path)
        own_findings, own_pieces = own
        for p, fs in own_findings.items():
            findings.setdefault(_join(path, p), []).extend(fs)
        for p in own_pieces:
            graphed.add(_join(path, p))
            todo.append(_join(path, p))
    return findings, graphed


def _join(path: str, sub: str) -> str:
    return f"{path}.{sub}" if path and sub else path or sub


def _below(path: str, other: str) -> bool:
    """True when ``other`` is a module path strictly inside ``path``."""
    return other != path and (path == "" or other.startswith(path + "."))
