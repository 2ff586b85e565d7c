"""Review of a8abf78 (_fast.Bypass) and f9e7252 (a training graph's trial turns count the slow
path) on a GPU: piecewise models whose root has an unsafe op (a tensor made on the CPU inside
forward and moved; ``.item()``), called under grad mode with their outputs kept, then backward.
See common.py for the line format. ``python piecewise.py`` (DEV=cpu: the CPU double)."""
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (CPU, DEV, STATE, armed, bypass_off, check, differential, info,  # noqa: E402
                    pending_calls, timed, zero)

import torch  # noqa: E402
from torch import nn  # noqa: E402

import cudagraphify as cg  # noqa: E402

W = 64


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc, self.fc2 = nn.LayerNorm(W), nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x):
        t = torch.tensor([0.5]).to(x.device)  # made on the CPU inside forward: unsafe, eager
        return x + self.fc2(torch.nn.functional.gelu(self.fc(self.ln(x)))) * t


class Model(nn.Module):
    def __init__(self, blocks=3):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(W, W)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class Trim(nn.Module):
    """``.item()`` (a host sync) picks how many rows the pieces see: their shapes are set by
    the data, the root's arguments keep one shape."""

    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(W), nn.Linear(W, W)

    def forward(self, x):
        n = 4 + int((x[0, 0] > 0).item())
        return self.fc(self.ln(x[:n])).sum(0)


class Ctx:  # an argument with no value semantics: opaque to the signature
    def __init__(self, scale):
        self.scale = scale


class Opaque(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(W), nn.Linear(W, W)

    def forward(self, x, ctx):
        return self.fc(self.ln(x)) * ctx.scale


def rows(n, gen):
    x = torch.randn(8, W, generator=gen).to(DEV)
    x[0, 0] = 1.0 if n == 5 else -1.0
    return x


class Syncs(nn.Module):
    """No submodule; its 5-row signature syncs the host (run eagerly, remembered), its 4-row
    one is graphed."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(W, W) / 8)

    def forward(self, x):
        y = x @ self.w
        if x.shape[0] == 5:
            y = y * float(y.sum() > -1e30)
        return y


class TrimSyncs(nn.Module):
    def __init__(self):
        super().__init__()
        self.p, self.q = Syncs(), nn.Linear(W, W)

    def forward(self, x):
        n = 4 + int((x[0, 0] > 0).item())
        return self.q(self.p(x[:n])).sum(0)


def inputs_model():
    gen = torch.Generator().manual_seed(1)
    while True:
        yield (torch.randn(16, W, generator=gen).to(DEV),), {}


def inputs_trim():
    gen = torch.Generator().manual_seed(2)
    i = 0
    while True:  # the arming calls see 5 rows; the later ones 4 and 5 in turn
        yield (rows(5 if i < 11 or i % 2 else 4, gen),), {}
        i += 1


def step(g, ref, *args, back=True):
    o, w = g(*args), ref(*args)
    same = torch.equal(o, w)
    if back:
        o.sum().backward(), w.sum().backward()
    return o, w, same


def f1():
    """[finding] F1: a piece's calls of another signature (here set by ``.item()``) are pinned
    to the pending decision of the signature whose outputs are kept."""
    name = "[finding] F1 Trim: the free signature's training graph replays while another's waits"
    try:
        res = {}
        for on in (True, False):
            torch.manual_seed(0)
            ref = Trim().to(DEV)
            g = cg.graphify(copy.deepcopy(ref))
            gen = torch.Generator().manual_seed(3)
            a, b = rows(5, gen), rows(4, gen)
            ok = True
            with (bypass_off() if not on else _null()):
                for _ in range(4):
                    ok &= step(g, ref, a)[2] & step(g, ref, b)[2]
                kept = [step(g, ref, a, back=False) for _ in range(4)]
                ok &= step(g, ref, b)[2] & step(g, ref, b)[2]
                r, p = cg.stats(g.fc).replays, pending_calls([g.fc])
                for _ in range(6):
                    ok &= step(g, ref, b)[2]
                res[on] = (cg.stats(g.fc).replays - r, pending_calls([g.fc]) - p, ok, armed(g))
                del kept
        on, off = res[True], res[False]
        check(on[2] and off[2], "[control] F1 Trim: outputs bitwise eager's, bypass on and off")
        check(on[0] == off[0] and on[1] == 0, name,
              f"bypass on: {on[0]} replays, {on[1]} calls counted pending (armed {on[3]}); "
              f"off: {off[0]} replays, {off[1]} pending")
    except Exception as e:  # noqa: BLE001
        check(False, name, f"{type(e).__name__}: {str(e)[:300]}")


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def f2():
    """[finding] F2a/F2b: an opaque root's fast path checks neither its tensors nor its statics,
    yet arms the bypass."""
    res = {}
    try:
        for on in (True, False):
            torch.manual_seed(0)
            ref = Opaque().to(DEV)
            g = cg.graphify(copy.deepcopy(ref))
            c = Ctx(2.0)
            x = torch.randn(8, W, device=DEV)
            y = torch.randn(12, W, device=DEV)
            ok = True
            with (bypass_off() if not on else _null()):
                with torch.no_grad():
                    for _ in range(3):
                        ok &= torch.equal(g(x, c), ref(x, c))
                for _ in range(4):
                    ok &= step(g, ref, x, c)[2]
                kept = [step(g, ref, x, c, back=False) for _ in range(6)]
                was_armed = armed(g)
                for _ in range(3):
                    ok &= step(g, ref, y, c)[2]
                r = cg.stats(g.fc).replays
                for _ in range(4):
                    ok &= step(g, ref, y, c)[2]
                new_shape = cg.stats(g.fc).replays - r
                for m in (g, ref):
                    m.fc.weight.data = m.fc.weight.data.clone()
                ok &= step(g, ref, x, c, back=False)[2]
                try:
                    sum(o.sum() for o, _, _ in kept).backward()
                    raised = "nothing"
                except Exception as e:  # noqa: BLE001
                    raised = str(e)[:60]
                kept.clear()
                zero(g, ref)
                r = cg.stats(g.fc).replays
                for _ in range(6):
                    ok &= step(g, ref, x, c)[2]
                st = g.fc.__dict__[STATE]
                res[on] = dict(armed=was_armed, new_shape=new_shape, raised=raised,
                               refused=st.train_eager is not None,
                               after=cg.stats(g.fc).replays - r, ok=ok)
        on, off = res[True], res[False]
        info(f"F2 opaque root: bypass on {on}; off {off}")
        check(on["ok"] and off["ok"], "[control] F2 opaque root: outputs bitwise eager's")
        check(on["new_shape"] == off["new_shape"], "[finding] F2a opaque root: a new shape of "
              "its tensor is decided by the pieces (their graphs of it replay)",
              f"replays in 4 steps: on {on['new_shape']}, off {off['new_shape']}")
        check(on["refused"] == off["refused"] and on["after"] == off["after"],
              "[finding] F2b opaque root: a piece's parameter moved while its output is kept "
              "does not refuse its training for good",
              f"on: refused {on['refused']}, replays after {on['after']}; off: refused "
              f"{off['refused']}, replays after {off['after']}")
    except Exception as e:  # noqa: BLE001
        check(False, "[finding] F2 opaque root", f"{type(e).__name__}: {str(e)[:300]}")


def f4():
    """[finding] F4 (c7b45d4, on main during this review): a piece's eager decision of one
    signature pins its graphed signature plain for good (no output kept)."""
    name = ("[finding] F4 TrimSyncs: the piece's graphed signature replays after a call of its "
            "eager one")
    try:
        res = {}
        for on in (True, False):
            torch.manual_seed(0)
            ref = TrimSyncs().to(DEV)
            g = cg.graphify(copy.deepcopy(ref))
            gen = torch.Generator().manual_seed(6)
            ok = True
            with (bypass_off() if not on else _null()):
                for _ in range(4):
                    ok &= step(g, ref, rows(4, gen))[2]
                    zero(g, ref)
                for _ in range(3):
                    ok &= step(g, ref, rows(5, gen))[2]
                    zero(g, ref)
                r = cg.stats(g.p).replays
                for _ in range(20):
                    ok &= step(g, ref, rows(4, gen))[2]
                    zero(g, ref)
                res[on] = (cg.stats(g.p).replays - r, ok, cg.stats(g.p).graphs)
        check(res[True][1] and res[False][1], "[control] F4 TrimSyncs: outputs bitwise eager's")
        check(res[True][0] == res[False][0], name,
              f"replays in 20 steps: bypass on {res[True][0]}, off {res[False][0]} "
              f"(graphs {res[True][2]}, {res[False][2]})")
    except Exception as e:  # noqa: BLE001
        check(False, name, f"{type(e).__name__}: {str(e)[:300]}")


def trial_training():
    """[control] f9e7252 on the real clock: pieces timed under grad mode (their training graphs'
    turns count the slow path), kept outputs in between, backward: eager's values; what the
    trials decided is reported."""
    name = "[control] timed pieces, training with kept outputs"
    try:
        with timed():
            torch.manual_seed(0)
            ref = Model().to(DEV)
            g = cg.graphify(copy.deepcopy(ref))
            gen = torch.Generator().manual_seed(4)
            ok, close = True, True
            for i in range(24):
                x = torch.randn(16, W, generator=gen).to(DEV)
                if i % 6 == 5:  # two forwards kept, one backward (accumulation)
                    o1, w1, s1 = step(g, ref, x, back=False)
                    o2, w2, s2 = step(g, ref, x * 2, back=False)
                    ok &= s1 and s2
                    (o1.sum() + o2.sum()).backward(), (w1.sum() + w2.sum()).backward()
                else:
                    ok &= step(g, ref, x)[2]
                close &= all(torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)
                             for p, q in zip(g.parameters(), ref.parameters()))
                zero(g, ref)
            states = [m.__dict__[STATE] for m in g.__dict__[STATE].pieces]
            kept = sum(st.given_back is None for st in states)
            info(f"timed pieces: {kept} of {len(states)} kept; given back: "
                 f"{sorted({(st.given_back or '')[:70] for st in states} - {''})}")
        check(ok, name + ": outputs bitwise eager's")
        check(close, name + ": gradients within 1e-5 of eager's")
    except Exception as e:  # noqa: BLE001
        check(False, name, f"{type(e).__name__}: {str(e)[:300]}")


if __name__ == "__main__":
    info(f"device {DEV}{' (CPU double)' if CPU else ''}, torch {torch.__version__}")
    differential("Model (tensor made on the CPU in forward)", Model, inputs_model())
    differential("Trim (.item())", Trim, inputs_trim())
    f1()
    f2()
    f4()
    trial_training()
    sys.exit(0)
