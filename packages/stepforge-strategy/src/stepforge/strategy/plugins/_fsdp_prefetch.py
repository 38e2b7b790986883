# SPDX-License-Identifier: Apache-2.0
"""FSDP1's ``forward_prefetch``/``backward_prefetch`` as FSDP2 explicit prefetching of neighbouring blocks.

FSDP1 prefetches the next all-gather of a wrapped unit; FSDP2 (``fully_shard``) says which units a unit
prefetches with the public ``FSDPModule.set_modules_to_forward_prefetch``/``set_modules_to_backward_prefetch``.
The blocks are taken in the order :func:`~._fsdp_common.shard_model` shards them (registration order, which is
the forward order of a ``ModuleList``/``Sequential`` stack); the root runs first in forward and its backward
starts first, so it prefetches the first blocks in forward and the last ones in backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.fsdp import BackwardPrefetch

__all__ = ["PrefetchPlan", "prefetch_plan", "apply_prefetch", "BACKWARD_PREFETCH_UNSET"]


class _FSDP2Default:
    """The type of :data:`BACKWARD_PREFETCH_UNSET` (a readable default in signatures and docs)."""

    def __repr__(self) -> str:
        return "<FSDP2 default>"


#: ``backward_prefetch`` not given: FSDP2's own backward prefetching (the previous block, like FSDP1's
#: ``BACKWARD_PRE``), distinct from an explicit ``None`` (FSDP1: no backward prefetching).
BACKWARD_PREFETCH_UNSET: Any = _FSDP2Default()


@dataclass(frozen=True)
class PrefetchPlan:
    """How many neighbouring blocks each FSDP unit all-gathers ahead.

    Attributes:
        forward: blocks prefetched after this one in forward (0: FSDP2's default, no explicit prefetch).
        backward: blocks prefetched before this one in backward; ``None``: FSDP2's default (the previous
            block, found from the recorded forward order); 0: none.
    """

    forward: int = 0
    backward: int | None = None

    @property
    def is_default(self) -> bool:
        """Whether the plan leaves FSDP2's own prefetching untouched."""
        return self.forward == 0 and self.backward is None


def prefetch_plan(
    owner: str, forward_prefetch: Any, backward_prefetch: Any, prefetch_blocks: Any
) -> PrefetchPlan:
    """Map FSDP1's arguments and stepforge's ``prefetch_blocks`` onto a :class:`PrefetchPlan`.

    Args:
        owner: the plugin's name, for error messages.
        forward_prefetch: FSDP1's ``forward_prefetch`` (bool): ``True`` prefetches ``prefetch_blocks`` blocks
            ahead in forward.
        backward_prefetch: FSDP1's ``BackwardPrefetch.BACKWARD_PRE``/``BACKWARD_POST`` or its name: prefetch
            ``prefetch_blocks`` blocks ahead in backward (FSDP2 has one backward prefetch point, before the
            block's gradient computation, so both map to it); ``None``: no backward prefetching;
            :data:`BACKWARD_PREFETCH_UNSET`: FSDP2's default (the previous block) unless ``prefetch_blocks`` > 1.
        prefetch_blocks: how many neighbouring blocks to prefetch where prefetching is on (int >= 1).

    Raises:
        TypeError / ValueError: a value of the wrong type or out of range, naming the argument.
    """
    if isinstance(prefetch_blocks, bool) or not isinstance(prefetch_blocks, int) or prefetch_blocks < 1:
        raise ValueError(
            f"{owner}: prefetch_blocks must be an int >= 1 (blocks all-gathered ahead), got {prefetch_blocks!r}; "
            "turn prefetching off with forward_prefetch=False / backward_prefetch=None."
        )
    if not isinstance(forward_prefetch, bool):
        raise TypeError(f"{owner}: forward_prefetch must be a bool, got {forward_prefetch!r}.")
    forward = prefetch_blocks if forward_prefetch else 0
    if backward_prefetch is BACKWARD_PREFETCH_UNSET:
        backward = prefetch_blocks if prefetch_blocks > 1 else None
    elif backward_prefetch is None:
        backward = 0
    else:
        name = (
            backward_prefetch.name if isinstance(backward_prefetch, BackwardPrefetch) else backward_prefetch
        )
        if name not in ("BACKWARD_PRE", "BACKWARD_POST"):
            raise ValueError(
                f"{owner}: backward_prefetch must be BackwardPrefetch.BACKWARD_PRE/BACKWARD_POST (or its name) or "
                f"None, got {backward_prefetch!r}."
            )
        backward = prefetch_blocks
    return PrefetchPlan(forward=forward, backward=backward)


def apply_prefetch(root: nn.Module, blocks: list[nn.Module], plan: PrefetchPlan) -> None:
    """Set FSDP2 explicit prefetching on ``root`` and its sharded ``blocks`` (in forward order) from ``plan``.

    Backward prefetching of 0 blocks is set as each unit prefetching itself, a no-op (its parameters are
    already gathered when its pre-backward prefetches), since an empty list means FSDP2's default.
    """
    from torch.distributed.fsdp import FSDPModule

    if plan.is_default:
        return
    units: list[FSDPModule] = [b for b in blocks if isinstance(b, FSDPModule)]
    if not isinstance(root, FSDPModule):
        raise TypeError(f"apply_prefetch: root must be fully_shard'ed first, got {type(root).__name__}.")
    if plan.forward:
        root.set_modules_to_forward_prefetch(units[: plan.forward])
        for i, unit in enumerate(units):
            ahead = units[i + 1 : i + 1 + plan.forward]
            if ahead:
                unit.set_modules_to_forward_prefetch(ahead)
    if plan.backward is None:
        return
    if plan.backward == 0:
        for unit in [root, *units]:
            unit.set_modules_to_backward_prefetch([unit])
        return
    root.set_modules_to_backward_prefetch(units[::-1][: plan.backward])
    for i, unit in enumerate(units):
        behind = units[max(0, i - plan.backward) : i][::-1]
        if behind:
            unit.set_modules_to_backward_prefetch(behind)
