# SPDX-License-Identifier: Apache-2.0
"""The weights of a weighted accumulation window (see :mod:`._window`): their validation and their sum across
data-parallel ranks, all-reduced once per window, launched before its last backward to overlap with it."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
import torch.distributed as dist

from stepforge.core import HyperParameterError

__all__ = ["WindowWeights", "check_weight_value"]


def check_weight_value(weight: Any, *, owner: str) -> float | torch.Tensor | None:
    """A micro-batch weight as a python float or a detached 0-dim tensor (``None`` stays ``None``).

    Raises:
        HyperParameterError: a non-scalar tensor, a non-number, a negative or non-finite number.
    """
    if weight is None:
        return None
    if isinstance(weight, torch.Tensor):
        if weight.numel() != 1:
            raise HyperParameterError(
                f"{owner}: weight/num_items must be a scalar, got a tensor of shape "
                f"{tuple(weight.shape)}; pass the number of tokens or samples of the micro-batch."
            )
        return weight.detach().reshape(())
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
        raise HyperParameterError(
            f"{owner}: weight/num_items must be a number or a scalar tensor, got {weight!r}."
        )
    if not math.isfinite(weight) or weight < 0:
        raise HyperParameterError(
            f"{owner}: weight/num_items must be finite and >= 0, got {weight!r}; it is the "
            "number of tokens or samples the micro-batch's mean loss averages over."
        )
    return float(weight)


def _comm_device(group: Any) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class WindowWeights:
    """The weights of the open window (python floats and scalar tensors) and their overlapped all-reduce over
    ``process_group`` (``None``: the default group), when ``reduce_weights`` (default: it has several ranks;
    pass ``False`` when gradients are *not* averaged across ranks)."""

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
        buf = self._local_total(extra, _comm_device(group))
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
