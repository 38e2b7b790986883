# SPDX-License-Identifier: Apache-2.0
"""Adam launch shared by FusedAdam, CPUAdam and HybridAdam (state layout of ``torch.optim.AdamW``)."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from stepforge.core import (
    HyperParameterError,
    check_betas,
    check_bool,
    check_lr,
    check_range,
    check_weight_decay,
)

from ._backend import ADAM
from ._base import FusedOptimizerBase

__all__ = ["AdamBase", "adam_defaults", "check_adam_group"]

_NUMBERS = ("lr", "betas", "eps", "weight_decay")


def check_adam_group(group: MutableMapping[str, Any], *, owner: str, flags: tuple[str, ...]) -> None:
    """The Adam-family checks on one param group (``flags``: its boolean options); ``amsgrad=True`` raises a
    clear error."""
    check_lr(group["lr"], owner=owner)
    check_betas(group["betas"], owner=owner)
    check_range(
        "eps", group["eps"], low=0.0, low_open=True, owner=owner, hint="Pass a small positive eps, e.g. 1e-8."
    )
    check_weight_decay(group["weight_decay"], owner=owner)
    amsgrad = group.get("amsgrad", False)
    check_bool("amsgrad", amsgrad, owner=owner)
    if amsgrad:
        raise HyperParameterError(
            f"{owner}: amsgrad=True is not supported by the fused kernels. Use torch.optim.AdamW(amsgrad=True) "
            "or pass amsgrad=False."
        )
    for name in flags:
        if name in group:
            check_bool(name, group[name], owner=owner)


def adam_defaults(owner: str, *, amsgrad: Any = False, **options: Any) -> dict[str, Any]:
    """Validate the Adam-family options (``lr, bias_correction, betas, eps, weight_decay`` and the boolean ones,
    e.g. ``adamw_mode``) and return them as the group defaults (``amsgrad`` is checked, not kept)."""
    flags = tuple(k for k in options if k not in _NUMBERS)
    check_adam_group({**options, "amsgrad": amsgrad}, owner=owner, flags=flags)
    return {**options, "betas": tuple(options["betas"])}


class AdamBase(FusedOptimizerBase):
    """Adam/AdamW over the ``adam`` kernel; groups hold ``lr, bias_correction, betas, eps, weight_decay,
    adamw_mode``. State per parameter: ``step`` (0-dim float32), ``exp_avg``, ``exp_avg_sq`` (float32), and
    ``master_param`` with ``master_weights=True`` for fp16/bf16 params."""

    _kernel = ADAM

    def _check_group(self, group: MutableMapping[str, Any]) -> None:
        super()._check_group(group)
        check_adam_group(group, owner=self._owner, flags=("bias_correction", "adamw_mode"))

    def _torch_group_keys(self, group: dict[str, Any]) -> dict[str, Any]:
        # torch.optim.Adam/AdamW read these; `fused=True` keeps the bit-identical torch path after a load.
        return {
            "amsgrad": False,
            "maximize": False,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": True,
            "decoupled_weight_decay": bool(group["adamw_mode"]),
        }

    def _check_loaded_group(self, group: dict[str, Any]) -> None:
        super()._check_loaded_group(group)
        if "decoupled_weight_decay" in group and "adamw_mode" in group:
            # A torch.optim checkpoint says which decay it used; keep its semantics.
            group["adamw_mode"] = bool(group["decoupled_weight_decay"])
