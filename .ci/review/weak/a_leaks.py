"""1d05912: a shared policy's or an open region's cache must not keep a deleted module (its
parameters, its graphs) alive. The bytes each deleted module leaves behind, right after
``del`` and again after the next call that looks its entries up (a shared policy: the next
module's calls with the same signature; a region: its next call), where an entry keeps:

- [control] a Python attribute read (self.scale, the commit's case): nothing;
- [finding] a value read that points back at the module (a bound method of it kept as an
  attribute, as HF's GELUActivation(use_gelu_python=True); a plain object holding it; its
  parent kept out of the registries): everything, for good (Read.value, _DictCheck items);
- [finding] a submodule that ran with an instance-level forward (accelerate's
  add_hook_to_module): that submodule, until the entry is dropped (StateGuard._ran);
- [finding] a frozen parameter autograd saves (TrainingGraph.saved_statics), a buffer the
  forward returns (the output plan), a plain tensor attribute (StateGuard.tensors): those
  tensors, until the entry is dropped;
- [finding] a shared policy's next module, the first one deleted, gets its own outputs (not
  the deleted module's, replayed through the graphs a leak kept). See common.py.

In each line, bad=x+y counts the outputs that differ from the eager twin's: x of the deleted
module's calls, y of the next module's (a shared policy's y > 0 where the deleted module's
graphs were kept: its next module replays them, with the deleted module's weights)."""
import contextlib
import copy
import functools
import gc

import torch
from torch import nn

import cudagraphify as cg
from common import CPU, DEV, MIB, Tracked, allocated, check, finish, info, leftover, sync

W = 64 if CPU else 1024  # a W x W fp32 weight: 4 MiB on the GPU
B = 2


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.scale = 0.5

    def forward(self, x):
        return self.lin(x) * self.scale


class BoundAct(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.act = self._act  # (HF GELUActivation(use_gelu_python=True): self._gelu_python)

    def _act(self, y):
        return y * torch.sigmoid(1.702 * y)

    def forward(self, x):
        return self.act(self.lin(x))


class _Settings:
    def __init__(self, owner):
        self.owner, self.gain = owner, 2.0


class WithSettings(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.settings = _Settings(self)

    def forward(self, x):
        return self.lin(x) * self.settings.gain


class _Child(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)

    def forward(self, x):
        return self.lin(x) * self.parent.gain


class Parent(nn.Module):
    def __init__(self):
        super().__init__()
        self.child = _Child()
        self.gain = 2.0
        object.__setattr__(self.child, "parent", self)

    def forward(self, x):
        return self.child(x)


class _Sub(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)

    def forward(self, x):
        return self.lin(x)


def _new_forward(module, *args, **kwargs):  # accelerate's add_hook_to_module, hook left out
    return type(module).forward(module, *args, **kwargs)


class Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.sub = _Sub()
        self.scale = 0.5
        self.sub.forward = functools.update_wrapper(functools.partial(_new_forward, self.sub),
                                                    _Sub.forward)

    def forward(self, x):
        return self.sub(x) * self.scale


class Frozen(nn.Module):
    """A big frozen layer (its weight saved for backward), a small trainable head."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(W, W).requires_grad_(False)
        self.head = nn.Linear(W, 8)

    def forward(self, x):
        return self.head(self.frozen(x))


class ReturnsBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, 8)
        self.register_buffer("table", torch.randn(W, W))

    def forward(self, x):
        return self.lin(x), self.table


class PlainMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, 8)
        self.mask = torch.tril(torch.ones(W, W))

    def forward(self, x):
        return self.lin(x @ self.mask)


def _tensors(m: nn.Module) -> list:
    out = list(m.parameters()) + list(m.buffers())
    for mod in m.modules():
        out += [v for v in vars(mod).values() if isinstance(v, torch.Tensor)]
    return out


def _equal(a, b) -> bool:
    if isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _calls(ref, g, grad: bool, n: int = 3) -> int:
    bad = 0
    for _ in range(n):
        x = torch.randn(B, W, device=DEV, requires_grad=grad)
        got, want = g(x), ref(x)
        bad += not _equal(got, want)
        if grad:
            got.sum().backward()
            want.sum().backward()
    sync()
    return bad


def scenario(label, cls, where, grad=False, expect_freed=False, held_bytes=None):
    """Build a twin and a graphed module of ``cls`` in a shared policy or a region, call, delete
    the graphed one: the bytes left right away and after the next lookup."""
    policy = cg.CachePolicy(max_graphs=4, shared=True)
    options = {"cache_policy": policy} if where == "shared" else {}
    region = cg.graph_region() if where == "region" else contextlib.nullcontext()
    torch.manual_seed(0)
    with region, torch.set_grad_enabled(grad):
        ref = cls().to(DEV)
        base = allocated()
        a = cg.graphify(copy.deepcopy(ref), **options)
        size = held_bytes if held_bytes is not None else \
            sum(t.numel() * t.element_size() for t in a.parameters())
        tracked = Tracked()
        tracked.add(*_tensors(a))
        bad = _calls(ref, a, grad)
        del a
        now = leftover(base, tracked)
        # the next lookup: a shared policy's next module (same signature); the region's next
        # call (its graphed calls collect the dead callables' caches)
        nref = cls().to(DEV)
        nxt = cg.graphify(copy.deepcopy(nref), **options)
        nxt_bad = _calls(nref, nxt, grad)
        later = leftover(base, tracked) - (0 if CPU else _bytes_of(nxt) + _bytes_of(nref))
        del nxt, nref
    gc.collect()
    freed = now < size / 2
    tag = "[control]" if expect_freed else "[finding]"
    check(bad == 0 and nxt_bad == 0 and freed, f"{tag} {label} ({where}): a deleted module's "
          f"bytes are freed at once", f"bad={bad}+{nxt_bad} left right after del: "
          f"{now / MIB:.2f} MiB, after the next lookup: {later / MIB:.2f} MiB (of "
          f"{size / MIB:.2f} MiB it holds)")


def _bytes_of(m) -> int:
    seen, n = set(), 0
    for t in _tensors(m):
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            n += s.nbytes()
    return n


def next_module():
    """A bound-method module captured in a shared policy, deleted; the next module (other
    weights) must capture and get its own outputs."""
    policy = cg.CachePolicy(max_graphs=4, shared=True)
    x = torch.randn(B, W, device=DEV)
    with torch.no_grad():
        torch.manual_seed(0)
        a = cg.graphify(BoundAct().to(DEV), cache_policy=policy)
        a(x), a(x)
        del a
        gc.collect()
        torch.manual_seed(1)
        ref_b = BoundAct().to(DEV)
        b = cg.graphify(copy.deepcopy(ref_b), cache_policy=policy)
        bad = sum(not torch.equal(b(x), ref_b(x)) for _ in range(4))
        s = cg.stats(b)
    check(bad == 0, "[finding] a shared policy's next module (the first one, which keeps a "
          "bound method of its own, deleted) gets its own outputs",
          f"bad={bad} of 4 captures={s.captures} replays={s.replays}")


def main():
    info(f"DEV={DEV} W={W}")
    for where in ("shared", "region"):
        scenario("reads self.scale (the commit's case)", Scaled, where, expect_freed=True)
        scenario("keeps a bound method of its own (HF GELUActivation(use_gelu_python=True))",
                 BoundAct, where)
        scenario("keeps a plain object that holds it", WithSettings, where)
        scenario("its child keeps it as a plain attribute", Parent, where)
        scenario("its submodule has an instance forward (accelerate-style)", Hooked, where)
        scenario("a frozen layer saved for backward (training)", Frozen, where, grad=True,
                 held_bytes=W * W * 4)
        with torch.no_grad():
            scenario("returns a buffer of its own", ReturnsBuffer, where, held_bytes=W * W * 4)
            scenario("keeps a plain tensor attribute", PlainMask, where, held_bytes=W * W * 4)
    next_module()
    finish()


if __name__ == "__main__":
    main()
