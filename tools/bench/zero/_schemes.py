# SPDX-License-Identifier: Apache-2.0
"""The data-parallel schemes of ``bench_zero.py``: each built over the same model, with a function that counts
the gradient + optimizer-state bytes it holds per rank."""

from __future__ import annotations

from typing import Any

import torch

from bench.zero._parts import Counter, ddp_counting_hook, nbytes

__all__ = ["SCHEMES", "THEORY_FACTOR", "LR", "build"]

SCHEMES = ("ddp_adamw", "ddp_torchzero", "fsdp2", "zero1", "zero2")
#: ring bytes per rank in units of (N-1)/N * parameter bytes; stepforge.zero with comm_algorithm="all_reduce": 3
THEORY_FACTOR = {"ddp_adamw": 2, "ddp_torchzero": 3, "fsdp2": 3, "zero1": 2, "zero2": 2}
LR = 1e-4


def _state_bytes(optimizer: Any) -> int:
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                total += _local(value).numel() * value.element_size()
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def build(
    scheme: str,
    model: torch.nn.Module,
    counter: Counter,
    originals: dict[str, Any],
    zero_comm: str = "auto",
    bucket: int | None = None,
    overlap_allgather: bool = True,
) -> tuple[Any, Any, Any]:
    """``(module to call, optimizer, memory function)`` for one scheme; the memory function also reports the
    communication buffers a scheme keeps between steps (``"buffers"``, not part of grads + state)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if scheme in ("ddp_adamw", "ddp_torchzero"):
        ddp = DDP(model, gradient_as_bucket_view=True)
        ddp.register_comm_hook(None, ddp_counting_hook(counter, originals["all_reduce"]))
        if scheme == "ddp_adamw":
            optimizer: Any = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
            inner = optimizer
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, fused=True)
            inner = optimizer.optim

        def memory() -> dict[str, int]:
            grads = sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
            return {"grad": grads, "optim_state": _state_bytes(inner), "master": 0}

        return ddp, optimizer, memory
    if scheme == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

        def memory() -> dict[str, int]:
            grads = sum(nbytes(_local(p.grad)) for p in model.parameters() if p.grad is not None)
            return {"grad": grads, "optim_state": _state_bytes(optimizer), "master": 0}

        return model, optimizer, memory
    from stepforge.fused import CPUAdam
    from stepforge.zero import LowLevelZeroOptimizer

    zero = LowLevelZeroOptimizer(
        CPUAdam(model.parameters(), lr=LR),
        stage=1 if scheme == "zero1" else 2,
        overlap_communication=True,
        overlap_allgather=overlap_allgather,
        comm_algorithm=zero_comm,
        **({} if bucket is None else {"reduce_bucket_size": bucket}),
    )

    def memory() -> dict[str, int]:
        # the tensors the optimizer holds: reduced gradient pieces, inner optimizer state over the pieces,
        # and master pieces that are separate tensors (fp32 working params are their own masters)
        slots = zero.layout.slots
        storages = {
            s.grad.untyped_storage().data_ptr(): s.grad.untyped_storage().nbytes()
            for s in slots
            if s.grad is not None
        }
        return {
            "grad": sum(storages.values())
            + sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None),
            "optim_state": _state_bytes(zero.optim),
            "master": sum(nbytes(s.master) for s in slots if s.separate_master),
            "buffers": zero.communication_buffer_bytes,
        }

    return model, zero, memory
