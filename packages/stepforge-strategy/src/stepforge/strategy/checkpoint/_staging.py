# SPDX-License-Identifier: Apache-2.0
"""Read a checkpoint into fresh tensors, then apply: a load that fails half-way leaves the live tensors alone.

:func:`fresh_like` mirrors a nested state dict with every tensor replaced by an uninitialised one of the same
shape, dtype, device and (for a DTensor) sharding; DCP fills that mirror. Only after every read succeeded does
:func:`apply_fresh` copy it into the live tensors (and put its non-tensor leaves in place), so the cost of
all-or-nothing is one extra copy of the loaded tensors in memory.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["fresh_like", "apply_fresh"]


def fresh_like(template: Any) -> Any:
    """``template`` with every tensor replaced by ``torch.empty_like`` (dicts and lists copied, leaves shared)."""
    if isinstance(template, torch.Tensor):
        return torch.empty_like(template)
    if isinstance(template, dict):
        return {k: fresh_like(v) for k, v in template.items()}
    if isinstance(template, list):
        return [fresh_like(v) for v in template]
    return template


@torch.no_grad()
def apply_fresh(template: Any, fresh: Any) -> None:
    """Copy ``fresh`` (filled by a load) into ``template`` in place: tensors with ``copy_``, other leaves set."""
    items: Any
    if isinstance(template, dict):
        items = template.items()
    elif isinstance(template, list):
        items = enumerate(template)
    else:
        return
    for key, live in list(items):
        new = fresh[key]
        if isinstance(live, torch.Tensor):
            live.copy_(new)
        elif isinstance(live, (dict, list)):
            apply_fresh(live, new)
        else:
            template[key] = new
