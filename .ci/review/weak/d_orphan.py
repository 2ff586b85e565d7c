"""1d05912 makes a shared policy's entries orphaned far more often (a deleted module no longer
lives on through its guards' reads): an orphaned entry is dropped by the next lookup of its
key (GraphedState._call: ``cache.discard(entry)``, cudagraphify/_engine.py:298 at 1ebb457)
and released at once, without draining the stream that replayed it last (``release`` and
``invalidate``, a region's ``_release`` and the recapture path drain first). Its static input
buffers were allocated on the capturing call's stream: the allocator may hand them to the next
allocation on that stream while another module's replay of that graph, queued on its own
stream, still copies its input into them.

[suspicion] (FAIL = reproduced): a shared policy; module a captures key K; module d captures K
under other flags (a second entry); b (a copy of a) replays a's graph on stream s_b behind a
long ``torch.cuda._sleep``; a is deleted; c calls K on the default stream (drops a's orphaned
entry, replays d's); the caller then allocates tensors of the static input's size on the
default stream and fills them with 7: all still 7 once everything is done, and every output
bitwise eager's. On the CPU double there are no streams (a smoke test)."""
import copy
import gc

import torch
from torch import nn

import cudagraphify as cg
from common import CPU, DEV, check, finish, info, sync

W, B = 512, 2


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.scale = 0.5

    def forward(self, x):
        return self.lin(x) * self.scale


def main():
    info(f"DEV={DEV}")
    policy = cg.CachePolicy(max_graphs=8, shared=True)
    torch.manual_seed(0)
    ref = Scaled().to(DEV)
    bad = 0
    with torch.no_grad():
        a = cg.graphify(copy.deepcopy(ref), cache_policy=policy)
        x = torch.randn(B, W, device=DEV)
        bad += sum(not torch.equal(a(x), ref(x)) for _ in range(3))
        d = cg.graphify(copy.deepcopy(ref), cache_policy=policy)
        flag = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = not flag  # (other flags: d captures an entry of its own)
        bad += sum(not torch.equal(d(x), ref(x)) for _ in range(3))
        torch.backends.cudnn.benchmark = flag
        b = copy.deepcopy(a)  # (graphified with the same policy: replays a's graph)
        bad += not torch.equal(b(x), ref(x))
        entries = len(policy.new_cache().graphs())
        sync()
        s_b = None if CPU else torch.cuda.Stream()
        xb = torch.randn(B, W, device=DEV)
        want_b = ref(xb)
        sync()
        if CPU:
            out_b = b(xb)
        else:
            with torch.cuda.stream(s_b):
                torch.cuda._sleep(int(2e9))  # (about a second: b's replay stays queued)
                out_b = b(xb)
        del a
        gc.collect()
        torch.backends.cudnn.benchmark = not flag
        c = cg.graphify(copy.deepcopy(ref), cache_policy=policy)
        xc = torch.randn(B, W, device=DEV)
        out_c = c(xc)  # drops a's orphaned entry, replays d's
        torch.backends.cudnn.benchmark = flag
        junk = [torch.full((B, W), 7.0, device=DEV) for _ in range(32)]
        sync()
        corrupted = sum(not bool((t == 7.0).all()) for t in junk)
        bad_b = not torch.equal(out_b, want_b)
        bad_c = not torch.equal(out_c, ref(xc))
        s = cg.stats(c)
    info(f"entries under the key before: {entries}; c: captures={s.captures} "
         f"replays={s.replays}")
    check(bad == 0 and not bad_b and not bad_c and corrupted == 0,
          "[suspicion] a shared policy's orphaned entry dropped while another module's replay "
          "of it is queued on its own stream: no tensor allocated afterwards is overwritten",
          f"bad={bad} b's output differs={bad_b} c's output differs={bad_c} "
          f"tensors overwritten={corrupted} of {len(junk)}")
    finish()


if __name__ == "__main__":
    main()
