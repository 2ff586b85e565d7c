"""Op classification: every tag, from every source, on a CPU (CPU tensors stand for CUDA ones)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cudagraphify as cg
from cudagraphify._policy import OpPolicy, op_name

ACC = frozenset({"cuda", "cpu"})  # plan as if these CPU tensors were on the GPU
x = torch.randn(4, 4)
s0 = torch.randn(())
mask = x > 0
idx = torch.tensor([0, 2])
cpu_gen = torch.Generator()

SYNC, DYN, CPU_RNG, RNG = {"HOST_SYNC"}, {"DYNAMIC_SHAPE", "HOST_SYNC"}, {"CPU_RNG"}, {"RNG"}
CASES = [
    # Python protocol calls on device tensors: host syncs
    (torch.Tensor.item, (s0,), {}, SYNC),
    (torch.Tensor.tolist, (x,), {}, SYNC),
    (torch.Tensor.__bool__, (s0,), {}, SYNC),
    (torch.Tensor.__int__, (s0,), {}, SYNC),
    (torch.Tensor.__float__, (s0,), {}, SYNC),
    (torch.Tensor.__index__, (idx[0],), {}, SYNC),
    (torch.Tensor.__repr__, (x,), {}, SYNC),
    (torch.Tensor.__format__, (s0, ".2f"), {}, SYNC),
    (torch.Tensor.numpy, (x,), {}, SYNC),
    (torch.equal, (x, x), {}, SYNC),
    (torch.allclose, (x, x), {}, SYNC),
    (torch.is_nonzero, (s0,), {}, SYNC),
    # data-dependent output shapes
    (torch.nonzero, (x,), {}, DYN),
    (torch.Tensor.nonzero, (x,), {}, DYN),
    (torch.argwhere, (x,), {}, DYN),
    (torch.masked_select, (x, mask), {}, DYN),
    (torch.unique, (x,), {}, DYN),
    (torch.unique_consecutive, (x,), {}, DYN),
    (torch.bincount, (idx,), {}, DYN),
    (torch.where, (mask,), {}, DYN),
    (torch.repeat_interleave, (x, idx), {}, DYN),
    (torch.Tensor.__getitem__, (x, mask), {}, DYN),        # boolean-mask indexing
    (torch.Tensor.__setitem__, (x, mask, 0.0), {}, DYN),
    # ... but not their static forms
    (torch.Tensor.__getitem__, (x, idx), {}, set()),       # integer indexing
    (torch.repeat_interleave, (x, idx), {"output_size": 2}, set()),
    (torch.where, (mask, x, x), {}, set()),
    # random numbers: the default CUDA generator is graph-safe, CPU ones are not
    (F.dropout, (x, 0.1, True), {}, RNG),
    (F.dropout, (x, 0.1, False), {}, set()),               # eval: no randomness at all
    (torch.randn, (3,), {"device": "cuda"}, RNG),
    (torch.randn, (3,), {"generator": cpu_gen}, CPU_RNG),
    (torch.rand_like, (x,), {}, RNG),
    (torch.bernoulli, (x.sigmoid(),), {}, RNG),
    (torch.multinomial, (x.softmax(-1), 1), {}, RNG),
    (F.scaled_dot_product_attention, (x[None], x[None], x[None]), {}, set()),  # dropout_p=0
    (F.scaled_dot_product_attention, (x[None], x[None], x[None]), {"dropout_p": 0.1}, RNG),
    (F.scaled_dot_product_attention, (x[None], x[None], x[None], mask[None]), {}, set()),
    (F.scaled_dot_product_attention, (x[None], x[None], x[None], None, 0.1), {}, RNG),
    # host memory and copies between devices
    (torch.Tensor.pin_memory, (torch.zeros(2, device="meta"),), {}, {"HOST_ALLOC"}),
    (torch.empty, (4,), {"pin_memory": True}, {"HOST_ALLOC"}),
    (torch.Tensor.to, (x, "meta"), {}, {"CROSS_DEVICE", "HOST_SYNC"}),
    (torch.Tensor.to, (x, torch.float16), {}, set()),
    (torch.tensor, ([1.0, 2.0],), {"device": "cuda"}, {"CROSS_DEVICE"}),
    # no data: nothing copied to the device, nothing of the host's kept in a graph (an HF
    # DynamicLayer's first keys); data in a nested list, or a scalar, is copied
    (torch.tensor, ([],), {"device": "cuda", "dtype": torch.float16}, set()),
    (torch.tensor, ((),), {"device": "cuda"}, set()),
    (torch.as_tensor, ([],), {"device": "cuda"}, set()),
    (torch.tensor, ([[]],), {"device": "cuda"}, {"CROSS_DEVICE"}),
    (torch.tensor, (3.0,), {"device": "cuda"}, {"CROSS_DEVICE"}),
    # safe ordinary ops
    (torch.add, (x, x), {}, set()),
    (F.linear, (x, x), {}, set()),
    (F.layer_norm, (x, (4,)), {}, set()),
    (torch.Tensor.view, (x, 16), {}, set()),
    (torch.softmax, (x, -1), {}, set()),
]


@pytest.mark.parametrize("func,args,kwargs,want", CASES,
                         ids=[f"{i}-{op_name(c[0])}" for i, c in enumerate(CASES)])
def test_classification(func, args, kwargs, want):
    assert set(OpPolicy().tags(func, args, kwargs, accel=ACC)) == want


def test_cpu_tensors_of_a_gpu_module_are_not_syncs():
    # .item() of a genuinely CPU tensor inside a CUDA forward waits for nothing
    assert OpPolicy().tags(torch.Tensor.item, (s0,), {}) == frozenset()
    assert OpPolicy().tags(torch.randn, (3,), {}) == frozenset({"CPU_RNG"})


def test_user_tags_and_safe_override():
    my_op = torch.Tensor.tanh
    pol = OpPolicy()
    pol.tag_op(my_op, "HOST_SYNC")
    assert not pol.can_graph(my_op, pol.tags(my_op, (x,), {}, accel=ACC))
    assert OpPolicy().tags(my_op, (x,), {}, accel=ACC) == set()  # policies are independent
    pol.mark_safe(torch.Tensor.item)
    tags = pol.tags(torch.Tensor.item, (s0,), {}, accel=ACC)
    assert tags == {"SAFE"} and pol.can_graph(torch.Tensor.item, tags)
    with pytest.raises(cg.CudagraphifyUsageError, match="tag_op: unknown tag 'NOT_A_TAG'"):
        pol.tag_op(my_op, "NOT_A_TAG")
    with pytest.raises(cg.CudagraphifyUsageError, match="at least one tag.*mark_safe"):
        pol.tag_op(my_op)
    pol.tag_op("torch.cuda.synchronize", "SAFE")  # non-op calls are tagged by name
    pol.mark_safe("torch.cuda.synchronize")


def plain(t):
    return t


@pytest.mark.parametrize("call", ["tag_op", "mark_safe"])
@pytest.mark.parametrize("target, message", [
    # the probe never sees a Python function: refused, with the way out
    (plain, r"'plain' is a plain Python function: .*custom op"),
    (42, r"42 \(int\) is not a function, op or name: pass a torch function"),
    (None, r"None \(NoneType\) is not a function, op or name"),
    ("no.such.thing", r"'no.such.thing' is not the name of a call the probe wraps; names stand "
                      r"only for these non-op calls: torch.cuda.synchronize, .*pass the object "
                      r"itself"),
    ("torch.nonzero", r"'torch.nonzero' is not the name"),  # would never match the op
])
def test_tag_op_and_mark_safe_refuse_what_the_probe_never_sees(call, target, message):
    pol = OpPolicy()
    args = (target, "HOST_SYNC") if call == "tag_op" else (target,)
    with pytest.raises(cg.CudagraphifyUsageError, match=rf"{call}: {message}"):
        getattr(pol, call)(*args)
    with pytest.raises(cg.CudagraphifyError):
        getattr(cg, call)(*args)  # the public functions, on the default policy
    assert pol.overrides(target) is None  # nothing was recorded


def test_subclassed_policy_decides():
    class AllowRandomOnCpu(OpPolicy):
        def can_graph(self, func, tags):
            return super().can_graph(func, tags - {"CPU_RNG"})

    pol = AllowRandomOnCpu()
    assert pol.can_graph(torch.randn, pol.tags(torch.randn, (3,), {}))
    assert not pol.can_graph(torch.nonzero, pol.tags(torch.nonzero, (x,), {}, accel=ACC))


def test_thunder_tags_join_in_when_asked():
    pol = OpPolicy()
    # Thunder finds the sync in .item() by itself (prims.item carries DEVICE_SYNC_OP)
    from cudagraphify._tags import thunder_tags
    assert "HOST_SYNC" in thunder_tags(torch.Tensor.item, "k1", (s0,), {})
    assert "DYNAMIC_SHAPE" in thunder_tags(torch.nonzero, "k2", (x,), {})
    assert thunder_tags(torch.add, "k3", (x, x), {}) == frozenset()
    assert pol.tags(torch.add, (x, x), {}, accel=ACC, thunder=True, thunder_key="k3") == set()


def test_public_tag_objects_extend_thunders_tagbase():
    from thunder.core.baseutils import TagBase

    assert issubclass(cg.Tag, TagBase)
    assert isinstance(cg.Tag.HOST_SYNC, TagBase)
    pol = OpPolicy()
    pol.tag_op(torch.Tensor.cumsum, cg.Tag.COLLECTIVE)
    assert pol.tags(torch.Tensor.cumsum, (x, 0), {}) == {"COLLECTIVE"}
