"""Controls (expected PASS on d62294e and after): two training graphs of one signature in flight
on a GPU, each with its own pool. Outputs compared with eager bitwise (the forward graph runs
eager's kernels), gradients within TOL (a graphed backward may differ by an ulp)."""
from common import (DEV, PENDING, SIM, cg, check, gpt, grads_close, mlp, pair, pending_calls,
                    torch)


def accumulate(make, micro, steps=5, none=True, opt="sgd", shapes=None, autocast=False):
    ref, g = pair(make)
    mk = (lambda ps: torch.optim.AdamW(ps, lr=1e-3)) if opt == "adamw" else \
        (lambda ps: torch.optim.SGD(ps, lr=0.05))
    og, orf = mk(g.parameters()), mk(ref.parameters())
    gen = torch.Generator(device=DEV).manual_seed(1)
    dim = 256 if make is gpt else 64
    for step in range(steps):
        lg = lr = 0
        for k in range(micro):
            n = shapes[k % len(shapes)] if shapes else 2
            x = torch.randn((n, 8, dim) if make is gpt else (n * 8, dim), device=DEV,
                            generator=gen)
            with torch.autocast(DEV.type, dtype=torch.bfloat16, enabled=autocast):
                o, w = g(x), ref(x)
            if not torch.equal(o, w):
                return f"step {step} micro {k}: output differs from eager"
            lg, lr = lg + o.float().square().mean(), lr + w.float().square().mean()
        lg.backward(), lr.backward()
        bad = grads_close(g, ref) if not autocast else None
        if autocast:
            for p, q in zip(g.parameters(), ref.parameters()):
                if not torch.allclose(p.grad, q.grad, rtol=1e-2, atol=1e-3):
                    bad = "autocast gradient differs"
        if bad:
            return f"step {step}: {bad}"
        og.step(), orf.step(), og.zero_grad(set_to_none=none), orf.zero_grad(set_to_none=none)
    s = cg.stats(g)
    want = 2 * len(set(shapes or [2]))
    if s.captures != want:
        return f"captures {s.captures}, expected {want}: {s.eager_calls}"
    return None


for make in (mlp, gpt):
    for micro in (2, 3):
        for none in (True, False):
            check(f"accumulation {make.__name__} micro={micro} set_to_none={none}",
                  lambda: accumulate(make, micro, none=none,
                                     opt="adamw" if make is gpt else "sgd"))
check("accumulation mixed shapes a,b,a,b (gpt)",
      lambda: accumulate(gpt, 4, shapes=[2, 3]))
if not SIM:
    check("accumulation under bf16 autocast (mlp)", lambda: accumulate(mlp, 2, autocast=True))


def separate_backwards(order, none):
    ref, g = pair(mlp)
    og = torch.optim.SGD(g.parameters(), lr=0.05)
    orf = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(5):
        # (each step from the same weights: a graphed backward's gradients differ from eager's
        # by an ulp, and this sum loss with lr 0.05 amplifies that through the SGD steps, with
        # one graph in flight as with two: .ci/diag/inflight_grads.py on the H100)
        with torch.no_grad():
            for p, q in zip(g.parameters(), ref.parameters()):
                q.copy_(p)
        xs = [torch.randn(16, 64, device=DEV) for _ in range(2)]
        outs, wants = [g(x) for x in xs], [ref(x) for x in xs]
        for i in order:
            outs[i].sum().backward(), wants[i].sum().backward()
            bad = grads_close(g, ref)
            if bad:
                return f"step {step} after backward {i}: {bad}"
        og.step(), orf.step(), og.zero_grad(set_to_none=none), orf.zero_grad(set_to_none=none)
    return None


for order in ((0, 1), (1, 0)):
    for none in (True, False):
        check(f"two forwards, backwards one by one order={order} set_to_none={none}",
              lambda: separate_backwards(order, none))


def memory_pressure():
    # A's activations must survive B's capture and replays and a burst of eager allocations
    # (each graph has its own pool): compare the gradients of each call with eager's
    ref, g = pair(gpt)
    for step in range(4):
        xs = [torch.randn(2, 8, 256, device=DEV) for _ in range(2)]
        a, b = g(xs[0]), g(xs[1])
        junk = [torch.full((1 << 20,), float(i), device=DEV) for i in range(32)]
        c = g(torch.randn(2, 8, 256, device=DEV)).detach()  # (third: eager while both wait)
        del junk, c
        a.square().mean().backward()
        ra = ref(xs[0]).square().mean()
        ra.backward()
        bad = grads_close(g, ref)
        if bad:
            return f"step {step} after the first backward: {bad}"
        b.square().mean().backward()
        ref(xs[1]).square().mean().backward()
        bad = grads_close(g, ref)
        if bad:
            return f"step {step} after the second backward: {bad}"
        g.zero_grad(), ref.zero_grad()
    return None


check("A's activations survive B's replay and eager allocations (gpt)", memory_pressure)


def kept_forever():
    # an output kept and never backpropagated: the second graph serves; memory stays flat
    ref, g = pair(mlp)
    x = torch.randn(16, 64, device=DEV)
    g(x)
    kept = g(x)  # noqa: F841 - the first graph waits for good
    mem = []
    for step in range(8):
        o = g(x)
        o.sum().backward()
        ref(x).sum().backward()
        bad = grads_close(g, ref)
        if bad:
            return f"step {step}: {bad}"
        g.zero_grad(), ref.zero_grad()
        del o
        if not SIM:
            torch.cuda.synchronize()
            mem.append(torch.cuda.memory_allocated())
    if mem and len(set(mem[3:])) != 1:
        return f"memory_allocated moves: {mem}"
    s = cg.stats(g)
    if s.captures != 2 or pending_calls(g):
        return f"{s.captures} captures, {pending_calls(g)} pending-eager calls"
    return None


check("an output kept forever: the second graph serves, memory flat", kept_forever)


def hooks_and_grad():
    ref, g = pair(mlp)
    seen_g, seen_r = {}, {}
    for i, p in enumerate(g.parameters()):
        p.register_hook(lambda t, i=i: seen_g.setdefault(i, []).append(t.clone()))
    for i, p in enumerate(ref.parameters()):
        p.register_hook(lambda t, i=i: seen_r.setdefault(i, []).append(t.clone()))
    for step in range(4):
        xs = [torch.randn(16, 64, device=DEV, requires_grad=True) for _ in range(2)]
        xr = [x.detach().clone().requires_grad_() for x in xs]
        lg = sum(g(x).sum() for x in xs)
        lr = sum(ref(x).sum() for x in xr)
        gg = torch.autograd.grad(lg, xs, retain_graph=False)
        gr = torch.autograd.grad(lr, xr)
        for a, b in zip(gg, gr):
            if not torch.allclose(a, b, rtol=2e-5, atol=2e-6):
                return f"step {step}: input gradient differs"
        lg = sum(g(x).sum() for x in xs)
        lr = sum(ref(x).sum() for x in xr)
        lg.backward(), lr.backward()
        bad = grads_close(g, ref)
        if bad:
            return f"step {step}: {bad}"
        g.zero_grad(), ref.zero_grad()
    for i in seen_r:
        if len(seen_g.get(i, [])) != len(seen_r[i]):
            return f"param {i}: hook ran {len(seen_g.get(i, []))} times, eager {len(seen_r[i])}"
        for a, b in zip(seen_g[i], seen_r[i]):
            if not torch.allclose(a, b, rtol=2e-5, atol=2e-6):
                return f"param {i}: hook saw another gradient"
    return None


check("parameter hooks and torch.autograd.grad with two graphs in flight", hooks_and_grad)


def step_between():
    # an optimizer step between the two backwards: eager raises (saved weights changed in
    # place); so must the graphed run
    res = []
    for model in pair(mlp):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x = torch.randn(16, 64, device=DEV)
        model(x).sum().backward()  # (the graphed one's first call)
        a, b = model(x), model(x)
        a.sum().backward()
        opt.step()
        try:
            b.sum().backward()
            res.append("no error")
        except RuntimeError as e:
            res.append("inplace" if "inplace" in str(e) else str(e)[:80])
    return None if res[0] == res[1] == "inplace" else f"eager: {res[0]}, graphed: {res[1]}"


check("optimizer step between the two backwards raises as eager", step_between)
