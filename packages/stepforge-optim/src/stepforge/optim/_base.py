# SPDX-License-Identifier: Apache-2.0
"""Common ``torch.optim.Optimizer`` behaviour of :class:`Lamb` and :class:`Lars`: checks where values enter,
read-only gradients, buckets, and a ``load_state_dict`` that keeps fp32 state for low-precision parameters.

``torch.compile``: dynamo traces ``step()``, which sees :func:`torch.compiler.is_compiling`. Dynamo runs the
optimizer's ``_init_group(group, True, <empty lists>...)`` eagerly while tracing (checks, state creation,
bucketing) and takes its return value, the bucket plan, as a constant; the eager step calls the same
``_init_group`` with ``False``. Compiled, a bucket is one wave of whole tensors (inductor fuses the passes, so
the CPU's cache-sized waves are not needed) and a tensor ``lr`` is read by the graph, so an LR scheduler does
not recompile the step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from itertools import chain
from typing import Any

import torch

from stepforge.core import (
    GroupValidator,
    HyperParameterError,
    check_bool,
    check_float_dtype,
    check_grad,
    check_lr,
    check_positive_int,
)
from stepforge.core.torch_compat import is_dtensor

from ._multi_tensor import split_segments

__all__ = ["MultiTensorOptimizer", "lr_of", "math_dtype_of", "zeros_state"]

_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def math_dtype_of(dtype: torch.dtype) -> torch.dtype:
    """The compute and state dtype for parameters of ``dtype``: fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def zeros_state(p: torch.Tensor) -> torch.Tensor:
    """A new state tensor for ``p``: zeros of its math dtype, contiguous (waves take flat views of state)."""
    return torch.zeros_like(p, dtype=math_dtype_of(p.dtype), memory_format=torch.contiguous_format)


def lr_of(group: Mapping[str, Any], compiled: bool) -> Any:
    """The update's learning rate: the group's, read by the graph when compiled; eagerly a float (a tensor lr
    is read once per step; on a device that read synchronises, so keep a tensor lr for eager steps on the CPU)."""
    lr = group["lr"]
    return float(lr) if isinstance(lr, torch.Tensor) and not compiled else lr


class MultiTensorOptimizer(torch.optim.Optimizer):
    """Base class. Subclasses set :attr:`STATE_TENSORS` (state keys holding per-parameter tensors) and
    :attr:`STATE_SCALARS`, extend :meth:`_validate_group` and implement :meth:`_step`."""

    OWNER = "MultiTensorOptimizer"
    STATE_TENSORS: tuple[str, ...] = ()
    STATE_SCALARS: tuple[str, ...] = ()

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        # groups (defaults filled in) are checked where they enter and re-checked when edited
        self._groups = GroupValidator(self._validate_group, owner=self.OWNER)
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._groups = GroupValidator(self._validate_group, owner=self.OWNER)

    def _validate_group(self, group: Mapping[str, Any]) -> None:
        """The checks of the options both optimizers have; subclasses extend it with their own."""
        owner, lr = self.OWNER, group["lr"]
        # a tensor lr (torch.optim's) is written in place by an LR scheduler: a compiled step does not recompile
        if isinstance(lr, torch.Tensor) and not lr.is_floating_point():
            raise HyperParameterError(
                f"{owner}: a tensor lr must be floating point, got {lr.dtype}; pass e.g. torch.tensor(1e-3)."
            )
        check_lr(lr, owner=owner)
        if group["foreach"] is not None:
            check_bool("foreach", group["foreach"], owner=owner)
        check_bool("maximize", group["maximize"], owner=owner)
        if check_bool("differentiable", group["differentiable"], owner=owner):
            raise HyperParameterError(
                f"{owner}: differentiable=True is not supported: the update runs in place on cache-sized pieces "
                "of the parameters, which autograd cannot follow. Use a functional optimizer (torch.func) to "
                "differentiate through optimizer steps."
            )
        if group["chunk_size"] is not None:
            check_positive_int("chunk_size", group["chunk_size"], owner=owner)

    def _step(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its hyper-parameters (after filling defaults) are validated like the constructor's."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._groups.validate(group, len(self.param_groups) - 1)
            for p in group["params"]:
                check_float_dtype("a parameter", p, allowed=_PARAM_DTYPES, owner=self.OWNER)
        except Exception:
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient; ``closure`` (called with gradients enabled)
        re-evaluates the model, and its loss is returned."""
        if not torch.compiler.is_compiling():  # compiled: _init_group, which dynamo runs eagerly, checks
            self._groups.revalidate(self.param_groups)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step()
        return loss

    def _buckets(
        self,
        group: Mapping[str, Any],
        compiled: bool,
        key: Callable[[torch.Tensor], Any] = lambda p: None,
    ) -> list[list[torch.Tensor]]:
        """The group's parameters that have a gradient (each checked), in buckets one ``torch._foreach_*`` call
        takes (same device, dtypes, DTensor mesh and placements, and ``key``): eagerly on CPU cut into segments,
        one tensor each with ``foreach=False``; compiled, whole buckets of plain tensors."""
        if compiled:
            self._groups.revalidate(self.param_groups)
        by_key: dict[Any, list[torch.Tensor]] = {}
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if compiled and is_dtensor(p):
                raise RuntimeError(
                    f"{self.OWNER}: parameter #{i} is a DTensor (FSDP2); its norms need a reduction over the mesh, "
                    "which a compiled step() does not do. Call optimizer.step() outside torch.compile for sharded "
                    "parameters."
                )
            check_grad(p, owner=self.OWNER)
            mesh = (id(p.device_mesh), tuple(str(x) for x in p.placements)) if is_dtensor(p) else None
            by_key.setdefault((p.device, p.dtype, p.grad.dtype, mesh, key(p)), []).append(p)
        if compiled:
            return list(by_key.values())
        if group["foreach"] is False:
            return [[p] for ps in by_key.values() for p in ps]
        return [seg for ps in by_key.values() for seg in split_segments(ps, group["chunk_size"])]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict (also one saved by ``torch.optim`` or ColossalAI with the same state names).

        Unlike ``torch.optim.Optimizer``, state tensors keep their fp32 dtype for fp16/bf16 parameters (they
        are moved to the parameter's device), tensor ``step`` values become ints, and per-parameter keys this
        optimizer does not use (e.g. ColossalAI ``Lamb``'s ``trust_ratio``) are dropped.
        """
        saved_state = state_dict["state"]
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        loaded: dict[torch.Tensor, dict[str, Any]] = {}
        # every entry is converted (and state of other parameters refused) before anything changes
        for i, (saved_id, param) in enumerate(zip(saved_ids, params, strict=False)):
            if saved_id not in saved_state:
                continue
            entry: dict[str, Any] = {}
            for key, value in saved_state[saved_id].items():
                if key in self.STATE_TENSORS and isinstance(value, torch.Tensor):
                    if value.shape != param.shape:
                        raise ValueError(
                            f"{self.OWNER}.load_state_dict: state[{key!r}] of parameter #{i} has shape "
                            f"{tuple(value.shape)}, the parameter {tuple(param.shape)}; the state belongs to "
                            "other parameters."
                        )
                    entry[key] = zeros_state(param).copy_(value.detach())
                elif key in self.STATE_SCALARS:
                    entry[key] = int(value)
            loaded[param] = entry
        super().load_state_dict({**state_dict, "state": {}})
        self.state.update(loaded)
