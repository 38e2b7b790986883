# SPDX-License-Identifier: Apache-2.0
"""The model a ``FlexibleRunner`` drives under :class:`~stepforge.mmengine.StepforgeStrategy`.

mmengine's loops call ``runner.model.train_step(data, optim_wrapper=...)``, ``val_step`` and ``test_step``;
the Booster returns a plain ``nn.Module`` (or a DDP/FSDP2 one) that has no such methods.
:class:`StepforgeModelWrapper` adds them around the boosted model as mmengine's ``ColossalAIModelWrapper`` does:
the data preprocessor and the forward run inside ``optim_wrapper.optim_context(boosted)`` (so a non-final
micro-batch skips gradient sync), then ``parse_losses`` and ``update_params``. It is registered in mmengine's
``MODEL_WRAPPERS``, so ``is_model_wrapper(runner.model)`` holds and ``runner.model.module`` is the raw model.
"""

from __future__ import annotations

from typing import Any

import torch
from mmengine.model import BaseModel
from torch import nn

__all__ = ["StepforgeModelWrapper"]


class StepforgeModelWrapper:
    """``train_step``/``val_step``/``test_step`` for a boosted mmengine ``BaseModel``.

    Args:
        boosted: what ``Booster.boost`` returned for ``module`` (the module itself, DDP or FSDP2).
        module: the mmengine ``BaseModel`` (its ``data_preprocessor`` and ``parse_losses`` are used).

    Attribute access falls through to ``boosted``, then ``module`` (``train()``, ``eval()``, ``parameters()``...).
    """

    def __init__(self, boosted: nn.Module, module: nn.Module) -> None:
        if not isinstance(module, BaseModel):
            raise TypeError(
                "StepforgeStrategy: the model must be an mmengine BaseModel (it needs data_preprocessor and "
                f"parse_losses for train_step), got {type(module).__name__}; subclass mmengine.model.BaseModel"
            )
        self.boosted = boosted
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.boosted(*args, **kwargs)

    def train_step(
        self, data: dict[str, Any] | tuple[Any, ...] | list[Any], optim_wrapper: Any
    ) -> dict[str, torch.Tensor]:
        """One micro-batch: preprocess, forward in ``optim_context``, parse the losses, ``update_params``.

        Returns:
            the log variables of ``parse_losses`` (scalar tensors, e.g. ``{"loss": tensor(0.7)}``).
        """
        with optim_wrapper.optim_context(self.boosted):
            data = self.module.data_preprocessor(data, True)
            losses = self._run_forward(data, mode="loss")
        parsed, log_vars = self.module.parse_losses(losses)
        optim_wrapper.update_params(parsed)
        out: dict[str, torch.Tensor] = log_vars
        return out

    def val_step(self, data: dict[str, Any] | tuple[Any, ...] | list[Any]) -> list[Any]:
        """The model's predictions (``mode="predict"``) for a validation batch."""
        data = self.module.data_preprocessor(data, False)
        predictions: list[Any] = self._run_forward(data, mode="predict")
        return predictions

    def test_step(self, data: dict[str, Any] | tuple[Any, ...] | list[Any]) -> list[Any]:
        """The model's predictions (``mode="predict"``) for a test batch."""
        return self.val_step(data)

    def _run_forward(self, data: Any, mode: str) -> Any:
        if isinstance(data, dict):
            return self.boosted(**data, mode=mode)
        if isinstance(data, list | tuple):
            return self.boosted(*data, mode=mode)
        raise TypeError(f"data_preprocessor must return a dict, tuple or list, got {type(data).__name__}")

    def __getattr__(self, name: str) -> Any:
        # only reached for names this object lacks: train(), eval(), parameters(), the module's attributes
        boosted = self.__dict__.get("boosted")
        module = self.__dict__.get("module")
        for target in (boosted, module):
            if target is not None:
                try:
                    return getattr(target, name)
                except AttributeError:
                    continue
        raise AttributeError(f"{type(self).__name__} (and the wrapped model) has no attribute {name!r}")
