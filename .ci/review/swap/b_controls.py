"""[control] lines of the swap review (tests/test_review_swap.py controls): expected PASS."""
from common import DEV, check, cg, nn, randn, stats, sync, torch, twins

_SWAP = torch._C._swap_tensor_impl
_G = {}


def clean():
    return None if torch._C._swap_tensor_impl is _SWAP else "torch._C._swap_tensor_impl still patched"


class ToInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        self.to(x.dtype)
        return torch.relu(self.lin(x)) * 2


def apply_swap(probe, grad):
    def go():
        old = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            ref, g = twins(ToInForward, probe=probe)
            ids = [id(p) for p in g.parameters()]
            for i in range(4):
                x = randn(4, 16)
                with torch.set_grad_enabled(grad):
                    a, b = ref(x), g(x)
                    if grad:
                        a.sum().backward()
                        b.sum().backward()
                sync()
                if not torch.equal(a, b):
                    return f"call {i}: outputs differ; {stats(g)}"
                if [id(p) for p in g.parameters()] != ids:
                    return f"call {i}: parameter objects replaced"
                for p, q in zip(ref.parameters(), g.parameters()):
                    if not torch.equal(p, q):
                        return f"call {i}: parameters differ"
                    if grad and not torch.equal(p.grad, q.grad):
                        return f"call {i}: gradients differ"
            return clean()
        finally:
            torch.__future__.set_swap_module_params_on_conversion(old)
    return go


for probe in ("auto", False):
    for grad in (False, True):
        check(f"[control] self.to(x.dtype) in forward with swap_module_params_on_conversion "
              f"(probe={probe}, {'grad' if grad else 'no_grad'}): outputs, parameters, grads",
              apply_swap(probe, grad))


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        _G[id(self)] = torch.zeros(16, device=DEV)

    def forward(self, x):
        h = self.lin(x)
        t = _G[id(self)]
        torch.utils.swap_tensors(t, (h[0] * 2).detach().clone())
        torch.utils.swap_tensors(t, t)
        torch.utils.swap_tensors(t, (h[1] * 2).detach().clone())
        return h * 3


def twice(probe, iters):
    def go():
        ref, g = twins(Twice, probe=probe, num_warmup_iters=iters)
        for m in (ref, g):
            _G[id(m)] = torch.zeros(16, device=DEV)
        for i in range(3):
            x = randn(4, 16)
            with torch.no_grad():
                a, b = ref(x), g(x)
            sync()
            if not torch.equal(a, b):
                return f"call {i}: outputs differ; {stats(g)}"
            if not torch.equal(_G[id(ref)], _G[id(g)]):
                return f"call {i}: the global differs; {stats(g)}"
        return clean()
    return go


for probe in ("auto", False):
    for iters in (1, 3):
        check(f"[control] a global swapped twice and with itself on every call (probe={probe}, "
              f"num_warmup_iters={iters}): outputs and global", twice(probe, iters))
