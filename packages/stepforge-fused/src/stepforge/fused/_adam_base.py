# SPDX-License-Identifier: Apache-2.0
"""Adam launch shared by FusedAdam, CPUAdam and HybridAdam (state layout of ``torch.optim.AdamW``)."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from ._backend import ADAM
from ._base import FusedOptimizerBase
from ._validate import check_adam_like

__all__ = ["AdamBase", "adam_defaults", "check_adam_group"]


def adam_defaults(
    owner: str,
    *,
    lr: Any,
    bias_correction: Any,
    betas: Any,
    eps: Any,
    weight_decay: Any,
    amsgrad: Any = False,
    **flags: Any,
) -> dict[str, Any]:
    """Validate the Adam-family options and return the group defaults (``flags``: extra boolean options,
    e.g. ``adamw_mode``, ``grad_averaging``); the one place their defaults and checks live."""
    check_adam_like(
        owner,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        flags={"bias_correction": bias_correction, **flags},
    )
    return dict(
        lr=lr,
        bias_correction=bias_correction,
        betas=tuple(betas),
        eps=eps,
        weight_decay=weight_decay,
        **flags,
    )


def check_adam_group(group: MutableMapping[str, Any], *, owner: str, flags: tuple[str, ...]) -> None:
    """The Adam-family checks on one param group (``flags``: its boolean options)."""
    check_adam_like(
        owner,
        lr=group["lr"],
        betas=group["betas"],
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        amsgrad=group.get("amsgrad", False),
        flags={k: group[k] for k in flags if k in group},
    )


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
