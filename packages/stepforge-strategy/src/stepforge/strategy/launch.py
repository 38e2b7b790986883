# SPDX-License-Identifier: Apache-2.0
"""ColossalAI's cluster helpers with its signatures: ``launch``, ``launch_from_torch`` and
``DistCoordinator``. A group already initialised with the same rank and world size is kept (ColossalAI would
fail), so a script can run under a launcher that made it; :class:`DistCoordinator` is not a process-wide
singleton."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch.distributed as dist

from ._env import destroy_group_at_exit, is_distributed, set_random_seed
from .accelerator import get_accelerator

__all__ = ["DistCoordinator", "launch", "launch_from_torch"]

_R = TypeVar("_R")

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
    """ColossalAI's ``launch``: join the default process group at ``tcp://host:port`` as ``rank`` of
    ``world_size`` (``nccl`` becomes ``gloo`` without a GPU), bind ``local_rank``'s GPU, seed every rank; a
    ``ValueError`` for a rank out of range or a group initialised with other values."""
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


class DistCoordinator:
    """Rank facts and rank-0-first helpers for the default process group: ``rank``, ``world_size``,
    ``local_rank`` (``LOCAL_RANK``, -1 when unset). Raises ``RuntimeError`` without a process group."""

    def __init__(self) -> None:
        if not is_distributed():
            raise RuntimeError(
                "DistCoordinator: torch.distributed is not initialised; call stepforge.strategy.launch_from_torch() "
                "(under torchrun) or torch.distributed.init_process_group first."
            )
        # the attribute names of ColossalAI's coordinator, which some scripts read directly
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()
        self._local_rank = int(os.environ.get("LOCAL_RANK", -1))

    @property
    def rank(self) -> int:
        """This process's rank in the default group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The default group's size."""
        return self._world_size

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (``LOCAL_RANK``, set by torchrun; -1 when unset)."""
        return self._local_rank

    def is_master(self, process_group: Any = None) -> bool:
        """Whether this is rank 0 (of ``process_group``, default the whole group)."""
        return bool(dist.get_rank(group=process_group) == 0)

    def is_node_master(self) -> bool:
        """Whether this is local rank 0 (the first process on this node); a ``RuntimeError`` when ``LOCAL_RANK``
        is not set."""
        if self._local_rank < 0:
            raise RuntimeError(
                "DistCoordinator: LOCAL_RANK is not set, so the rank on this node is unknown; start the script "
                "with torchrun."
            )
        return self._local_rank == 0

    def is_last_process(self, process_group: Any = None) -> bool:
        """Whether this is the last rank (of ``process_group``)."""
        return bool(dist.get_rank(group=process_group) == dist.get_world_size(group=process_group) - 1)

    def print_on_master(self, msg: str, process_group: Any = None) -> None:
        """``print(msg)`` on rank 0 only."""
        if self.is_master(process_group):
            print(msg)

    def print_on_node_master(self, msg: str) -> None:
        """``print(msg)`` on local rank 0 only (:meth:`is_node_master`)."""
        if self.is_node_master():
            print(msg)

    def block_all(self, process_group: Any = None) -> None:
        """A barrier: return when every rank of ``process_group`` has called it."""
        dist.barrier(group=process_group)

    @contextmanager
    def priority_execution(self, executor_rank: int = 0, process_group: Any = None) -> Iterator[None]:
        """Run the block on ``executor_rank`` first, the others after it left; its barrier runs even when its
        block raised, so the others fail on their own instead of waiting out the backend timeout."""
        if dist.get_rank(group=process_group) != executor_rank:
            self.block_all(process_group)
            yield
            return
        try:
            yield
        finally:
            self.block_all(process_group)

    def on_master_only(
        self, process_group: Any = None
    ) -> Callable[[Callable[..., _R]], Callable[..., _R | None]]:
        """A decorator: the function runs on rank 0 and returns ``None`` elsewhere."""
        master = self.is_master(process_group)

        def decorate(func: Callable[..., _R]) -> Callable[..., _R | None]:
            @functools.wraps(func)
            def run(*args: Any, **kwargs: Any) -> _R | None:
                return func(*args, **kwargs) if master else None

            return run

        return decorate

    def destroy(self, process_group: Any = None) -> None:
        """``torch.distributed.destroy_process_group(process_group)``."""
        dist.destroy_process_group(process_group)
