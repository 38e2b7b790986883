# SPDX-License-Identifier: Apache-2.0
"""The two tensor collectives, under the names the installed torch prefers.

torch 2.13 deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor`` in favour of
``all_gather_single``/``reduce_scatter_single`` (same signatures); older torch has only the former. They are
looked up at call time so that wrapping ``torch.distributed`` (tests, the benchmark) sees every call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_name",
    "reduce_scatter_name",
    "all_gather",
    "reduce_scatter",
]

all_gather_name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
reduce_scatter_name = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)


def all_gather(output: torch.Tensor, local: torch.Tensor, *, group: Any, async_op: bool = False) -> Any:
    """``output`` (``W * local.numel()``) = every rank's ``local``, rank-major."""
    return getattr(dist, all_gather_name)(output, local, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, flat: torch.Tensor, *, group: Any, async_op: bool = False) -> Any:
    """``output`` = this rank's chunk of the element-wise sum of every rank's ``flat``."""
    return getattr(dist, reduce_scatter_name)(output, flat, group=group, async_op=async_op)
