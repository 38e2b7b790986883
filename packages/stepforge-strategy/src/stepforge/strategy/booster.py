# SPDX-License-Identifier: Apache-2.0
"""``Booster``: ColossalAI's Booster surface on torch's engines (DDP, FSDP2, DCP, autocast).

::

    booster = Booster(mixed_precision="bf16", plugin="torch_ddp")
    model, optimizer, criterion, dataloader, lr_scheduler = booster.boost(
        model, optimizer, criterion, dataloader, lr_scheduler)
    loss = criterion(model(x), y)
    booster.backward(loss, optimizer)
    optimizer.step(); optimizer.zero_grad()
    booster.save_model(model, "ckpt/model", shard=True)
    booster.save_optimizer(optimizer, "ckpt/optimizer")
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from stepforge.core import PLUGINS, build_optimizer
from stepforge.core.precision import PLUGIN_PRECISIONS, warn_slow_precision

from . import _model_io, _optim_io
from .boosted_optimizer import BoostedOptimizer
from .data import make_stateful
from .mixed_precision import MixedPrecision, precision_name, resolve_mixed_precision
from .plugins._base import inner_optimizer

__all__ = ["Booster"]


def _accepts(cls: Any, name: str) -> bool:
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class Booster:
    """Apply a plugin (parallelism) and a mixed precision to models and optimizers.

    Args:
        mixed_precision: ``None``, ``"fp16"``, ``"bf16"``, ``"fp8"``, ``"fp16_apex"``, a dict
            (``dict(type="fp16", init_scale=2**12)``) or a :class:`~stepforge.strategy.MixedPrecision`.
        plugin: ``None`` (``single`` on one process, ``torch_ddp`` under a process group of several ranks),
            a registry name (``"torch_fsdp"``, ``"gemini"``, ``"low_level_zero"``...), a dict
            (``dict(type="LowLevelZeroPlugin", stage=2, precision="bf16")``) or a plugin instance.
        device: passed to a plugin built here when its constructor takes ``device``.

    A plugin built here from a name or a dict without ``precision`` gets ``precision=mixed_precision`` when
    its constructor takes it; a plugin whose precision was set explicitly and differs from
    ``mixed_precision`` is an error. Plugins without precision get the Booster's mixed precision
    (autocast on the forward, fp16 loss scaling on the optimizer).

    Raises:
        ValueError: a precision conflict, an unknown precision.
        UnknownNameError: an unknown plugin name (with ``pip install ...`` for known ones).
    """

    def __init__(
        self,
        mixed_precision: str | Mapping[str, Any] | MixedPrecision | None = None,
        plugin: str | Mapping[str, Any] | Any | None = None,
        *,
        device: str | torch.device | None = None,
    ) -> None:
        wanted = precision_name(mixed_precision)
        if mixed_precision is not None and wanted is None:
            resolve_mixed_precision(mixed_precision)  # raises the precise error
        self.plugin = self._build_plugin(plugin, mixed_precision, wanted, device)
        owned = getattr(self.plugin, "precision", None)
        if owned is not None:
            if wanted is not None and wanted != owned:
                raise ValueError(
                    f"Booster: mixed_precision={_show(mixed_precision)} conflicts with the precision "
                    f"{owned!r} of plugin {getattr(self.plugin, 'name', type(self.plugin).__name__)!r}, which "
                    "applies precision itself; set one of them, or the same value on both."
                )
            self.mixed_precision: MixedPrecision | None = None
        else:
            self.mixed_precision = resolve_mixed_precision(mixed_precision)
        self._models: dict[int, nn.Module] = {}  # id(boosted optimizer) -> boosted model

    # -- construction --------------------------------------------------------------------------------------
    @staticmethod
    def _build_plugin(plugin: Any, mixed_precision: Any, wanted: str | None, device: Any) -> Any:
        if plugin is None:
            plugin = "torch_ddp" if _world() > 1 else "single"
        if isinstance(plugin, str | Mapping):
            kwargs: dict[str, Any] = {}
            if isinstance(plugin, Mapping):
                kwargs = dict(plugin)
                name = kwargs.pop("type", None)
                if not isinstance(name, str):
                    raise ValueError(f"Booster: a plugin dict needs a 'type' name, got {dict(plugin)!r}.")
            else:
                name = plugin
            cls = PLUGINS.get(name)
            if "precision" not in kwargs and wanted is not None and _accepts(cls, "precision"):
                if wanted not in PLUGIN_PRECISIONS:
                    raise ValueError(
                        f"Booster: plugin {name!r} applies precision itself and takes "
                        f"{'/'.join(PLUGIN_PRECISIONS)}; mixed_precision={_show(mixed_precision)} is not one "
                        "of them."
                    )
                kwargs["precision"] = wanted
            if device is not None and "device" not in kwargs and _accepts(cls, "device"):
                kwargs["device"] = device
            return cls(**kwargs)
        if not (hasattr(plugin, "prepare") and hasattr(plugin, "get_state_dict")):
            raise TypeError(
                "Booster: plugin must be a name, a dict with 'type', or an object implementing "
                f"stepforge.core.Plugin (prepare, no_sync, get_state_dict...); got {type(plugin).__name__}."
            )
        adopt = getattr(plugin, "set_precision", None)
        unset = (
            getattr(plugin, "precision", None) is None
            or getattr(plugin, "_explicit_precision", True) is False
        )
        if wanted is not None and callable(adopt) and unset:
            if wanted not in PLUGIN_PRECISIONS:
                raise ValueError(
                    f"Booster: plugin {getattr(plugin, 'name', type(plugin).__name__)!r} applies precision "
                    f"itself and takes {'/'.join(PLUGIN_PRECISIONS)}; mixed_precision={_show(mixed_precision)} "
                    "is not one of them."
                )
            adopt(wanted)
        return plugin

    # -- boost ---------------------------------------------------------------------------------------------
    def boost(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Any = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple[nn.Module, Any, Any, Any, Any]:
        """Wrap the five for the plugin and the mixed precision; returns them in the same order.

        The optimizer comes back as a :class:`BoostedOptimizer` (``backward``, ``clip_grad_norm_``, loss
        scaling) unless the plugin returns its own optimizer with ``backward``; the dataloader comes back
        with ``state_dict``/``load_state_dict`` (the data position).
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"Booster.boost: model must be a torch.nn.Module, got {type(model).__name__}.")
        if isinstance(optimizer, Mapping) and not getattr(self.plugin, "builds_optimizer_config", False):
            optimizer = build_optimizer(dict(optimizer), model.parameters())
        if (
            optimizer is not None
            and not isinstance(optimizer, Mapping)
            and not hasattr(optimizer, "param_groups")
        ):
            raise TypeError(
                "Booster.boost: optimizer must be a torch.optim.Optimizer or a build_optimizer config dict, got "
                f"{type(optimizer).__name__}."
            )
        device = getattr(self.plugin, "device", torch.device("cpu"))
        effective = getattr(self.plugin, "precision", None) or (
            self.mixed_precision.name if self.mixed_precision is not None else None
        )
        warn_slow_precision(effective, device, where=f"Booster.boost(plugin={type(self.plugin).__name__})")
        if self.mixed_precision is not None:
            self.mixed_precision.configure_model(model, device)
        model, optimizer = self.plugin.prepare(
            model, optimizer, criterion=criterion, dataloader=dataloader, lr_scheduler=lr_scheduler
        )
        if optimizer is not None and not hasattr(optimizer, "backward"):
            scaler = self.mixed_precision.make_scaler() if self.mixed_precision is not None else None
            optimizer = BoostedOptimizer(
                optimizer,
                scaler=scaler,
                max_norm=float(getattr(self.plugin, "max_norm", 0.0) or 0.0),
                clip_fn=self._plugin_clip(model, optimizer),
            )
        if optimizer is not None:
            self._models[id(optimizer)] = model
        if dataloader is not None:
            dataloader = make_stateful(dataloader)
        return model, optimizer, criterion, dataloader, lr_scheduler

    def _plugin_clip(self, model: nn.Module, optimizer: Any) -> Any:
        clip = getattr(self.plugin, "clip_grad_norm_", None)
        if not callable(clip):
            return None
        return lambda max_norm, norm_type: clip(model, optimizer, max_norm, norm_type)

    # -- training ------------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, optimizer: Any) -> None:
        """Backward ``loss`` with the plugin's loss scaling (``plugin.backward``, else
        ``optimizer.backward``, else ``loss.backward()``)."""
        plugin_backward = getattr(self.plugin, "backward", None)
        if callable(plugin_backward):
            plugin_backward(loss, optimizer)
        elif hasattr(optimizer, "backward"):
            optimizer.backward(loss)
        else:
            loss.backward()

    def supports_no_sync(self) -> bool:
        """Whether the plugin can skip gradient synchronisation (for accumulation)."""
        return bool(self.plugin.supports_no_sync())

    def no_sync(self, model: nn.Module | None = None, optimizer: Any = None) -> AbstractContextManager[Any]:
        """Skip gradient synchronisation for the block (forward and backward inside).

        Raises:
            RuntimeError: the plugin cannot (ColossalAI's gemini, ZeRO-2/3): accumulate without no_sync.
        """
        if not self.plugin.supports_no_sync():
            raise RuntimeError(
                f"Booster.no_sync: plugin {getattr(self.plugin, 'name', type(self.plugin).__name__)!r} does not "
                "support no_sync; accumulate gradients without it (every micro-batch synchronises)."
            )
        return self.plugin.no_sync(model, optimizer)

    def clip_grad_norm_(
        self, optimizer: Any, max_norm: float, norm_type: float = 2.0, model: nn.Module | None = None
    ) -> torch.Tensor:
        """Clip by the global gradient norm over all ranks and shards (after unscaling); return the norm."""
        if hasattr(optimizer, "clip_grad_norm_"):
            return optimizer.clip_grad_norm_(max_norm, norm_type)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        return nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    # -- checkpoints ---------------------------------------------------------------------------------------
    def save_model(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike[str],
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_safetensors: bool = True,
        use_async: bool = False,
    ) -> None:
        """Save the full model in the Hugging Face layout (every rank calls; rank 0 writes).

        ``shard=False``: one file at ``checkpoint`` (a directory gets ``model.safetensors`` inside);
        ``shard=True``: directory ``checkpoint`` with files of at most ``size_per_shard`` MiB plus
        ``model.safetensors.index.json``. ``prefix`` prefixes the file names; ``use_safetensors=False``
        writes ``pytorch_model*.bin`` with ``torch.save`` instead.
        """
        if not gather_dtensor:
            raise ValueError(
                "Booster.save_model: gather_dtensor=False is not supported; full model saves are gathered "
                "(save sharded state with save_optimizer or stepforge.strategy's DCP checkpoints)."
            )
        if use_async:
            raise ValueError("Booster.save_model: use_async=True is not supported; saves are synchronous.")
        _model_io.save_model(
            model, checkpoint, shard=shard, prefix=prefix, size_per_shard=size_per_shard,
            use_safetensors=use_safetensors,
        )  # fmt: skip

    def load_model(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike[str],
        strict: bool = True,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> None:
        """Load a file or directory written by :meth:`save_model` (or any HF-layout safetensors/bin save)
        into the boosted ``model``, at any world size."""
        _model_io.load_model(model, checkpoint, strict=strict)

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
        """Save the optimizer (and fp16 loss-scaler) state to directory ``checkpoint`` with
        ``torch.distributed.checkpoint``: every rank writes its own shard; loads at another world size.

        ``shard``/``size_per_shard``/``prefix`` are accepted for ColossalAI compatibility (DCP always writes
        per-rank files); ``use_async=True`` uses ``dcp.async_save`` and waits before returning.
        """
        _optim_io.save_optimizer(
            self.plugin, self._model_for(optimizer), optimizer, checkpoint, use_async=use_async
        )

    def load_optimizer(
        self,
        optimizer: Any,
        checkpoint: str | os.PathLike[str],
        prefix: str | None = None,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> None:
        """Load a directory written by :meth:`save_optimizer` (at any world size) into ``optimizer``."""
        _optim_io.load_optimizer(self.plugin, self._model_for(optimizer), optimizer, checkpoint)

    def save_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
        """``torch.save(lr_scheduler.state_dict(), checkpoint)`` on rank 0 (every rank calls)."""
        _optim_io.save_lr_scheduler(lr_scheduler, checkpoint)

    def load_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
        """Load a file written by :meth:`save_lr_scheduler`."""
        _optim_io.load_lr_scheduler(lr_scheduler, checkpoint)

    def _model_for(self, optimizer: Any) -> nn.Module:
        model = self._models.get(id(optimizer))
        if model is None:
            raise ValueError(
                "Booster: this optimizer was not returned by this Booster's boost(); pass the boosted "
                "optimizer (the one boost() returned)."
            )
        return model

    @staticmethod
    def unwrap_optimizer(optimizer: Any) -> Any:
        """The torch optimizer under the Booster's wrapper."""
        return inner_optimizer(optimizer)

    def __repr__(self) -> str:
        return f"Booster(mixed_precision={self.mixed_precision!r}, plugin={self.plugin!r})"


def _show(spec: Any) -> str:
    return repr(spec if not isinstance(spec, MixedPrecision) else spec.name)
