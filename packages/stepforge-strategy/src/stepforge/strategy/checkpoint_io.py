# SPDX-License-Identifier: Apache-2.0
"""``CheckpointIO``, ``BoosterCheckpointIO`` and ``GeneralCheckpointIO``: ColossalAI's checkpoint objects
(``booster.checkpoint_io``), a thin layer with ColossalAI's method names and signatures over
:mod:`stepforge.strategy.checkpoint`, where every save and load lives.

The path a save is given is the save's: a file there is replaced (atomically: the old one stays whole if the
save fails), a directory receives the save's files and keeps the user's other files (``config.json`` of the
Hugging Face workflow). Directories the user did not name (the working directory, ``""``, ``"."``, ``".."``) are
refused.

``use_async=True`` returns once the state is staged (copied away from the live tensors) and the target checked;
the files are written in the background by the process's one writer thread, whose collectives (DCP's, the commit,
the ranks agreeing on the outcome) run on a process group of their own. As in ColossalAI, the next ``save_model`` waits for every pending write first
(``_sync_io``), ``_sync_d2h``/``synchronize()`` is the point before the weights change (staging is already done
when ``save_*`` returns, so it returns at once). A failed write raises the same ``CheckpointError`` on every rank
at the wait. At interpreter exit, and when the object is garbage collected, pending writes are finished and the
writer thread is joined.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any

from torch import nn

from stepforge.core import BoostedOptimizer, Plugin

from . import checkpoint as ckpt
from .boosted_model import plugin_module
from .checkpoint import PendingWrites, commit_files, staged

__all__ = ["CheckpointIO", "BoosterCheckpointIO", "GeneralCheckpointIO"]


class CheckpointIO(ABC):
    """ColossalAI's checkpoint interface: save/load of models, optimizers and lr schedulers, with the
    asynchronous-write bookkeeping (``async_writers``, ``_sync_io``, ``_sync_d2h``, ``synchronize``)."""

    @property
    def _pending(self) -> PendingWrites:
        # created on first use: a subclass that does not call CheckpointIO.__init__ waits correctly too
        writes = self.__dict__.get("_writes")
        if writes is None:
            writes = self._writes = PendingWrites()
        return writes

    @property
    def async_writers(self) -> list[Future[Any]]:
        """The pending asynchronous writes (one entry per ``use_async=True`` save, on every rank)."""
        return self._pending.futures

    # -- asynchronous writes ---------------------------------------------------------------------------------
    def _sync_io(self) -> None:
        """Wait for every pending background save. The ranks agreed on each save's outcome in the background, so
        a failure on any rank raises the same ``CheckpointError`` on every rank here (no collective)."""
        self._pending.wait()

    def _sync_d2h(self) -> None:  # noqa: B027 (deliberately empty: staging is synchronous)
        """Wait until pending writes no longer read the live tensors: staging finishes before ``save_*``
        returns, so there is nothing to wait for."""

    def synchronize(self) -> None:
        """ColossalAI's point before the weights change (``_sync_d2h``)."""
        self._sync_d2h()

    def __del__(self) -> None:
        # no collective here: a finaliser runs at a different moment on each rank; it never raises
        writes = self.__dict__.get("_writes")
        if writes is not None:
            writes.close()

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
        """``torch.save(lr_scheduler.state_dict())`` to file ``checkpoint`` on rank 0 (every rank calls; an
        existing file there is replaced atomically)."""
        ckpt.save_lr_scheduler(lr_scheduler, checkpoint)

    def load_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
        """Load a file written by :meth:`save_lr_scheduler` (no code runs from it)."""
        ckpt.load_lr_scheduler(lr_scheduler, checkpoint)

    def save_lora_as_pretrained(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike[str],
        use_safetensors: bool = False,
        state_dict: dict[str, Any] | None = None,
    ) -> None:
        """Write the LoRA adapters and their config (peft's ``save_pretrained``) into directory ``checkpoint``
        on rank 0, through the one writer (the directory's other files stay); every rank calls. ``ValueError``
        when the model has no LoRA adapters (``Booster.enable_lora`` before ``boost``)."""
        from .boosted_model import peft_model_of

        peft_model = peft_model_of(model)

        def write(tmp: str) -> None:
            state = staged(peft_model.state_dict()) if state_dict is None else state_dict
            peft_model.save_pretrained(tmp, safe_serialization=use_safetensors, state_dict=state)

        commit_files(
            checkpoint, write, arg="checkpoint", where="save_lora_as_pretrained", meta={"kind": "lora"}
        )


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
        ``checkpoint`` (a directory gets ``model.safetensors``/``pytorch_model.bin`` inside; an existing file is
        replaced atomically); ``shard=True``: files of at most ``size_per_shard`` MiB and an index JSON into
        directory ``checkpoint`` (its other files, such as ``config.json``, stay). ``prefix`` prefixes the file
        names. ``use_async`` writes safetensors (as ColossalAI) in the background."""
        self._sync_io()
        if not gather_dtensor:
            raise ValueError(
                "save_model: gather_dtensor=False is not supported; full model saves are gathered (save sharded "
                "state with save_optimizer or stepforge.strategy's DCP checkpoints)."
            )
        ckpt.save_model(
            plugin_module(model), checkpoint, shard=shard, prefix=prefix, size_per_shard=size_per_shard,
            use_safetensors=use_safetensors, pending=self._pending if use_async else None,
        )  # fmt: skip

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
        ckpt.load_model(plugin_module(model), checkpoint, strict=strict)
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
        """Save a boosted optimizer (and its fp16 loss-scaler state), keyed by parameter name in every plugin:
        ``shard=True``: directory ``checkpoint`` through ``torch.distributed.checkpoint``; ``shard=False``
        (ColossalAI's default): the full state gathered into the one file ``checkpoint``. Either loads under any
        plugin at any world size; ``prefix``/``size_per_shard`` apply to plain optimizers only."""
        model = self.model_for(optimizer)
        pending = self._pending if use_async else None
        if model is not None:
            ckpt.save_optimizer(self.plugin, model, optimizer, checkpoint, shard=shard, pending=pending)
            return
        self._require_plain("save_optimizer")
        ckpt.save_plain_optimizer(
            optimizer, checkpoint, shard=shard, prefix=prefix, size_per_shard=size_per_shard, pending=pending
        )

    def load_optimizer(
        self,
        optimizer: Any,
        checkpoint: str | os.PathLike[str],
        prefix: str | None = None,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> None:
        """Load a save of :meth:`save_optimizer` (a file or a directory; under any plugin, at any world size):
        every saved entry is restored or a ``ValueError`` says why and nothing changes."""
        self._sync_io()
        model = self.model_for(optimizer)
        if model is not None:
            ckpt.load_optimizer(self.plugin, model, optimizer, checkpoint)
            return
        self._require_plain("load_optimizer")
        ckpt.load_plain_optimizer(optimizer, checkpoint, prefix)

    #: whether optimizers ``boost`` did not wrap are saved and loaded (:class:`GeneralCheckpointIO`)
    _plain_optimizers = False

    def _require_plain(self, what: str) -> None:
        if not self._plain_optimizers:
            raise ValueError(
                f"{what}: this optimizer was not returned by this Booster's boost(); pass the boosted optimizer "
                "(the one boost() returned), or use a plain optimizer with a plugin-less Booster or "
                "GeneralCheckpointIO()."
            )


class GeneralCheckpointIO(BoosterCheckpointIO):
    """ColossalAI's ``GeneralCheckpointIO``: the checkpoint IO of a plugin-less Booster, also usable on its own
    (``plugin=None`` uses ``single``). Besides what :class:`BoosterCheckpointIO` does, it saves an optimizer that
    ``boost`` did not wrap as its ``state_dict()`` in ColossalAI's layouts (one file, or a sharded directory with
    ``[prefix-]pytorch_optim.bin.index.json``) and loads it with ``optimizer.load_state_dict``."""

    def __init__(self, plugin: Plugin | None = None) -> None:
        if plugin is None:
            from .plugins.single import SinglePlugin

            plugin = SinglePlugin()
        super().__init__(plugin)

    _plain_optimizers = True
