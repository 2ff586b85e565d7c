"""Findings of the third in-flight review: each line FAILs on 2653ffc (T2 PASSes on 2661480: a
regression of 2653ffc; T1, T3, T4 FAIL there too)."""
import copy

from common import DEV, PlainAcc, check, cg, fast_installed, first_calls, nn, outer_bn, \
    outcome, randn, same_acc, same_as_eager, torch, twins

# T1: wrong values for good
check("T1 an outside BatchNorm's running statistics (training)", outer_bn(True))


def fn_bn(requires_grad, warmups):
    def run():
        torch.manual_seed(0)
        ref = nn.BatchNorm1d(16, affine=False).to(DEV)
        gm = copy.deepcopy(ref)
        g = cg.graphify(lambda x: gm(x) * 2, num_warmup_iters=warmups)
        for s in range(3):
            x = randn(8, grad=requires_grad)
            x2 = x.detach().clone().requires_grad_(requires_grad)
            with torch.set_grad_enabled(requires_grad):
                a, b = ref(x) * 2, g(x2)
            if requires_grad:
                ra, rb = outcome(lambda: a.sum().backward()), outcome(lambda: b.sum().backward())
                if ra != rb:
                    return f"call {s}: eager {ra}, graphed {rb}"
            if not torch.allclose(ref.running_mean, gm.running_mean, rtol=2e-5, atol=2e-6):
                return f"call {s}: running_mean differs from eager's"
            if not torch.allclose(a, b, rtol=2e-5, atol=2e-6):
                return f"call {s}: outputs differ"
        return None
    return run


check("T1 a graphed function's BatchNorm, input requires grad", fn_bn(True, 1))
check("T1 a graphed function's BatchNorm, no_grad, num_warmup_iters=2", fn_bn(False, 2))
# T2: performance (regression)
check("T2 fast path: graphed function, probe=False", fast_installed(True, False))
# T3: silent where eager raises
for shapes in [(8, 8), (12, 8)]:
    check(f"T3 plain tensor attribute written and saved, twins {shapes}",
          lambda: same_as_eager(*twins(PlainAcc, warm=(8, 12)), shapes, extra=same_acc))
# T4: raise where eager does not; a transient wrong buffer
check("T4 a buffer only later calls write: the first call's backward", first_calls("tmp"))
check("T4 a buffer only later calls write: its value after the first call", first_calls("scale"))
