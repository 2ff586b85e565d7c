"""[control] lines of the second swap review (tests/test_review_swap2.py controls)."""
from common import DEV, check, grads_equal, nn, randn, stats, sync, torch, twins

SWAP = torch._C._swap_tensor_impl


class BufferPingPong(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("front", torch.zeros(16))
        self.register_buffer("back", torch.ones(16))

    def forward(self, x):
        torch.utils.swap_tensors(self.front, self.back)
        self.front.add_(1)
        return self.lin(x) * self.front


def ping_pong(iters, grad):
    def run():
        ref, g = twins(BufferPingPong, num_warmup_iters=iters)
        for i in range(3):
            x = randn(4, 16)
            with torch.set_grad_enabled(grad):
                want, got = ref(x), g(x)
                if grad:
                    want.sum().backward()
                    got.sum().backward()
            sync()
            if not torch.equal(want, got):
                return f"call {i}: outputs differ; {stats(g)}"
            for n in ("front", "back"):
                r, t = getattr(ref, n), getattr(g, n)
                if not torch.equal(r, t) or r._version != t._version:
                    return f"call {i}: {n} differs (versions {r._version}, {t._version})"
            if grad and grads_equal(ref, g):
                return f"call {i}: {grads_equal(ref, g)}"
        if torch._C._swap_tensor_impl is not SWAP:
            return "torch._C._swap_tensor_impl left patched"
        return None
    return run


for iters in (1, 3):
    for grad in (False, True):
        check(f"[control] buffer ping-pong, num_warmup_iters={iters}, grad={grad}: outputs, "
              "buffers, versions and gradients as eager's", ping_pong(iters, grad))
