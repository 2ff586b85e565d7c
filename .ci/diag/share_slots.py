"""#18's share_graph on HF Llama: which kernel-argument slots differ between the template's
captures and each layer's, with where each value lies in this process's memory map (the
README's byte-176 question: what the mean reduction's struct tail holds, layer by layer).
Prints, for every plan_rebase call (template vs partner, each layer's own proof): the node,
byte, the values (template, other, template again) and their /proc/self/maps mappings;
"(unread)" where _unread.unread_bytes finds that the kernel never reads those bytes. With
$OUT set, the first diff's whole arguments of the elementwise and cat kernels go to
$OUT/share_args.txt (hex), for the layouts of the next recognisers."""
import bisect
import os

import torch

import cudagraphify as cg
from cudagraphify import _graphdiff, _share
from cudagraphify._unread import unread_bytes
from cudagraphify.bench.sections import _hf_model


def mappings():
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            lo, _, hi = fields[0].partition("-")
            out.append((int(lo, 16), int(hi, 16), fields[5].strip() if len(fields) == 6
                        else "[anon]"))
    return out


def where(v, maps):
    starts = [m[0] for m in maps]
    i = bisect.bisect_right(starts, v) - 1
    if i >= 0 and maps[i][0] <= v < maps[i][1]:
        return maps[i][2].rsplit("/", 1)[-1][:30]
    return "-"


orig = _graphdiff.plan_rebase
# the whole arguments of these kernels (template and partner) go to $OUT/share_args.txt: the
# layouts the next recognisers need (elementwise lambdas' offset calculators, cat's metadata)
DUMP = os.path.join(os.environ["OUT"], "share_args.txt") if os.environ.get("OUT") else None
DUMP_KERNELS = ("18elementwise_kernel", "CatArrayBatchedCopy", "unrolled_elementwise_kernel",
                "vectorized_elementwise_kernel")
n = [0]


def traced(nodes0, nodes1, e0, e1, a, b, pool, again=None, *rest, **kw):
    n[0] += 1
    maps = mappings()
    print(f"-- plan_rebase #{n[0]}", flush=True)
    for i, (x0, x1) in enumerate(zip(nodes0, nodes1)):
        for c, (p, q) in enumerate(zip(x0.chunks, x1.chunks)):
            if p == q and (again is None or again[i].chunks[c] == p):
                continue
            z = again[i].chunks[c] if again is not None else p
            unread = unread_bytes(x0, c, [p, q, z])
            for pos in range(0, len(p), 8):
                w0, w1, w2 = p[pos:pos + 8], q[pos:pos + 8], z[pos:pos + 8]
                if w0 == w1 == w2:
                    continue
                v0, v1, v2 = (int.from_bytes(w, "little") for w in (w0, w1, w2))
                diff = {pos + k for k in range(len(w0)) if len({w0[k], w1[k], w2[k]}) > 1}
                print(f"  node {i} {x0.name[:50]} arg {c} ({len(p)} bytes) byte {pos}: "
                      f"{v0:#x} [{where(v0, maps)}] vs {v1:#x} [{where(v1, maps)}] again "
                      f"{v2:#x}{' (unread)' if diff <= unread else ''}", flush=True)
    if n[0] == 1 and DUMP:  # the first diff's arguments of the kernels named, whole, as hex
        with open(DUMP, "a") as f:
            for i, (x0, x1) in enumerate(zip(nodes0, nodes1)):
                if any(k in x0.name for k in DUMP_KERNELS):
                    for c, (p, q) in enumerate(zip(x0.chunks, x1.chunks)):
                        f.write(f"node {i} arg {c} {x0.name}\n  a {p.hex()}\n  b {q.hex()}\n")
    try:
        return orig(nodes0, nodes1, e0, e1, a, b, pool, again, *rest, **kw)
    except Exception as e:
        print(f"  refused: {str(e)[:200]}", flush=True)
        raise


_graphdiff.plan_rebase = traced
_share.plan_rebase = traced
model, layers_of = _hf_model("llama", 8)
ids = torch.randint(0, 32000, (1, 16), device="cuda")
with torch.no_grad():
    want = model(input_ids=ids, use_cache=False).logits
    group = cg.share_graph(layers_of(model))
    for _ in range(3):
        got = model(input_ids=ids, use_cache=False).logits
    s = group.stats()
    print("equal", torch.equal(got, want), "retargets", s.retargets, "per_layer", s.per_layer,
          "reasons", list(s.reasons)[:3])
