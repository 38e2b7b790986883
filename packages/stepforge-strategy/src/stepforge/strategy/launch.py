# SPDX-License-Identifier: Apache-2.0
"""ColossalAI's launchers, ``colossalai.launch`` and ``colossalai.launch_from_torch``, with its signatures: each
initialises the default process group (``nccl`` with CUDA, ``gloo`` on the CPU, as the accelerator says), binds
this process to its GPU and seeds every rank. A group already initialised with the same rank and world size is
kept (ColossalAI would fail), so a script can run under a launcher that made it."""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from ._env import destroy_group_at_exit, set_random_seed
from .accelerator import get_accelerator

__all__ = ["launch", "launch_from_torch"]

logger = logging.getLogger("stepforge.strategy")

#: the variables torchrun sets that :func:`launch_from_torch` reads
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    backend: str = "nccl",
    local_rank: int | None = None,
    seed: int = 1024,
    verbose: bool = True,
) -> None:
    """Join the default process group at ``tcp://host:port`` (an IPv6 host bracketed) as ``rank`` of
    ``world_size`` (ColossalAI's ``launch``): ``backend`` ``"nccl"`` becomes ``gloo`` when torch sees no GPU, as
    ColossalAI takes the accelerator's; ``local_rank`` is the GPU to bind (default: ``LOCAL_RANK``, else the rank
    modulo the GPU count); ``seed`` seeds python, numpy and torch on every rank; ``verbose`` logs the world size on
    rank 0. Raises ``ValueError`` for a rank out of range or a group initialised with other values."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"launch: rank must be in [0, world_size) and world_size >= 1, got {rank}, {world_size}."
        )
    accelerator = get_accelerator()
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise ValueError(
                f"launch: the default process group is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not {rank} of {world_size}; launch once per process."
            )
    else:
        if backend == "nccl" and accelerator.name != "cuda":
            backend = accelerator.communication_backend
        address = f"[{host}]" if ":" in host else host
        dist.init_process_group(
            backend=backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world_size
        )
        destroy_group_at_exit()
    if accelerator.support_set_device:
        accelerator.set_device(local_rank)
    set_random_seed(seed)
    if verbose and rank == 0:
        logger.info("Distributed environment is initialized, world size: %d", world_size)


def launch_from_torch(backend: str = "nccl", seed: int = 1024, verbose: bool = True) -> None:
    """:func:`launch` with the rank, local rank, world size and address torchrun exports (ColossalAI's
    ``launch_from_torch``); ``RuntimeError`` naming a missing variable."""
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"launch_from_torch: environment variable(s) {', '.join(missing)} not set; start the script with "
            "torchrun (torchrun --nproc-per-node N script.py), which sets them."
        )
    launch(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        host=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        backend=backend,
        local_rank=int(os.environ["LOCAL_RANK"]),
        seed=seed,
        verbose=verbose,
    )
