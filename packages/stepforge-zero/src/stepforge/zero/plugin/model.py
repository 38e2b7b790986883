# SPDX-License-Identifier: Apache-2.0
"""The model side of :class:`~stepforge.zero.plugin.LowLevelZeroPlugin`: working dtypes, the wrapper that casts
inputs and waits for the optimizer's parameter gather, and the error for 16-bit operations torch cannot run on
CPU."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch

from stepforge.core import StepforgeError
from stepforge.core.precision import PLUGIN_PRECISIONS, get_precision

__all__ = [
    "PRECISIONS",
    "LowLevelZeroModel",
    "UnsupportedPrecisionError",
    "explain_precision_errors",
    "unwrap_prepared",
]

#: precision name -> working dtype of the model's parameters: the plugin precisions of
#: :data:`stepforge.core.precision.PRECISIONS` (the one table), read as ``{name: dtype}``.
PRECISIONS: dict[str, torch.dtype] = {name: get_precision(name).dtype for name in PLUGIN_PRECISIONS}


_LOW_PRECISION_UNSUPPORTED = re.compile(r"\b(Half|BFloat16)\b")


class UnsupportedPrecisionError(StepforgeError, RuntimeError):
    """An operation of the model cannot run in the plugin's precision on this device (fp16/bf16 on CPU)."""


@contextlib.contextmanager
def explain_precision_errors(device: torch.device, precision: str, where: str) -> Iterator[None]:
    """Turn torch's "not implemented for 'Half'" (or 'BFloat16') on CPU into an error naming the way out."""
    try:
        yield
    except (RuntimeError, NotImplementedError) as exc:
        if precision == "fp32" or device.type != "cpu" or not _LOW_PRECISION_UNSUPPORTED.search(str(exc)):
            raise
        if precision == "fp16":
            advice = (
                "Use precision='bf16' (bfloat16 on CPU, no loss scaling needed) or, for operations torch implements "
                "in neither 16-bit type on CPU (torch.cdist, pdist, linalg.qr in torch 2.13), precision='fp32'."
            )
        else:
            advice = "Use precision='fp32' for this model on CPU."
        raise UnsupportedPrecisionError(
            f"LowLevelZeroPlugin(precision={precision!r}): the model's {where} uses an operation torch cannot run "
            f"in {PRECISIONS[precision]} on CPU ({exc}). {advice}"
        ) from exc


class LowLevelZeroModel(torch.nn.Module):
    """The prepared model: the original module (``.module``) in the working dtype; floating-point tensor
    inputs are cast to that dtype before its forward (``cast_inputs``, ColossalAI's default ``True``)."""

    def __init__(
        self,
        module: torch.nn.Module,
        dtype: torch.dtype,
        precision: str,
        device: torch.device,
        *,
        cast_inputs: bool = True,
    ) -> None:
        super().__init__()
        self.module = module
        self.dtype = dtype
        self.precision = precision
        self.device = device
        self.cast_inputs = cast_inputs
        self._masters: Any = None  # the LowLevelZeroOptimizer prepared with this model, if any

    def bind_optimizer(self, optimizer: Any) -> None:
        """Remember the ``LowLevelZeroOptimizer`` prepared with this model (for :meth:`update_master_params`)."""
        self._masters = optimizer

    def update_master_params(self) -> None:
        """ColossalAI's ``model.update_master_params()``: copy this model's weights into the fp32 masters of
        the optimizer prepared with it (after loading weights by hand); nothing without one."""
        if self._masters is not None:
            self._masters.update_master_params(self.module)

    def wait_for_param_gather(self) -> None:
        """Finish the optimizer's overlapped parameter gather (``overlap_allgather``), if one is in flight, so
        the weights are the last step's (ColossalAI's ``_force_wait_all_gather``)."""
        if self._masters is not None:
            self._masters.wait_for_param_gather()

    def _force_wait_all_gather(self) -> None:
        """ColossalAI's name of :meth:`wait_for_param_gather` (its checkpoint IO calls it before reading or
        loading the weights)."""
        self.wait_for_param_gather()

    def unwrap(self) -> torch.nn.Module:
        """The wrapped module (its state dict has the original keys), its weights up to date."""
        self.wait_for_param_gather()
        return self.module

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """``torch.nn.Module.state_dict`` once the weights are up to date (see :meth:`wait_for_param_gather`)."""
        self.wait_for_param_gather()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """``torch.nn.Module.load_state_dict`` after any gather in flight landed (it would overwrite the load)."""
        self.wait_for_param_gather()
        return super().load_state_dict(*args, **kwargs)

    def _cast(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != self.dtype:
            return value.to(self.dtype)
        if isinstance(value, list | tuple):
            return type(value)(self._cast(v) for v in value)
        if isinstance(value, dict):
            return {k: self._cast(v) for k, v in value.items()}
        return value

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.cast_inputs:
            args, kwargs = self._cast(args), self._cast(kwargs)
        with explain_precision_errors(self.device, self.precision, "forward"):
            return self.module(*args, **kwargs)


def unwrap_prepared(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a :class:`LowLevelZeroModel` (after its gather landed), else ``model`` itself."""
    return model.unwrap() if isinstance(model, LowLevelZeroModel) else model
