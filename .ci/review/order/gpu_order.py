"""GPU review of 303c3a0 (recaptures "in a row") and 0c8b53c (one function-piece copy per call
index in a root's run). Plain python; prints ``PASS name`` / ``FAIL name`` (and ``INFO``
lines with counters). Every output is compared with an eager twin bitwise (torch.equal).

The CPU double never reuses memory; here a released graph's memory really goes back to the
region's pool, so these are the same scenarios as tests/test_review_order.py with real
memory reuse: recapture churn while aliases and views are held, function copies called from
other call sites, concurrent runs.

Run from the repository root: ``PYTHONPATH=. python .ci/review/order/gpu_order.py``
"""

from __future__ import annotations

import copy
import os
import random
import sys
import threading
import traceback
import types
import warnings

import torch
from torch import nn

import cudagraphify as cg
from cudagraphify import _engine, _funcpieces

warnings.simplefilter("ignore")
# (CG_REVIEW_SIM=1: a dry run of this script's logic on the CPU with tests/conftest.py's
# simulated backend; the numbers mean nothing there)
SIM = os.environ.get("CG_REVIEW_SIM") == "1"
DEV = "cpu" if SIM else "cuda"
if SIM:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))
    from conftest import SimBackend
    from cudagraphify import _capture
    _capture.set_backend(SimBackend())


def sync():
    if not SIM:
        torch.cuda.synchronize()
RESULTS: list[tuple[str, bool]] = []


def check(name):
    def deco(fn):
        try:
            fn()
            ok = True
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            ok = False
        sync()
        RESULTS.append((name, ok))
        print(("PASS " if ok else "FAIL ") + name, flush=True)
        return fn
    return deco


def twin(m):
    m = m.to(DEV)
    return m, cg.graphify(copy.deepcopy(m))


def eq(a, b, what):
    if not torch.equal(a, b):
        raise AssertionError(f"{what}: max diff {(a.float() - b.float()).abs().max().item()}")


# -- 303c3a0 ---------------------------------------------------------------------------------

def ping_pong(steps, extra, d=256):
    torch.manual_seed(0)
    rf, gf = twin(nn.Linear(d, d))
    rg, gg = twin(nn.Linear(d, d))
    kept = []
    with torch.no_grad(), cg.graph_region():
        vb = rvb = None
        for t in range(steps):
            x, y = torch.randn(64, d, device=DEV), torch.randn(64, d, device=DEV)
            a, ra = gf(x), rf(x)
            if vb is not None:
                eq(vb, rvb, f"vb {t}")
            va, rva = a[:8], ra[:8]
            if t % 9 == 0:
                kept.append((a, ra))  # full alias kept: moved to a copy before an overwrite
            del vb, a
            b, rb = gg(y), rg(y)
            eq(b, rb, f"b {t}")
            eq(va, rva, f"va {t}")
            vb, rvb = b[:8], rb[:8]
            del va, b
            for _ in range(extra):
                z = torch.randn(32, d, device=DEV)
                eq(gf(z), rf(z), f"fz {t}")
                z = torch.randn(32, d, device=DEV)
                eq(gg(z), rg(z), f"gz {t}")
            for got, want in kept:
                eq(got, want, f"kept {t}")
    return cg.stats(gf), cg.stats(gg)


@check("ping_pong_alone_values")
def _():
    sf, sg = ping_pong(120, 0)
    print(f"INFO ping_pong_alone captures F={sf.captures} G={sg.captures} "
          f"(bound {1 + _engine._MAX_RECAPTURES})")


@check("ping_pong_with_other_replays_values")
def _():
    sf, sg = ping_pong(120, 8)
    print(f"INFO ping_pong_with_other_replays captures F={sf.captures} G={sg.captures} "
          f"replays F={sf.replays} eager F={sum(sf.eager_calls.values())} "
          f"G={sum(sg.eager_calls.values())} (R1: CPU double 36/36; 303c3a0^ 6/6)")


@check("recapture_after_reassignment_with_kept_aliases")
def _():
    torch.manual_seed(0)
    d = 256
    rf, gf = twin(nn.Linear(d, d))
    rg, gg = twin(nn.Linear(d, d))
    kept, views = [], []
    with torch.no_grad(), cg.graph_region():
        for t in range(240):
            if t % 40 == 20:
                w = torch.randn(d, d, device=DEV)
                rg.weight, gg.weight = nn.Parameter(w.clone()), nn.Parameter(w.clone())
            x = torch.randn(64, d, device=DEV)
            a, ra = gf(x), rf(x)
            b, rb = gg(a), rg(ra)
            eq(a, ra, f"a {t}")
            eq(b, rb, f"b {t}")
            for got, want in views:
                eq(got, want, f"view {t}")
            views = views[-1:] + [(b[:8], rb[:8])]
            if t % 5 == 0:
                kept += [(a, ra), (b, rb)]
            del a, b
            if t % 20 == 19:
                for got, want in kept:
                    eq(got, want, f"kept {t}")
    s = cg.stats(gf)
    print(f"INFO reassignment F captures={s.captures} replays={s.replays}")


# -- 0c8b53c ---------------------------------------------------------------------------------

NAME = "transformers.models.cg_review_order_gpu.modeling_cg_review_order_gpu"


class Cache:
    def __init__(self, skip=(), twice=(), fail_at=None, keep=False, calls=1, hook=None):
        self.skip, self.twice, self.fail_at, self.keep, self.calls = set(skip), set(twice), \
            fail_at, keep, calls
        self.hook = hook
        self.kept = []


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotary(q, k, cos, sin):
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


SRC = '''
class Attn(nn.Module):
    def __init__(self, i, d):
        super().__init__()
        self.i = i
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x, cos, sin, cache):
        if self.i == cache.fail_at:
            raise RuntimeError("boom")
        q, k = self.q(x), self.k(x)
        for _ in range(cache.calls):
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if self.i in cache.twice:
            q, k = apply_rotary_pos_emb(q, k, sin, cos)
        if cache.hook is not None:
            cache.hook(self.i)
        if cache.keep:
            cache.kept.append((q, k[:, :3]))
        return self.o(q + k)


class Model(nn.Module):
    def __init__(self, n, d):
        super().__init__()
        self.layers = nn.ModuleList(Attn(i, d) for i in range(n))
        self.norm = nn.LayerNorm(d)

    def forward(self, x, cos, sin, cache):
        for layer in self.layers:
            if layer.i in cache.skip:
                continue
            x = x + layer(self.norm(x), cos, sin, cache)
        return x
'''

mod = types.ModuleType(NAME)
mod.torch, mod.nn = torch, nn
mod.apply_rotary_pos_emb = _rotary
exec(compile(SRC, f"<{NAME}>", "exec"), mod.__dict__)
mod.Attn.__module__ = mod.Model.__module__ = NAME
sys.modules[NAME] = mod
D = 128


def models(n):
    torch.manual_seed(0)
    ref = mod.Model(n, D).eval().to(DEV)
    return ref, cg.graphify(copy.deepcopy(ref))


def inputs(seed, rows=16):
    """x, cos, sin (a rotation: 80 calls in a row stay finite)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(rows, D, device=DEV, generator=g)
    theta = torch.randn(rows, D // 2, device=DEV, generator=g)
    theta = torch.cat([theta, theta], dim=-1)
    return [x, theta.cos(), theta.sin()]


def step(ref, g, seed, rows=16, **kw):
    x, cos, sin = inputs(seed, rows)
    cr, cgr = Cache(**kw), Cache(**kw)
    with torch.no_grad():
        want = ref(x, cos, sin, cr)
        got = g(x, cos, sin, cgr)
    eq(got, want, f"step {seed}")
    return cr, cgr


def copies(g):
    chain = g._cudagraphify_state._chain
    calls = getattr(mod.apply_rotary_pos_emb, _funcpieces._ATTR).get(chain)
    return [x._self_dispatch.state for x in calls.graphed] if calls is not None else []


def info(name, g):
    st = [s.stats() for s in copies(g)]
    print(f"INFO {name} copies={len(st)} captures={sum(s.captures for s in st)} "
          f"replays={sum(s.replays for s in st)} "
          f"eager={sum(sum(s.eager_calls.values()) for s in st)} "
          f"moved={g._cudagraphify_state._chain.moved_outputs}")


@check("fn_skips_and_repeats")
def _():
    ref, g = models(6)
    rnd = random.Random(0)
    for t in range(80):
        skip = {i for i in range(6) if rnd.random() < 0.3}
        twice = {i for i in range(6) if rnd.random() < 0.2}
        step(ref, g, t, rows=16 if t % 4 else 24, skip=skip, twice=twice)
    info("fn_skips_and_repeats", g)


@check("fn_raise_midway")
def _():
    ref, g = models(3)
    for t in range(30):
        if t % 3 == 1:
            x, cos, sin = inputs(t)
            try:
                with torch.no_grad():
                    g(x, cos, sin, Cache(fail_at=1))
            except RuntimeError:
                pass
            else:
                raise AssertionError("no raise")
        else:
            step(ref, g, t)
    info("fn_raise_midway", g)


@check("fn_kept_outputs_and_views")
def _():
    ref, g = models(3)
    kept = []
    for t in range(30):
        kept.append(step(ref, g, t, keep=True, twice={t % 3}))
        for a, b in kept:
            for (q1, k1), (q2, k2) in zip(a.kept, b.kept):
                eq(q2, q1, f"kept q {t}")
                eq(k2, k1, f"kept k {t}")
    info("fn_kept_outputs_and_views", g)


@check("fn_kept_outputs_only")
def _():
    # outputs kept without views: moved to copies at the run's end (release_aliases)
    ref, g = models(3)
    kept = []
    for t in range(30):
        x, cos, sin = inputs(t)
        cr, cgr = Cache(twice={t % 3}), Cache(twice={t % 3})
        with torch.no_grad():
            want = ref(x, cos, sin, cr)
            got = g(x, cos, sin, cgr)
        eq(got, want, f"out {t}")
        kept.append((got, want))
        for a, b in kept:
            eq(a, b, f"kept {t}")
    info("fn_kept_outputs_only", g)


@check("fn_more_calls_than_cap")
def _():
    ref, g = models(2)
    for t in range(6):
        step(ref, g, t, calls=40)
    info("fn_more_calls_than_cap", g)


@check("fn_threads")
def _():
    ref, g = models(4)
    for t in range(4):
        step(ref, g, t)
    errors = []

    def work(k):
        try:
            for t in range(40):
                x, cos, sin = inputs(100 * k + t)
                with torch.no_grad():
                    got = g(x, cos, sin, Cache(twice={t % 4}, skip={(t + k) % 5}))
                    want = ref(x, cos, sin, Cache(twice={t % 4}, skip={(t + k) % 5}))
                sync()
                if not torch.equal(got, want):
                    errors.append((k, t))
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))
    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise AssertionError(errors[:5])
    info("fn_threads", g)


@check("fn_threads_own_streams")
def _():
    if SIM:
        return
    ref, g = models(4)
    for t in range(4):
        step(ref, g, t)
    errors = []

    def work(k):
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for t in range(40):
                    x, cos, sin = inputs(200 * k + t)
                    with torch.no_grad():
                        got = g(x, cos, sin, Cache(twice={t % 4}))
                        want = ref(x, cos, sin, Cache(twice={t % 4}))
                    s.synchronize()
                    if not torch.equal(got, want):
                        errors.append((k, t))
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))
    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise AssertionError(errors[:5])
    info("fn_threads_own_streams", g)


@check("hf_llama_early_exit_dynamic_cache")
def _():
    import transformers
    from transformers import DynamicCache
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256,
                                      pad_token_id=0)
    ref = transformers.LlamaForCausalLM(config).eval().to(DEV)
    g = cg.graphify(copy.deepcopy(ref))
    with torch.no_grad():
        for n in range(4):
            ref.model.config.num_hidden_layers = g.model.config.num_hidden_layers = 4
            rc, c = DynamicCache(config=ref.config), DynamicCache(config=ref.config)
            x = torch.randint(1, 256, (1, 5 + n % 2), device=DEV,
                              generator=torch.Generator(device=DEV).manual_seed(n))
            for t in range(12):
                k = [4, 2, 3, 4, 1][t % 5] if n else 4
                ref.model.config.num_hidden_layers = g.model.config.num_hidden_layers = k
                want = ref(x, past_key_values=rc, use_cache=True).logits
                got = g(x, past_key_values=c, use_cache=True).logits
                eq(got, want, f"logits {n} {t}")
                x = want[:, -1:].argmax(-1)
        ref.model.config.num_hidden_layers = g.model.config.num_hidden_layers = 4
        ids = torch.randint(1, 256, (2, 7), device=DEV, generator=torch.Generator(
            device=DEV).manual_seed(9))
        kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
        for _ in range(3):
            want = ref.generate(ids, past_key_values=DynamicCache(config=ref.config),
                                disable_compile=True, **kw)
            got = g.generate(ids, past_key_values=DynamicCache(config=ref.config), **kw)
            eq(got, want, "generate")
    s = cg.stats(g)
    print(f"INFO hf_llama captures={s.captures} replays={s.replays}")


fails = [n for n, ok in RESULTS if not ok]
print(f"SUMMARY {len(RESULTS) - len(fails)}/{len(RESULTS)} passed" +
      (f"; failed: {', '.join(fails)}" if fails else ""))
sys.exit(1 if fails else 0)
