# SPDX-License-Identifier: Apache-2.0
"""``torch_ddp`` (aliases ``ddp``, ``TorchDDPPlugin``): ``torch.nn.parallel.DistributedDataParallel``."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from stepforge.core.memory_plan import MemoryPlan, replicated_plan, unique_parameters
from stepforge.core.torch_compat import ddp_bucket_assignment

from .._env import is_distributed
from ..boosted_optimizer import OptimizerWrapper, as_boosted
from .single import StatefulLoaderPlugin

__all__ = ["TorchDDPPlugin", "sync_batchnorm"]

#: torch >= 2.12 renamed DDP's ``broadcast_buffers`` to ``forward_sync_buffers`` and warns on the old name
_HAS_FORWARD_SYNC = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters


def sync_batchnorm(model: nn.Module, device: torch.device, process_group: Any = None) -> nn.Module:
    """BatchNorm layers as ``nn.SyncBatchNorm`` on an accelerator, as ColossalAI's DDP plugin does; torch's
    ``SyncBatchNorm`` refuses CPU inputs under several ranks, so on CPU the layers stay per-rank."""
    if device.type == "cpu":
        return model
    converted: nn.Module = nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group)
    return converted


class TorchDDPPlugin(StatefulLoaderPlugin):
    """Data parallelism with torch DDP; ``no_sync`` is DDP's; BatchNorm becomes ``SyncBatchNorm`` on an
    accelerator. ColossalAI's arguments go to ``DistributedDataParallel`` (``broadcast_buffers`` under the
    name this torch expects)."""

    name = "torch_ddp"

    def __init__(
        self,
        broadcast_buffers: bool = True,
        bucket_cap_mb: int = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        *,
        device: str | torch.device | None = None,
        process_group: Any = None,
    ) -> None:
        super().__init__(device)
        if not isinstance(bucket_cap_mb, int | float) or bucket_cap_mb <= 0:
            raise ValueError(f"TorchDDPPlugin: bucket_cap_mb must be > 0, got {bucket_cap_mb!r}.")
        # False keeps the old name: the new forward_sync_buffers=False would still sync the buffers once at
        # construction, which the old one did not (torch's own warning says to keep it for that)
        sync = {"forward_sync_buffers": True} if _HAS_FORWARD_SYNC and broadcast_buffers else {}
        self.ddp_kwargs: dict[str, Any] = dict(
            sync or {"broadcast_buffers": broadcast_buffers},
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            check_reduction=check_reduction,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
        )
        self.process_group = process_group

    def prepare(
        self, model: nn.Module, optimizer: Any = None, **kwargs: Any
    ) -> tuple[nn.Module, OptimizerWrapper | None]:
        """Move ``model`` to the device and wrap it in DDP (the optimizer's parameters are DDP's); the optimizer
        comes back boosted (an :class:`OptimizerWrapper` unless the Booster's mixed precision wrapped it)."""
        if not is_distributed():
            raise RuntimeError(
                "TorchDDPPlugin needs an initialised process group (torchrun, or "
                "torch.distributed.init_process_group); on one process use plugin='single'."
            )
        if isinstance(model, DistributedDataParallel):
            return model, as_boosted(optimizer)
        self.bind_device()
        model = sync_batchnorm(model.to(self.device), self.device, self.process_group)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        with warnings.catch_warnings():
            # only reached with broadcast_buffers=False, the one case torch advises to keep the old name for
            warnings.filterwarnings("ignore", "`broadcast_buffers` is deprecated", FutureWarning)
            ddp = DistributedDataParallel(
                model, device_ids=device_ids, process_group=self.process_group, **self.ddp_kwargs
            )
        return ddp, as_boosted(optimizer)

    def support_lora(self) -> bool:
        """LoRA through peft is supported (as ColossalAI's plugin)."""
        return True

    def memory_plan(
        self,
        model: nn.Module,
        *,
        world_size: int,
        rank: int = 0,
        optimizer: Mapping[str, Any] | torch.optim.Optimizer | None = None,
        backend: str | None = None,
        device: str | torch.device | None = None,
        accumulation_steps: int = 1,
    ) -> MemoryPlan:
        """The replicated layout plus DDP's buckets (one copy of the gradients, none with
        ``gradient_as_bucket_view``), all-reduced once per optimizer step."""
        plan = replicated_plan(
            self.name,
            model,
            world_size=world_size,
            rank=rank,
            optimizer=optimizer,
            accumulation_steps=accumulation_steps,
        )
        reductions = 1 if self.supports_no_sync() else plan.accumulation_steps
        grads = [p for _, p in unique_parameters(model) if p.requires_grad]
        cap = int(self.ddp_kwargs["bucket_cap_mb"] * 1024**2)
        buckets = ddp_bucket_assignment(list(reversed(grads)), cap)
        total = sum(p.numel() * p.element_size() for p in grads)
        if not self.ddp_kwargs["gradient_as_bucket_view"]:
            plan.add("buffers", "device", total, "DDP gradient buckets")
        plan.collective(
            "all_reduce",
            "backward",
            reductions * len(buckets),
            reductions * total,
            world_size,
            "gradient buckets",
        )
        plan.notes.append(f"{len(buckets)} buckets of <= {self.ddp_kwargs['bucket_cap_mb']} MiB")
        if plan.accumulation_steps > 1:
            plan.notes.append(f"{plan.accumulation_steps} micro-batches per step, all-reduced {reductions}x")
        return plan

    def no_sync(self, model: nn.Module | None, optimizer: Any = None) -> AbstractContextManager[Any]:
        """DDP's ``no_sync``: the forward and backward inside skip the all-reduce."""
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(
                f"TorchDDPPlugin.no_sync: model must be the boosted (DDP) model, got {type(model).__name__}."
            )
        return model.no_sync()
