"""Checks of the version counters a replay moves and a backward checks, against eager twins
(see tests/test_versions.py for the CPU tests of the same cases)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../inflight2"))
from common import (DEV, Scaled, cg, check, nn, outcome, randn,  # noqa: E402
                    same_as_eager, torch, twins)

from cudagraphify._fast import Fast  # noqa: E402
from cudagraphify._wrap import state_of_module  # noqa: E402


def _align(ref, g, *names):
    """The graphed twin's versions set to eager's (load_state_dict moved them)."""
    for n in names:
        torch._C._autograd._unsafe_set_version_counter((_get(g, n),), (_get(ref, n)._version,))


def _get(m, path):
    for part in path.split("."):
        m = getattr(m, part)
    return m


def _versions(ref, g, *names):
    bad = [(n, _get(ref, n)._version, _get(g, n)._version) for n in names
           if _get(ref, n)._version != _get(g, n)._version]
    return f"versions (name, eager, graphed): {bad}" if bad else None


def _steps(ref, g, shapes, names, steps=3):
    _align(ref, g, *names)
    for _ in range(steps):
        why = same_as_eager(ref, g, shapes, steps=1) or _versions(ref, g, *names)
        if why:
            return why
    return None


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.fz = nn.Parameter(torch.ones(16), requires_grad=False)

    def forward(self, x):
        with torch.no_grad():
            self.fz.mul_(0.5)
        return self.lin(x) * self.fz


class Held(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.acc = torch.ones(100, device=DEV)

    def forward(self, x):
        self.acc.mul_(0.5)
        return self.lin(x) * self.acc[:16]


class DetachPair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        # (made on the device: ``.to()`` would convert each buffer on its own, views apart)
        self.register_buffer("a", torch.ones(16, device=DEV))
        self.register_buffer("b", self.a.detach())

    def forward(self, x):
        self.a.mul_(0.5)
        self.b.mul_(0.5)
        return self.lin(x) * self.a


class ViewBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("base", torch.ones(32, device=DEV))  # (see DetachPair)
        self.register_buffer("lo", self.base[:16])

    def forward(self, x):
        self.lo.mul_(0.5)
        return self.lin(x) * self.base[16:]


class DataView(ViewBuffer):
    def __init__(self):
        super().__init__()
        self.register_buffer("lo", self.base.data[:16])


def rebind_data(m):
    m.scale = m.scale.data


def through_dict(m):
    m._buffers["scale"] = m.scale.data


def frozen_anew(m):
    m.fz = nn.Parameter(m.fz.data, requires_grad=False)


for name, make, prep, names in [
        ("a buffer rebound on its memory (m.scale = m.scale.data)", Scaled, rebind_data,
         ("scale",)),
        ("a buffer rebound through _buffers", Scaled, through_dict, ("scale",)),
        ("a frozen parameter made anew on its memory", Frozen, frozen_anew, ("fz",))]:
    for shapes in [(8, 8), (8, 12), (12, 8, 8)]:
        check(f"{name} {shapes}", lambda: _steps(*twins(make, prep=prep, warm=(8, 12)), shapes,
                                                 names))


def written_by_the_user():
    ref, g = twins(Scaled, prep=rebind_data, warm=(8,))
    for s in range(3):
        seen = []
        for m in (ref, g):
            def go(m=m):
                out = m(randn(8)).sum()
                with torch.no_grad():
                    m.scale.add_(1)
                out.backward()
            seen.append(outcome(go))
            m.zero_grad()
        if seen[0] != seen[1]:
            return f"step {s}: eager {seen[0]}, graphed {seen[1]}"
    return None


check("a rebound buffer written by the user before backward", written_by_the_user)


def no_grad_between(make):
    ref, g = twins(make, warm=(8,))
    for m in (ref, g):
        with torch.no_grad():
            m(randn(8))
    for s in range(3):
        seen = []
        for m in (ref, g):
            def go(m=m):
                out = m(randn(8)).sum()
                with torch.no_grad():
                    m(randn(8))
                out.backward()
            seen.append(outcome(go))
            m.zero_grad()
        if seen[0] != seen[1]:
            return f"step {s}: eager {seen[0]}, graphed {seen[1]}"
    return None


for make in (Scaled, Held, Frozen):
    check(f"a no_grad call between forward and backward ({make.__name__})",
          lambda: no_grad_between(make))


def inference(make, name, mode):
    ref, g = twins(make, warm=())
    _align(ref, g, name)
    replays = cg.stats(g).replays
    for s in range(5):
        x = randn(8)
        with mode():
            a, b = ref(x), g(x)
        if not torch.allclose(a, b, rtol=2e-5, atol=2e-6):
            return f"call {s}: outputs differ"
        why = _versions(ref, g, name)
        if why:
            return f"call {s}: {why}"
    if cg.stats(g).replays < replays + 3:
        return f"{cg.stats(g).replays - replays} replays"
    return None


for make, name in [(Scaled, "scale"), (Held, "acc"), (Frozen, "fz"), (DetachPair, "a"),
                   (ViewBuffer, "base")]:
    for mode in (torch.no_grad, torch.inference_mode):
        check(f"inference replays move versions ({make.__name__}, {mode.__name__})",
              lambda: inference(make, name, mode))


def held_fast_path():
    ref, g = twins(Held, warm=())
    _align(ref, g, "acc")
    with torch.no_grad():
        for _ in range(5):
            ref(randn(8)), g(randn(8))
    fast = type(state_of_module(g)._fast) is Fast
    return _versions(ref, g, "acc") or (None if fast else "no fast path")


check("a held tensor's writer replays on the fast path, moving its counter", held_fast_path)
for shapes in [(8,), (8, 8)]:
    check(f"a buffer and a detach() of it: one counter moved once {shapes}",
          lambda: _steps(*twins(DetachPair, warm=(8, 12)), shapes, ("a", "b")))
    check(f"a view of a buffer's .data written, the base saved {shapes}",
          lambda: _steps(*twins(DataView, warm=(8, 12)), shapes, ("base", "lo")))


def regrouped():
    ref, g = twins(ViewBuffer, warm=(8, 12))

    def rebind(m):
        m.base = m.base.data
    rebind(ref), rebind(g)
    return _steps(ref, g, (8,), ("base", "lo")) or _steps(ref, g, (8, 8), ("base", "lo"))


check("a view buffer's base rebound: captured again", regrouped)
