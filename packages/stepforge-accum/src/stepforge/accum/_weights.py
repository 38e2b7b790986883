# SPDX-License-Identifier: Apache-2.0
"""The weights of a weighted accumulation window and their sum across data-parallel ranks.

In weighted mode every micro-batch brings a weight ``w`` (its number of tokens or samples); the window's gradient
is multiplied by ``W / N`` at the step, ``N`` being the sum of ``w`` over the window and the ``W`` ranks. ``N`` is
all-reduced once per window, launched before the window's last backward so that it overlaps with it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ._grads import comm_device

__all__ = ["WindowWeights"]


class WindowWeights:
    """The weights of the open window (python floats and scalar tensors) and their overlapped all-reduce.

    Args:
        process_group: the data-parallel group whose ranks' weights are summed; ``None``: the default group
            when ``torch.distributed`` is initialised.
        reduce_weights: sum across ``process_group`` (default: whenever it has more than one rank).
    """

    def __init__(self, process_group: Any = None, reduce_weights: bool | None = None) -> None:
        self.process_group = process_group
        self.reduce_weights = reduce_weights
        self.local = 0.0  # python-float weights of this rank's micro-batches in the window
        self._tensors: list[torch.Tensor] = []  # scalar-tensor weights, kept lazy (no host sync per batch)
        self._pending: tuple[Any, torch.Tensor, int] | None = None  # (work, buffer, micro-batch it counts)

    def reset(self) -> None:
        self.local = 0.0
        self._tensors = []
        self._pending = None

    def add(self, weight: float | torch.Tensor) -> None:
        if isinstance(weight, torch.Tensor):
            self._tensors.append(weight)
        else:
            self.local += weight

    def local_sum(self) -> float:
        """This rank's weight of the open window, as a python float (synchronises tensor weights)."""
        return self.local + sum(float(w.item()) for w in self._tensors)

    def _group(self) -> Any:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _reduces(self) -> bool:
        if self.reduce_weights is False or not (dist.is_available() and dist.is_initialized()):
            return False
        size = dist.get_world_size(self._group())
        return bool(self.reduce_weights) or size > 1

    def _local_total(self, extra: float | torch.Tensor | None, device: torch.device) -> torch.Tensor:
        total = torch.tensor(self.local, dtype=torch.float64, device=device)
        for w in self._tensors:
            total += w.to(device=device, dtype=torch.float64)
        if isinstance(extra, torch.Tensor):
            total += extra.to(device=device, dtype=torch.float64)
        elif extra is not None:
            total += extra
        return total

    def launch_reduce(self, extra: float | torch.Tensor | None, micro_batch: int) -> None:
        """Start the all-reduce of the window's sum, ``extra`` (the coming micro-batch's weight) included.

        ``micro_batch`` is the number the coming micro-batch will have; :meth:`factor` drops a reduce launched
        for a micro-batch whose backward never happened.
        """
        if not self._reduces():
            return
        group = self._group()
        buf = self._local_total(extra, comm_device(group))
        work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group, async_op=True)
        self._pending = (work, buf, micro_batch)

    def factor(self, inner_count: int) -> tuple[float, float]:
        """``(W / N, N)`` of the window that ends at micro-batch ``inner_count`` (``W / N`` is 0 when N <= 0)."""
        if self._pending is not None and self._pending[2] != inner_count:
            self._pending = None
        if self._pending is None:
            self.launch_reduce(extra=None, micro_batch=inner_count)
        world = dist.get_world_size(self._group()) if self._reduces() else 1
        if self._pending is not None:
            work, buf, _ = self._pending
            work.wait()
            total = float(buf.item())
            self._pending = None
        else:
            total = float(self._local_total(None, torch.device("cpu")).item())
        return (world / total if total > 0.0 else 0.0), total
