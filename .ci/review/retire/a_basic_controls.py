"""Controls: a retired piece runs its plain forward (bitwise eager), a kept one replays; a
pending backward delays retirement; threads calling the root through the trial."""
import threading

import torch

import cudagraphify as cg
from cudagraphify import _wrap
from common import (DEV, FORCED, Root, check, counters, force_verdict, guarded, pair, plain,
                    same)


def retired_basic():
    force_verdict(True)
    ref, g = pair()
    ok = same(g, ref, calls=12)
    check(ok, "retired pieces: 12 root calls equal eager bitwise", counters(g.a))
    s = cg.stats(g.a)
    check(g.a._cudagraphify_state.given_back == FORCED and s.captures >= 1
          and s.timed_calls == 3 and s.graphs == 0 and plain(g.a) and plain(g.b),
          "pieces captured, timed, given back and retired (no forward/DirectCall left)",
          counters(g.a))
    ok = same(g, ref, calls=3) and same(g.a, ref.a, calls=2)
    check(ok and cg.stats(g.a).eager_calls[FORCED] == 0,
          "after retirement: root and piece equal eager, piece calls not counted",
          counters(g.a))
    cg.ungraphify(g)
    check(not any("_cudagraphify_state" in m.__dict__ for m in g.modules())
          and same(g, ref, calls=2), "ungraphify(root) takes the retired states; eager-equal")


def kept_basic():
    force_verdict(False)
    ref, g = pair()
    ok = same(g, ref, calls=12)
    s = cg.stats(g.a)
    check(ok and s.graphs == 1 and s.replays > 0 and not plain(g.a),
          "kept pieces: equal eager bitwise and replay their graphs", counters(g.a))


def _near(a, b):
    """Grads: a graphed backward reads its grad_output from a static buffer (contiguous) where
    eager's ``out.sum().backward()`` passes an expanded one (stride 0): cuBLAS may take another
    kernel, a difference of an ulp or two (5e-7 measured on the H200), not a stale value."""
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def pending_backward():
    force_verdict(False)
    ref, g = pair()
    with torch.enable_grad():
        for _ in range(3):
            x = torch.randn(8, 64, device=DEV)
            g(x).sum().backward(), ref(x).sum().backward()
        # (a piece's training graph is timed against its eager forward by turns, 3 of each,
        # where the machine has a clock: the pending forward must be a graph's turn)
        for _ in range(8):
            g.zero_grad(), ref.zero_grad()
            x = torch.randn(8, 64, device=DEV)
            before = cg.stats(g.a).replays
            out, want = g(x), ref(x)  # backward pending
            if cg.stats(g.a).replays > before:
                break
            out.sum().backward(), want.sum().backward()
    st = g.a._cudagraphify_state
    with st.lock:
        st.give_back(FORCED)  # (as a plan trial's verdict does)
    waited = st._backward_pending and not plain(g.a)
    parts = {"waited": waited, "same": same(g, ref, calls=3)}
    with torch.enable_grad():
        out.sum().backward(), want.sum().backward()
    parts["grads"] = all(_near(p.grad, q.grad)
                         for p, q in zip(g.parameters(), ref.parameters()))
    with torch.enable_grad():
        g.zero_grad(), ref.zero_grad()
        x = torch.randn(8, 64, device=DEV)
        o2, w2 = g(x), ref(x)
        parts["after"] = torch.equal(o2, w2)
        o2.sum().backward(), w2.sum().backward()
    parts["grads after"] = all(_near(p.grad, q.grad)
                               for p, q in zip(g.parameters(), ref.parameters()))
    parts["retired"] = plain(g.a)
    check(all(parts.values()),
          "pending backward: retirement waits, outputs and grads equal eager, then retired "
          f"({', '.join(k for k, v in parts.items() if not v) or 'every part'} "
          f"{'failed' if not all(parts.values()) else 'held'})",
          counters(g.a))


def threads():
    force_verdict(True)
    ref, g = pair()
    errors = []

    def worker(seed):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        try:
            with torch.no_grad():
                for _ in range(15):
                    x = torch.randn(8, 64, device=DEV, generator=gen)
                    if not torch.equal(g(x), ref(x)):
                        errors.append("mismatch")
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    check(not errors and plain(g.a), "4 threads through the trial and retirement: eager-equal",
          f"{errors[:2]} {counters(g.a)}")


for name, fn in [("retired_basic", retired_basic), ("kept_basic", kept_basic),
                 ("pending_backward", pending_backward), ("threads", threads)]:
    guarded(name, fn)
