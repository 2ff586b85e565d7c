"""Random outputs against eager's: chains of views (slices, transposes, dtype views, expand,
detach, conj, real/imag, diagonal...) of an argument, of intermediates and of a module's
parameter and buffer, returned together.

Each forward is graphified (copies, ``copy_outputs=False``, in a ``graph_region``) and called
four times; every output must match eager's in dtype, shape, strides, bits, ``requires_grad``,
type and values, share memory with the argument and with the other outputs exactly where
eager's do, be the same object where eager's are, take an in-place write through the first
output as eager's do, and allow an in-place op with grad and ``detach_()`` wherever eager's do.
"""

from __future__ import annotations

import contextlib
import copy
import random

import pytest
import torch

import cudagraphify as cg

SEEDS = range(200)


def _step(t: torch.Tensor, op: str) -> torch.Tensor:
    """``t`` after view op ``op``, where it applies (else ``t``)."""
    if op == "slice" and t.dim() and t.shape[0] > 1:
        return t[1:]
    if op == "t" and t.dim() == 2:
        return t.t()
    if op == "unsqueeze":
        return t.unsqueeze(0)
    if op == "expand" and t.dim() and t.shape[0] == 1:
        return t.expand(3, *t.shape[1:])
    if op == "int32" and t.dtype == torch.float32 and t.dim() and t.stride(-1) == 1:
        return t.view(torch.int32)
    if op == "detach":
        return t.detach()
    if op == "contiguous":
        return t.contiguous()
    if op == "flatten" and t.is_contiguous():
        return t.flatten()
    if op == "select" and t.dim() > 1:
        return t[0]
    if op == "diagonal" and t.dim() == 2:
        return t.diagonal()
    if op == "narrow" and t.dim() and t.shape[-1] > 2:
        return t.narrow(-1, 1, 2)
    if op == "conj" and t.is_complex():
        return t.conj()
    if op == "real" and t.is_complex():
        return t.real
    if op == "imag" and t.is_complex():
        return t.imag
    if op == "same":
        return t.view(t.shape)
    return t


def _outputs(named: dict, chains: list) -> tuple:
    """The outputs of ``chains``: (source name, view ops) each, from ``named`` tensors."""
    outs = []
    for source, ops in chains:
        t = named[source]
        for op in ops:
            t = _step(t, op)
        outs.append(t)
    return tuple(outs)


_OPS = ("slice", "t", "unsqueeze", "expand", "int32", "detach", "contiguous", "flatten",
        "select", "diagonal", "narrow", "conj", "real", "imag", "same")


def _forward(seed: int):
    """A forward returning 1-4 view chains of its argument ``x``, ``y = x * 2`` or ``y + 1``,
    and the dtype of its argument."""
    rng = random.Random(seed)
    dtype = torch.complex64 if rng.random() < 0.3 else torch.float32
    chains = [(rng.choice("yyxz"), [rng.choice(_OPS) for _ in range(rng.randint(0, 3))])
              for _ in range(rng.randint(1, 4))]

    def forward(x):
        y = x * 2
        return _outputs({"x": x, "y": y, "z": y + 1}, chains)
    return forward, dtype


def _layout(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), t.stride(), t.is_conj(), t.is_neg(), t.requires_grad,
            type(t))


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg())


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _pairs_unlike(out: tuple, want: tuple) -> list[str]:
    """The pairs of outputs that share memory, or are one object, unlike eager's."""
    found = []
    for i in range(len(out)):
        for j in range(i + 1, len(out)):
            if (_ptr(out[i]) == _ptr(out[j])) != (_ptr(want[i]) == _ptr(want[j])):
                found.append(f"outputs {i} and {j}: aliasing unlike eager's")
            if (out[i] is out[j]) != (want[i] is want[j]):
                found.append(f"outputs {i} and {j}: identity unlike eager's")
    return found


def _allowed(op, t: torch.Tensor) -> bool:
    try:
        op(t)
        return True
    except RuntimeError:
        return False


def _graphed(target, mode: str):
    """``target`` graphified for ``mode`` (copies, zero copy, region), and the scope its calls
    run in."""
    g = cg.graphify(target, **({"copy_outputs": False} if mode == "zero copy" else {}))
    return g, cg.graph_region() if mode == "region" else contextlib.nullcontext()


def _differences(seed: int, mode: str) -> list[str]:
    forward, dtype = _forward(seed)
    g, scope = _graphed(forward, mode)
    found: list[str] = []
    with torch.no_grad(), scope:
        for call in range(4):
            x = torch.randn(4, 4, dtype=dtype)
            mine = x.clone()
            out, want = g(x), forward(mine)
            for k, (o, w) in enumerate(zip(out, want)):
                if _layout(o) != _layout(w):
                    found.append(f"output {k}: {_layout(o)} vs eager's {_layout(w)}")
                elif not _equal(o, w):
                    found.append(f"output {k}: values")
                if (_ptr(o) == _ptr(x)) != (_ptr(w) == _ptr(mine)):
                    found.append(f"output {k}: shares the argument's memory or not, unlike "
                                 "eager's")
            found += _pairs_unlike(out, want)
        if mode != "zero copy":  # (its outputs are the graph's: the next call overwrites them)
            if _allowed(lambda t: t.add_(1), want[0]) != _allowed(lambda t: t.add_(1), out[0]):
                found.append("an in-place write through output 0: allowed unlike eager's")
            for k, (o, w) in enumerate(zip(out, want)):
                if not _equal(o, w):
                    found.append(f"after a write through output 0, output {k}: values")
            if not torch.equal(x, mine):
                found.append("after a write through output 0: the argument")
    if mode != "region":
        # refused where eager's allows (the reverse, a copy of its own where eager's was a
        # no_grad view, is more permissive than eager and not looked for)
        w = torch.randn((), requires_grad=True)
        for k, (o, e) in enumerate(zip(out, want)):
            for name, op in (("an in-place op with grad", lambda t: t.mul_(w.to(t.dtype))),
                             ("detach_()", lambda t: t.detach_())):
                if _allowed(op, e) and not _allowed(op, o):
                    found.append(f"output {k}: {name} refused, eager's allowed")
    if not cg.stats(g).replays:
        found.append(f"no replay ({cg.stats(g).eager_calls})")
    return [f"seed {seed}, {mode}: {d}" for d in found]


@pytest.mark.parametrize("mode", ["copies", "zero copy", "region"])
def test_random_outputs_are_eagers(sim, quiet, mode):
    found = [d for seed in SEEDS for d in _differences(seed, mode)]
    # (a few forwards run eagerly on purpose: a view of an argument as a dtype of another
    # element size, for one; those show up here as "no replay" and are counted apart)
    wrong = [d for d in found if "no replay" not in d]
    eager = [d for d in found if "no replay" in d]
    assert not wrong, "\n".join(wrong[:10])
    assert len(eager) <= len(SEEDS) // 10, "\n".join(eager[:10])


class _Module(torch.nn.Module):
    """Outputs: view chains of its argument, intermediates, its parameter ``w``, its buffer."""

    def __init__(self, seed: int, dtype: torch.dtype):
        super().__init__()
        rng = random.Random(seed)
        self.w = torch.nn.Parameter(torch.randn(4, 4, dtype=dtype))
        self.register_buffer("b", torch.randn(4, 4, dtype=dtype))
        self.chains = [(rng.choice("xywbz"), [rng.choice(_OPS) for _ in range(rng.randint(0, 3))])
                       for _ in range(rng.randint(1, 4))]

    def forward(self, x):
        y = x * 2
        named = {"x": x, "y": y, "z": y + 1, "w": self.w, "b": self.b}
        return _outputs(named, self.chains)


def _module_differences(seed: int, mode: str, grad: bool) -> list[str]:
    dtype = torch.complex64 if random.Random(seed).random() < 0.3 else torch.float32
    m = _Module(seed, dtype).requires_grad_(grad)
    g, scope = _graphed(copy.deepcopy(m), mode)
    mine = {_ptr(t) for t in (*g.parameters(), *g.buffers())}
    theirs = {_ptr(t) for t in (*m.parameters(), *m.buffers())}
    found: list[str] = []
    with (torch.enable_grad() if grad else torch.no_grad()), scope:
        for _ in range(4):
            x = torch.randn(4, 4, dtype=dtype)
            out, want = g(x), m(x)
            for k, (o, w) in enumerate(zip(out, want)):
                if _layout(o) != _layout(w):
                    found.append(f"output {k}: {_layout(o)} vs eager's {_layout(w)}")
                elif not _equal(o.detach(), w.detach()):
                    found.append(f"output {k}: values")
                if (_ptr(o) in mine) != (_ptr(w) in theirs):
                    found.append(f"output {k}: shares a parameter's or buffer's memory or not, "
                                 "unlike eager's")
                if o._is_view() and not w._is_view():  # (refuses detach_() where eager's not)
                    found.append(f"output {k}: a view where eager's is none")
            found += _pairs_unlike(out, want)
    return [f"seed {seed}, {mode}{', grad' if grad else ''}: {d}" for d in found], \
        cg.stats(g).replays


# (in grad mode most of these forwards return a parameter, an argument or a view of one,
# which a training graph refuses: a few of them replay)
@pytest.mark.parametrize("mode, grad, least", [("copies", False, 100), ("zero copy", False, 100),
                                               ("region", False, 100), ("copies", True, 10)])
def test_random_module_outputs_are_eagers(sim, quiet, mode, grad, least):
    found, replayed = [], 0
    for seed in range(120):
        wrong, replays = _module_differences(seed, mode, grad)
        found += wrong
        replayed += replays > 0
    assert not found, "\n".join(found[:10])
    assert replayed >= least


class _Piecewise(torch.nn.Module):
    """A root with a host sync between two submodules (a piecewise plan, or segments):
    outputs are view chains of its argument, of the first piece's output and of the last's."""

    def __init__(self, seed: int):
        super().__init__()
        rng = random.Random(seed)
        self.a = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        self.b = torch.nn.Linear(4, 4)
        self.chains = [(rng.choice("xyh"), [rng.choice(_OPS) for _ in range(rng.randint(0, 3))])
                       for _ in range(rng.randint(1, 4))]

    def forward(self, x):
        h = self.a(x)
        h.sum().item()  # (the root cannot be one graph)
        named = {"x": x, "h": h, "y": self.b(h)}
        return _outputs(named, self.chains)


@pytest.mark.parametrize("segments", [False, True])
def test_random_piecewise_outputs_are_eagers(sim, quiet, segments):
    found, replayed = [], 0
    for seed in range(40):
        m = _Piecewise(seed).eval()
        g = cg.graphify(copy.deepcopy(m), segments=segments)
        with torch.no_grad():
            for _ in range(6):
                x = torch.randn(4, 4)
                out, want = g(x), m(x)
                for k, (o, w) in enumerate(zip(out, want)):
                    if _layout(o) != _layout(w) or not _equal(o, w):
                        found.append(f"seed {seed}: output {k}: {_layout(o)} vs {_layout(w)}")
                    if (_ptr(o) == _ptr(x)) != (_ptr(w) == _ptr(x)):
                        found.append(f"seed {seed}: output {k}: the argument's memory")
                found += [f"seed {seed}: {d}" for d in _pairs_unlike(out, want)]
            if _allowed(lambda t: t.add_(1), want[0]) != _allowed(lambda t: t.add_(1), out[0]):
                found.append(f"seed {seed}: a write through output 0 allowed unlike eager's")
            if not all(_equal(o, w) for o, w in zip(out, want)):
                found.append(f"seed {seed}: after a write through output 0")
        s = cg.stats(g)
        replayed += (s.segment_replays if segments else cg.stats(g.b).replays) > 0
    assert not found, "\n".join(found[:10])
    assert replayed >= 30


def _writing(seed: int):
    """A forward that writes in place through a random view of its argument, then returns
    view chains of the argument, of ``x * 2`` and of the view it wrote through."""
    rng = random.Random(seed)
    dtype = torch.complex64 if rng.random() < 0.3 else torch.float32
    path = [rng.choice(("slice", "t", "select", "diagonal", "narrow", "same", "conj", "real"))
            for _ in range(rng.randint(0, 2))]
    write = rng.choice(("add_", "mul_", "copy_", "zero_"))
    chains = [(rng.choice("xyw"), [rng.choice(_OPS) for _ in range(rng.randint(0, 3))])
              for _ in range(rng.randint(1, 4))]

    def forward(x):
        w = x
        for op in path:
            w = _step(w, op)
        {"add_": lambda: w.add_(1), "mul_": lambda: w.mul_(2), "copy_": lambda: w.copy_(w * 3),
         "zero_": w.zero_}[write]()
        return _outputs({"x": x, "y": x * 2, "w": w}, chains)
    return forward, dtype


@pytest.mark.parametrize("mode", ["copies", "zero copy", "region"])
def test_random_outputs_of_a_forward_that_writes_its_argument(sim, quiet, mode):
    found, replayed = [], 0
    for seed in range(60):
        forward, dtype = _writing(seed)
        g, scope = _graphed(forward, mode)
        with torch.no_grad(), scope:
            for _ in range(4):
                x = torch.randn(4, 4, dtype=dtype)
                mine = x.clone()
                out, want = g(x), forward(mine)
                if not _equal(x, mine):
                    found.append(f"seed {seed}: the argument after the call")
                for k, (o, w) in enumerate(zip(out, want)):
                    if _layout(o) != _layout(w) or not _equal(o, w) \
                            or (_ptr(o) == _ptr(x)) != (_ptr(w) == _ptr(mine)):
                        found.append(f"seed {seed}: output {k}: {_layout(o)} vs {_layout(w)}")
                found += [f"seed {seed}: {d}" for d in _pairs_unlike(out, want)]
        replayed += cg.stats(g).replays > 0
    assert not found, "\n".join(found[:10])
    assert replayed >= 40
