# SPDX-License-Identifier: Apache-2.0
"""``CheckpointIO`` and ``GeneralCheckpointIO``: ColossalAI's checkpoint objects (``booster.checkpoint_io``).

A thin layer over the Booster's savers (:mod:`._model_io`, :mod:`._optim_io`) with ColossalAI's method names and
signatures. Models are written in the Hugging Face layout (one file, or shards with an index; safetensors or
``torch.save`` by ``use_safetensors``, ColossalAI's default ``False``); an optimizer that ``Booster.boost``
returned goes through ``torch.distributed.checkpoint`` keyed by parameter name (any world size); an optimizer
``boost`` did not wrap (:class:`~stepforge.strategy.GeneralCheckpointIO` only, in :mod:`.general_checkpoint_io`) is ``torch.save``-d as its own ``state_dict()``.

``use_async=True`` returns once the state is staged (copied away from the live tensors); the files are written
in the background (a thread for models and plain optimizers, ``dcp.async_save`` for boosted optimizers). As in
ColossalAI, the next ``save_model`` waits for every pending write first (``_sync_io``), ``synchronize()`` is the
point before the weights change (staging is already done when ``save_*`` returns, so it returns at once) and the
object waits for its writes when it is garbage collected. A failed background write raises at the wait.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stepforge.core import BoostedOptimizer, Plugin

from . import _model_io, _optim_io
from .boosted_model import plugin_module
from .checkpoint import CheckpointError

__all__ = ["CheckpointIO", "BoosterCheckpointIO"]

logger = logging.getLogger("stepforge.strategy")


def is_dist() -> bool:
    """Whether a process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if is_dist() else 0


def staged(value: Any) -> Any:
    """A copy of every tensor in ``value`` (dicts/lists/tuples walked), on CPU: what a background write reads."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: staged(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(staged(v) for v in value)
    return value


def done_future() -> Future[None]:
    """A finished future: a rank with nothing to write still takes part in :meth:`CheckpointIO._sync_io`."""
    future: Future[None] = Future()
    future.set_result(None)
    return future


class CheckpointIO(ABC):
    """ColossalAI's checkpoint interface: save/load of models, optimizers and lr schedulers, with the
    asynchronous-write bookkeeping (``async_writers``, ``_sync_io``, ``_sync_d2h``, ``synchronize``)."""

    def __init__(self) -> None:
        self.async_writers: list[Future[Any]] = []
        self._pool: ThreadPoolExecutor | None = None

    # -- asynchronous writes ---------------------------------------------------------------------------------
    def _submit(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stepforge-ckpt")
        self.async_writers.append(self._pool.submit(fn, *args, **kwargs))

    def _sync_io(self) -> None:
        """Wait for every pending background write (re-raising the first failure); collective when there were
        some under a process group (every rank then agrees the files are complete)."""
        had_writes = bool(self.async_writers)
        errors = self._wait_writers()
        if had_writes and is_dist():
            dist.barrier()
        if errors:
            raise CheckpointError(f"an asynchronous checkpoint write failed: {errors[0]}") from errors[0]

    def _wait_writers(self) -> list[BaseException]:
        writers, self.async_writers = self.async_writers, []
        errors: list[BaseException] = []
        for writer in writers:
            error = writer.exception()  # waits; every writer finishes before a failure is raised
            if error is not None:
                errors.append(error)
        return errors

    def _sync_d2h(self) -> None:  # noqa: B027 (deliberately empty: staging is synchronous)
        """Wait until pending writes no longer read the live tensors: staging finishes before ``save_*``
        returns, so there is nothing to wait for."""

    def synchronize(self) -> None:
        """ColossalAI's point before the weights change (``_sync_d2h``)."""
        self._sync_d2h()

    def __del__(self) -> None:
        # wait only: a finaliser runs at a different moment on each rank, so no collective here, and it never
        # raises (a failure is still reported)
        for error in self._wait_writers():
            logger.error("checkpoint_io: an asynchronous checkpoint write failed: %s", error)
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # -- the interface ---------------------------------------------------------------------------------------
    @abstractmethod
    def save_model(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike[str],
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_safetensors: bool = False,
        use_async: bool = False,
    ) -> None:
        """Save the full model (every rank calls)."""

    @abstractmethod
    def load_model(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike[str],
        strict: bool = True,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> nn.Module:
        """Load a model save (file, index JSON or directory) into ``model``; returns ``model``."""

    @abstractmethod
    def save_optimizer(
        self,
        optimizer: Any,
        checkpoint: str | os.PathLike[str],
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_async: bool = False,
    ) -> None:
        """Save the optimizer state (every rank calls)."""

    @abstractmethod
    def load_optimizer(
        self,
        optimizer: Any,
        checkpoint: str | os.PathLike[str],
        prefix: str | None = None,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> None:
        """Load an optimizer save into ``optimizer``."""

    def save_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
        """``torch.save(lr_scheduler.state_dict())`` on rank 0 (every rank calls)."""
        _optim_io.save_lr_scheduler(lr_scheduler, checkpoint)

    def load_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
        """Load a file written by :meth:`save_lr_scheduler` (no code runs from it)."""
        _optim_io.load_lr_scheduler(lr_scheduler, checkpoint)

    def save_lora_as_pretrained(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike[str],
        use_safetensors: bool = False,
        state_dict: dict[str, Any] | None = None,
    ) -> None:
        """Write the LoRA adapters and their config (peft's ``save_pretrained``) to directory ``checkpoint`` on
        rank 0; every rank calls.

        Raises:
            ValueError: the model has no LoRA adapters (``Booster.enable_lora`` before ``boost``).
        """
        from ._lora import peft_model_of

        peft_model = peft_model_of(model)
        if rank() == 0:
            if state_dict is None:
                state_dict = staged(peft_model.state_dict())
            peft_model.save_pretrained(
                str(checkpoint), safe_serialization=use_safetensors, state_dict=state_dict
            )
        if is_dist():
            dist.barrier()


class BoosterCheckpointIO(CheckpointIO):
    """The checkpoint IO of a Booster with a plugin: optimizers that ``boost`` returned go through the plugin
    (``torch.distributed.checkpoint``, directory ``checkpoint``)."""

    def __init__(self, plugin: Plugin) -> None:
        super().__init__()
        if not isinstance(plugin, Plugin):
            raise TypeError(
                f"checkpoint_io: plugin must be a stepforge.core.Plugin, got {type(plugin).__name__}."
            )
        self.plugin = plugin
        # id(boosted optimizer) -> (it, the plugin's model); holding the optimizer keeps its id from being reused
        self._boosted: dict[int, tuple[Any, nn.Module]] = {}

    def register(self, optimizer: Any, model: nn.Module) -> None:
        """Record that ``boost`` returned ``optimizer`` with ``model`` (the plugin's model)."""
        self._boosted[id(optimizer)] = (optimizer, plugin_module(model))

    def model_for(self, optimizer: Any) -> nn.Module | None:
        """The plugin's model ``optimizer`` was boosted with (``None``: not boosted here)."""
        entry = self._boosted.get(id(optimizer))
        return None if entry is None else entry[1]

    def optimizers_for(self, model: nn.Module) -> list[BoostedOptimizer]:
        """The optimizers ``boost`` returned together with ``model`` (boosted or the plugin's model)."""
        module = plugin_module(model)
        return [opt for opt, owner in self._boosted.values() if owner is module]

    # -- models ----------------------------------------------------------------------------------------------
    def save_model(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike[str],
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_safetensors: bool = False,
        use_async: bool = False,
    ) -> None:
        """Save the full model in the HF layout (gathered; rank 0 writes). ``shard=False``: one file at
        ``checkpoint`` (a directory gets ``model.safetensors``/``pytorch_model.bin`` inside); ``shard=True``:
        directory ``checkpoint`` with files of at most ``size_per_shard`` MiB and an index JSON. ``prefix``
        prefixes the file names. ``use_async`` writes safetensors (as ColossalAI) in the background."""
        self._sync_io()
        if not gather_dtensor:
            raise ValueError(
                "save_model: gather_dtensor=False is not supported; full model saves are gathered (save sharded "
                "state with save_optimizer or stepforge.strategy's DCP checkpoints)."
            )
        if not isinstance(size_per_shard, int | float) or size_per_shard <= 0:
            raise ValueError(f"save_model: size_per_shard must be > 0 (MiB), got {size_per_shard!r}.")
        model = plugin_module(model)
        if not use_async:
            _model_io.save_model(
                model, checkpoint, shard=shard, prefix=prefix, size_per_shard=size_per_shard,
                use_safetensors=use_safetensors,
            )  # fmt: skip
            return
        if not use_safetensors:
            logger.warning(
                "save_model: use_async=True writes safetensors (use_safetensors set to True), as ColossalAI."
            )
        state = staged(_model_io.gather_full_state_dict(model))  # collective, on this thread
        if rank() == 0:
            self._submit(
                _model_io.write_full_state_dict, state, checkpoint, shard=shard, prefix=prefix,
                size_per_shard=size_per_shard, use_safetensors=True,
            )  # fmt: skip
        else:
            self.async_writers.append(done_future())  # every rank waits (and meets the barrier) in _sync_io

    def load_model(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike[str],
        strict: bool = True,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> nn.Module:
        """Load a file, index JSON or directory written by :meth:`save_model` (or any HF-layout save; the format
        is read from the file) into ``model``, at any world size; returns ``model``.

        Then the plugin's ``after_model_load`` runs with the optimizers boosted together with ``model`` (a ZeRO
        plugin copies the loaded weights into its fp32 masters, so the next ``step()`` keeps them)."""
        self._sync_io()
        _model_io.load_model(plugin_module(model), checkpoint, strict=strict)
        self.plugin.after_model_load(plugin_module(model), self.optimizers_for(model))
        return model

    # -- optimizers ------------------------------------------------------------------------------------------
    def save_optimizer(
        self,
        optimizer: Any,
        checkpoint: str | os.PathLike[str],
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_async: bool = False,
    ) -> None:
        """Save a boosted optimizer (and its fp16 loss-scaler state) to directory ``checkpoint`` with
        ``torch.distributed.checkpoint``: every rank writes its shard; loads at another world size.
        ``shard``/``prefix``/``size_per_shard`` are accepted (DCP always writes per-rank files)."""
        model = self.model_for(optimizer)
        if model is None:
            self._save_plain_optimizer(optimizer, checkpoint, shard, prefix, use_async)
            return
        pending = _optim_io.save_optimizer(self.plugin, model, optimizer, checkpoint, use_async=use_async)
        if pending is not None:
            self.async_writers.append(pending)

    def load_optimizer(
        self,
        optimizer: Any,
        checkpoint: str | os.PathLike[str],
        prefix: str | None = None,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> None:
        """Load a save of :meth:`save_optimizer` (at any world size): every saved entry is restored or a
        ``ValueError`` says why and nothing changes."""
        self._sync_io()
        model = self.model_for(optimizer)
        if model is None:
            self._load_plain_optimizer(optimizer, checkpoint, prefix)
            return
        _optim_io.load_optimizer(self.plugin, model, optimizer, checkpoint)

    def _save_plain_optimizer(
        self, optimizer: Any, checkpoint: Any, shard: bool, prefix: str | None, use_async: bool
    ) -> None:
        raise ValueError(
            "save_optimizer: this optimizer was not returned by this Booster's boost(); pass the boosted "
            "optimizer (the one boost() returned), or save a plain optimizer with a plugin-less Booster or "
            "GeneralCheckpointIO()."
        )

    def _load_plain_optimizer(self, optimizer: Any, checkpoint: Any, prefix: str | None) -> None:
        raise ValueError(
            "load_optimizer: this optimizer was not returned by this Booster's boost(); pass the boosted "
            "optimizer (the one boost() returned), or load a plain optimizer with a plugin-less Booster or "
            "GeneralCheckpointIO()."
        )
