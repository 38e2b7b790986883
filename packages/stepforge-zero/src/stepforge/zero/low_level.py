# SPDX-License-Identifier: Apache-2.0
"""``LowLevelZeroOptimizer``: ZeRO-1/2 over ``torch.distributed`` with fp32 masters, loss scaling and CPU offload.

::

    opt = LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), stage=2)
    for batch in loader:
        opt.backward(model(batch).loss)      # or loss.backward() when no fp16 loss scaling is needed
        opt.step()
        opt.zero_grad()

Each rank holds only its piece (``torch.chunk`` layout, see :mod:`stepforge.zero._partition`) of every
parameter's master weights, gradient and optimizer state; the inner optimizer steps those pieces, and the
updated pieces are all-gathered into the working parameters (one collective per (param group, dtype)).
Gradients are averaged over the ranks as DDP does. See ``docs/low_level.md`` for the trade-offs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from stepforge.core import HyperParameterError

from . import _full_state, _sharded_state
from ._buckets import GradReducer
from ._comm import all_gather, gather_by_broadcast
from ._grad_norm import check_clip_args, clip_, global_norm
from ._loss_scaler import DynamicLossScaler
from ._offload import cpu_step_error, resolve_optimizer
from ._partition import build_partitions

__all__ = ["LowLevelZeroOptimizer"]


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise HyperParameterError(
            f"LowLevelZeroOptimizer: {name} must be an int >= {minimum}, got {value!r}."
        )
    return value


class LowLevelZeroOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 or 2 around any optimizer whose param groups hold the model's working parameters.

    Args:
        optimizer: a built optimizer (``torch.optim``, stepforge, ...) over the working parameters, or a
            registry config such as ``dict(type="FusedAdam", lr=1e-3)`` together with ``params``.
        params: the parameters (module, tensors or param-group dicts) for a config ``optimizer``.
        stage: 1 (gradients all-reduced, each rank keeps its piece) or 2 (gradients reduce-scattered from
            backward hooks, no rank holds more than its pieces plus the buckets in flight).
        reduce_bucket_size: elements per gradient bucket (ColossalAI's unit; padded element count).
        overlap_communication: launch the bucket reductions asynchronously during backward.
        cpu_offload: keep masters, gradient pieces and optimizer state on the CPU and step them there
            (an Adam-family config becomes stepforge-fused's ``CPUAdam`` when installed).
        master_weights: fp32 masters for fp16/bf16 working parameters (else the working dtype is stepped).
        max_norm: clip the global gradient norm to this value in every :meth:`step` (0: no clipping).
        initial_scale: the dynamic loss scaler's setting (used for fp16, see ``dtype_for_loss_scaling``).
        min_scale: the dynamic loss scaler's setting (used for fp16, see ``dtype_for_loss_scaling``).
        growth_factor: the dynamic loss scaler's setting (used for fp16, see ``dtype_for_loss_scaling``).
        backoff_factor: the dynamic loss scaler's setting (used for fp16, see ``dtype_for_loss_scaling``).
        growth_interval: the dynamic loss scaler's setting (used for fp16, see ``dtype_for_loss_scaling``).
        hysteresis: the dynamic loss scaler's setting (used for fp16, see ``dtype_for_loss_scaling``).
        max_scale: the dynamic loss scaler's setting (used for fp16, see ``dtype_for_loss_scaling``).
        process_group: the data-parallel group (``None``: the default group; no group at all: one rank).
        dtype_for_loss_scaling: ``"fp16"`` forces loss scaling, ``None`` turns it on when a working parameter
            is fp16.
        param_gather: how updated pieces reach every rank: ``"all_gather"`` (one ``all_gather_into_tensor``
            per partition), ``"broadcast"`` (one broadcast per rank and partition; gloo's broadcast is several
            times faster than its all-gather on the CPU), ``None``: broadcast on gloo, all-gather elsewhere.

    Attributes:
        last_step_skipped: whether the last :meth:`step` was skipped for an fp16 overflow.
        skipped_steps: how many steps were skipped so far.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | Mapping[str, Any],
        params: Any = None,
        *,
        stage: int = 1,
        reduce_bucket_size: int = 12 * 1024**2,
        overlap_communication: bool = True,
        cpu_offload: bool = False,
        master_weights: bool = True,
        max_norm: float = 0.0,
        initial_scale: float = 2**16,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        process_group: Any = None,
        dtype_for_loss_scaling: str | None = None,
        param_gather: str | None = None,
    ) -> None:
        if stage not in (1, 2) or isinstance(stage, bool):
            raise HyperParameterError(f"LowLevelZeroOptimizer: stage must be 1 or 2, got {stage!r}.")
        _check_int("reduce_bucket_size", reduce_bucket_size, 1)
        if not isinstance(max_norm, int | float) or isinstance(max_norm, bool) or not max_norm >= 0:
            raise HyperParameterError(
                f"LowLevelZeroOptimizer: max_norm must be a number >= 0 (0 disables clipping), got {max_norm!r}."
            )
        if dtype_for_loss_scaling not in (None, "fp16"):
            raise HyperParameterError(
                "LowLevelZeroOptimizer: dtype_for_loss_scaling must be None (automatic: on for fp16 params) or "
                f"'fp16', got {dtype_for_loss_scaling!r}."
            )
        if param_gather not in (None, "all_gather", "broadcast"):
            raise HyperParameterError(
                "LowLevelZeroOptimizer: param_gather must be None (automatic), 'all_gather' or 'broadcast', got "
                f"{param_gather!r}."
            )
        inner = resolve_optimizer(optimizer, params, cpu_offload=cpu_offload)
        if inner.state:
            raise HyperParameterError(
                "LowLevelZeroOptimizer: the inner optimizer already has state; wrap it before its first step and "
                "restore checkpoints through LowLevelZeroOptimizer.load_state_dict."
            )
        if dist.is_available() and dist.is_initialized():
            self._world = dist.get_world_size(process_group)
            self._rank = dist.get_rank(process_group)
        elif process_group is not None:
            raise HyperParameterError(
                "LowLevelZeroOptimizer: process_group was given but torch.distributed is not initialised; call "
                "torch.distributed.init_process_group first."
            )
        else:
            self._world, self._rank = 1, 0
        self.process_group = process_group
        if param_gather is None:
            gloo = self._world > 1 and dist.get_backend(process_group) == "gloo"
            param_gather = "broadcast" if gloo else "all_gather"
        self.param_gather = param_gather
        self.stage = stage
        self.reduce_bucket_size = reduce_bucket_size
        self.overlap_communication = bool(overlap_communication)
        self.cpu_offload = bool(cpu_offload)
        self.master_weights = bool(master_weights)
        self.max_norm = float(max_norm)
        self.optim = inner

        working_groups = [dict(g) for g in inner.param_groups]
        super().__init__([{**g, "params": list(g["params"])} for g in working_groups], dict(inner.defaults))
        self._built = True
        self._slots, self._partitions = build_partitions(
            self.param_groups,
            self._world,
            self._rank,
            master_weights=self.master_weights,
            master_device=torch.device("cpu") if self.cpu_offload else None,
        )
        for g, group in enumerate(inner.param_groups):
            group["params"] = [s.master for s in self._slots if s.group == g and s.valid > 0]
        invalidate = getattr(inner, "invalidate_cache", None)
        if callable(invalidate):
            invalidate()
        self._reducer = GradReducer(
            self._slots,
            stage=stage,
            bucket_size=reduce_bucket_size,
            overlap=self.overlap_communication,
            group=process_group,
            world_size=self._world,
            rank=self._rank,
        )
        fp16 = any(s.param.dtype == torch.float16 for s in self._slots)
        self._scaling = dtype_for_loss_scaling == "fp16" or fp16
        self.scaler = DynamicLossScaler(
            initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis, max_scale
        )
        self._unscaled = False
        self._stepped_on_cpu = False
        self.last_step_skipped = False
        self.skipped_steps = 0
        self._comm_device = self._slots[0].param.device if self._slots else torch.device("cpu")

    # -- public flags --------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Ranks in the data-parallel group."""
        return self._world

    @property
    def rank(self) -> int:
        """This process's rank in the data-parallel group."""
        return self._rank

    @property
    def require_grad_sync(self) -> bool:
        """Whether backward reduces gradients (``False`` inside :meth:`no_sync`; a plugin may set it)."""
        return self._reducer.enabled

    @require_grad_sync.setter
    def require_grad_sync(self, value: bool) -> None:
        self._reducer.enabled = bool(value)

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 when no loss scaling is in use)."""
        return self.scaler.scale if self._scaling else 1.0

    @property
    def collective_counts(self) -> Any:
        """How many gradient reduce-scatters / all-reduces were launched so far."""
        return self._reducer.counter

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: the partitions are fixed once built."""
        if getattr(self, "_built", False):
            raise RuntimeError(
                "LowLevelZeroOptimizer: parameters are partitioned at construction; add the group to the inner "
                "optimizer before wrapping it."
            )
        super().add_param_group(param_group)

    # -- backward ------------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, scaled by the loss scale when fp16 loss scaling is on."""
        if self._scaling:
            loss = loss * self.scaler.scale
        loss.backward(**kwargs)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor, **kwargs: Any) -> None:
        """``torch.autograd.backward(tensor, grad)`` with ``grad`` scaled by the loss scale (fp16)."""
        if self._scaling:
            grad = grad * self.scaler.scale
        torch.autograd.backward(tensor, grad, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate full local gradients in ``param.grad``; the next synchronised backward (or :meth:`step`)
        reduces the whole window once. Costs full-gradient memory for the window."""
        previous = self.require_grad_sync
        self.require_grad_sync = False
        try:
            yield
        finally:
            self.require_grad_sync = previous

    # -- gradients -----------------------------------------------------------------------------------------
    def _sync_grads(self) -> None:
        if self.require_grad_sync:
            self._reducer.flush_local()
        else:
            self._reducer.wait()

    def _grads(self) -> list[torch.Tensor]:
        return [s.grad for s in self._slots if s.grad is not None and s.grad.numel() > 0]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the reduced gradient pieces and any local ``param.grad`` (waits for reductions in flight)."""
        self._reducer.discard()
        for slot in self._slots:
            if set_to_none or slot.grad is None:
                slot.grad = None
            else:
                slot.grad.zero_()
            slot.param.grad = None
        self._unscaled = False

    def scale_grads_(self, factor: float) -> None:
        """Multiply every gradient the next step will use by ``factor`` (stepforge-accum's window weight)."""
        self._sync_grads()
        for grad in self._grads():
            grad.mul_(factor)
        for slot in self._slots:
            if slot.param.grad is not None:
                slot.param.grad.mul_(factor)

    def _all_reduce(self, value: torch.Tensor, op: Any) -> torch.Tensor:
        if self._world > 1:
            value = value.to(self._comm_device)
            dist.all_reduce(value, op=op, group=self.process_group)
        return value.cpu()

    def _unscale(self) -> None:
        if self._scaling and not self._unscaled:
            inv = 1.0 / self.scaler.scale
            for grad in self._grads():
                grad.mul_(inv)
        self._unscaled = True

    def _found_overflow(self) -> bool:
        local = any(not bool(torch.isfinite(g).all()) for g in self._grads())
        flag = self._all_reduce(torch.tensor([1.0 if local else 0.0]), dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm over every rank's gradient pieces (one small all-reduce); returns that norm.

        Same rule as ``torch.nn.utils.clip_grad_norm_``: gradients are multiplied by
        ``min(1, max_norm / (norm + 1e-6))``. With fp16 loss scaling the gradients are unscaled first.
        """
        norm_type = check_clip_args(max_norm, norm_type)
        self._sync_grads()
        self._unscale()
        grads = self._grads()
        norm = global_norm(grads, norm_type, self._all_reduce)
        clip_(grads, norm, max_norm)
        return norm

    # -- step ----------------------------------------------------------------------------------------------
    def _push_hyperparameters(self) -> None:
        # edits between steps (schedulers, users) live in our groups: push them before the inner step ...
        for ours, theirs in zip(self.param_groups, self.optim.param_groups, strict=True):
            for key, value in ours.items():
                if key != "params":
                    theirs[key] = value

    def _pull_hyperparameters(self) -> None:
        # ... and whatever the inner optimizer keeps in its groups (a per-group step count) comes back after
        for ours, theirs in zip(self.param_groups, self.optim.param_groups, strict=True):
            for key, value in theirs.items():
                if key != "params":
                    ours[key] = value

    @torch.no_grad()
    def _all_gather_params(self) -> None:
        for part in self._partitions:
            local = torch.zeros(part.size, dtype=part.dtype, device=part.device)
            for slot in part.slots:
                if slot.valid:
                    local[slot.offset : slot.offset + slot.valid].copy_(slot.master)
            if self._world == 1:
                table = local.view(1, part.size)
            elif self.param_gather == "broadcast":
                table = gather_by_broadcast(local, self._rank, self._world, group=self.process_group)
            else:
                table = torch.empty((self._world, part.size), dtype=part.dtype, device=part.device)
                all_gather(table.view(-1), local, group=self.process_group)
            for slot in part.slots:
                full = table[:, slot.offset : slot.offset + slot.piece].reshape(-1)[: slot.numel]
                slot.param.copy_(full.view_as(slot.param))

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Reduce what is pending, skip on fp16 overflow (every rank), unscale, clip (``max_norm``), step the
        pieces with the inner optimizer and all-gather them into the working parameters."""
        if not self.require_grad_sync:
            raise RuntimeError(
                "LowLevelZeroOptimizer.step() was called inside no_sync(); step after the block, once the "
                "window's last backward ran with synchronisation on."
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_grads()
        if self._scaling:
            if self._found_overflow():
                self.scaler.update(True)
                self.zero_grad(set_to_none=True)
                self.last_step_skipped = True
                self.skipped_steps += 1
                return loss
            self._unscale()
        if self.max_norm > 0:
            self.clip_grad_norm_(self.max_norm)
        self._push_hyperparameters()
        for slot in self._slots:
            if slot.valid:
                slot.master.grad = slot.grad
        try:
            self.optim.step()
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            if self.cpu_offload and not self._stepped_on_cpu:
                raise cpu_step_error(self.optim, exc) from exc
            raise
        finally:
            for slot in self._slots:
                slot.master.grad = None
        self._stepped_on_cpu = True
        self._pull_hyperparameters()
        self._all_gather_params()
        if self._scaling:
            self.scaler.update(False)
        self._unscaled = False
        self.last_step_skipped = False
        return loss

    @torch.no_grad()
    def update_master_params(self) -> None:
        """Copy the working parameters into the master pieces (after loading model weights)."""
        for slot in self._slots:
            if slot.valid and slot.separate_master:
                piece = slot.param.detach().reshape(-1)[slot.start : slot.start + slot.valid]
                slot.master.copy_(piece)

    # -- state dicts ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The full state in ``torch.optim`` layout keyed by global parameter index (collective: every rank
        must call it; every rank gets the full state). Extra key ``"zero"``: loss scaler, skip counter and
        the fp32 masters of low-precision parameters."""
        return _full_state.full_state_dict(self)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a full state (from :meth:`state_dict` at any world size, or a plain ``torch.optim`` one)."""
        _full_state.load_full_state_dict(self, state_dict)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's pieces as 1-D ``DTensor`` (``Shard(0)``) for ``torch.distributed.checkpoint``; no
        gathering. For a never-stepped optimizer the state tensors are created for the result (a zero-lr step
        on zero gradients, as ``torch.distributed.checkpoint.state_dict`` does) and then dropped from the
        optimizer, so the result is a template for ``dcp.load`` and the optimizer stays unstepped."""
        return _sharded_state.sharded_state_dict(self)

    def load_sharded_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load :meth:`sharded_state_dict`'s form after ``torch.distributed.checkpoint.load`` filled it."""
        _sharded_state.load_sharded_state_dict(self, state_dict)

    def __repr__(self) -> str:
        return (
            f"LowLevelZeroOptimizer(stage={self.stage}, world_size={self._world}, "
            f"cpu_offload={self.cpu_offload}, inner={type(self.optim).__name__})"
        )
