"""FSDP2 next to graphs: which modules have their parameters freed after forward.

FSDP2 (``fully_shard``) with ``reshard_after_forward`` frees a module's gathered parameters
after its forward and gathers them anew, elsewhere, for its backward, where a backward graph
cannot follow: training calls of such a module (or of a graphified submodule of such a block)
run eagerly. Inference calls still replay; parameters gathered into new memory are caught by the
statics guard like any move.
"""

from __future__ import annotations

import sys
from typing import Iterator

import torch

__all__ = ["RESHARDS", "reshards_after_forward", "ParentReshard"]

RESHARDS = ("FSDP2 shards this module (or one around it) with reshard_after_forward: it frees "
            "the parameters after forward and gathers them anew, elsewhere, for backward, "
            "where a backward graph cannot follow (inference calls still replay); shard it "
            "with reshard_after_forward=False for training graphs")


def reshards_after_forward(module: torch.nn.Module | None) -> bool:
    """Whether FSDP2 (``fully_shard``) frees ``module``'s parameters after each forward."""
    # Looked up on the class: a module's __getattr__ raises (slowly) for a missing name, and
    # this runs on every grad-mode call.
    state = getattr(type(module), "_get_fsdp_state", None)
    if state is None:
        return False
    try:
        group = state(module)._fsdp_param_group
        return group is not None and group.post_forward_mesh_info is not None
    except Exception:  # noqa: BLE001 - FSDP2 internals asserting: cannot tell, assume it does
        return True


class ParentReshard:
    """Whether an FSDP2 group of an enclosing ``fully_shard``ed module frees some of the
    parameters of ``modules()`` after forward; looked up again when FSDP2's registry of
    sharded modules changes size (or after :meth:`forget`)."""

    def __init__(self):
        self._checked = (-1, False)  # (registry size, answer)

    def forget(self) -> None:
        self._checked = (-1, False)

    def __call__(self, modules: list[torch.nn.Module]) -> bool:
        registry = sys.modules.get("torch.distributed._composable_state")
        mapping = getattr(registry, "_module_state_mapping", None)
        size = len(mapping) if mapping is not None else 0
        if size != self._checked[0]:
            mine = {id(m) for m in modules}
            self._checked = (size, size > 0 and any(
                id(m) in mine for m in _resharded_param_owners(mapping)))
        return self._checked[1]


def _resharded_param_owners(mapping) -> Iterator[torch.nn.Module]:
    """The modules whose parameters an FSDP2 group in ``mapping`` (FSDP2's registry of sharded
    modules) frees after forward. A state whose internals cannot be read is skipped (a
    backward still checks the addresses it reads)."""
    for ref in list(mapping.values()):
        try:
            state = ref()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:  # older FSDP2: one group per state
                groups = [getattr(state, "_fsdp_param_group", None)]
            owners = [m for group in groups if group is not None
                      and getattr(group, "post_forward_mesh_info", None) is not None
                      for param in group.fsdp_params
                      for m in (param._module_info.module,
                                *getattr(param._module_info, "shared_modules", ()))]
        except Exception:  # noqa: BLE001 - FSDP2 internals changed or asserting
            continue
        yield from owners
