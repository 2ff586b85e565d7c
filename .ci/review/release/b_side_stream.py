"""A forward that runs its pieces on a side stream of its own: MULTI_STREAM for good.

_chain_run enters the run with the caller's current stream (enter_run); a forward that switches
to a stream of its own (``with torch.cuda.stream(self.side)``, to overlap work) replays its
pieces there, so exit_run finds that another stream replayed last: the region's last stream
becomes MULTI_STREAM. order_before_replay sets it back only where no running thread is on
another stream, and the thread's own entry (the caller's stream) is one: it stays MULTI, one
thread, for every later call. Every piece's replay misses the fast path and waits on the
caller's stream first.

- [finding] after warm-up, one thread: the region's last stream is not MULTI_STREAM and at
  most 2 cross-stream orders are made per call (2*L pieces; at 8b11f19: none).
- [control] every output bitwise eager's.
- INFO: time per call with the side stream vs the same model on the caller's stream.
On the CPU double (no streams) the finding passes by construction.
CPU reproduction: tests/test_review_release.py::
test_finding_a_forward_on_a_side_stream_stays_multi_stream_for_good."""

import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _capture
from cudagraphify._capture import MULTI_STREAM
from common import CPU, DEV, check, finish, info, sync, timed

W, N, L, CALLS = (32, 8, 4, 20) if CPU else (256, 64, 8, 300)

ORDERS = [0]
_backend = _capture.default_backend()
_order_after = _backend.order_after


def _counted(device, token):
    ORDERS[0] += 1
    return _order_after(device, token)


_backend.order_after = _counted


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(W)
        self.mlp = nn.Sequential(nn.Linear(W, W), nn.GELU(), nn.Linear(W, W))

    def forward(self, x):
        h = self.norm(x)
        if bool((h > 1e9).any()):  # a host sync: piecewise
            raise AssertionError
        return x + self.mlp(h)


class Model(nn.Module):
    def __init__(self, side: bool):
        super().__init__()
        self.layers = nn.ModuleList([Layer() for _ in range(L)])
        self.side = torch.cuda.Stream() if side and not CPU else None

    def forward(self, x):
        if self.side is None:
            return self.body(x)
        cur = torch.cuda.current_stream()
        self.side.wait_stream(cur)
        with torch.cuda.stream(self.side):
            out = self.body(x)
        cur.wait_stream(self.side)
        out.record_stream(cur)
        return out

    def body(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def run(side: bool):
    torch.manual_seed(0)
    ref = Model(False).to(DEV)
    m = Model(side).to(DEV)
    m.load_state_dict(ref.state_dict())
    g = cg.graphify(m)
    ok = True
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(N, W, device=DEV)
            ok = ok and torch.equal(g(x), ref(x))
        sync()
        ORDERS[0] = 0
        xs = [torch.randn(N, W, device=DEV) for _ in range(CALLS)]
        outs = []
        t = timed(lambda: outs.append(g(xs[len(outs)])), CALLS)
        orders = ORDERS[0]
        for x, y in zip(xs, outs):
            ok = ok and torch.equal(y, ref(x))
    token = g._cudagraphify_state._chain._stream_token
    return ok, t, orders, token


def main():
    info(f"DEV={DEV} W={W} N={N} L={L} calls={CALLS}" +
         (" (no streams here: the finding passes by construction)" if CPU else ""))
    ok0, t0, orders0, token0 = run(side=False)
    ok1, t1, orders1, token1 = run(side=True)
    # (a fix may order the two streams once each per call: 2 per call; stuck in MULTI_STREAM,
    # each of the 2*L pieces' replays is ordered and slow)
    check(token1 != MULTI_STREAM and orders1 <= 2 * CALLS,
          "[finding] one thread, pieces replayed on the forward's side stream: the region's "
          "last stream leaves MULTI_STREAM, at most 2 cross-stream orders per call",
          f"last stream={'MULTI_STREAM' if token1 == MULTI_STREAM else token1} "
          f"order_after calls={orders1} in {CALLS} calls")
    check(ok0 and ok1, "[control] every output bitwise eager's", f"caller's stream={ok0} "
          f"side stream={ok1}")
    info(f"per call: caller's stream {t0 * 1e6:.0f} us (orders {orders0}), side stream "
         f"{t1 * 1e6:.0f} us")
    finish()


if __name__ == "__main__":
    main()
