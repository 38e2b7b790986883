# SPDX-License-Identifier: Apache-2.0
"""``FusedAdam``: multi-tensor Adam/AdamW with ColossalAI's signature, on CPU and CUDA tensors, and the Adam
base it shares with CPUAdam and HybridAdam (``torch.optim.AdamW``'s state layout)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

from ._backend import ADAM
from ._base import FusedOptimizerBase
from ._step.eager import fused_step
from ._validate import adam_defaults, check_adam_group

__all__ = ["AdamBase", "FusedAdam"]


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


class FusedAdam(AdamBase):
    """Adam / AdamW in one multi-tensor kernel per (device, dtype) bucket.

    Math (per parameter, ``t`` its own step; torch's fused AdamW operation order, bit-identical to
    ``torch.optim.AdamW(fused=True)`` for float32 on CPU)::

        g = g / div_scale                      (div_scale > 0, and GradScaler's scale when used with it)
        adamw_mode: p = p * (1 - lr*wd)        else: g = g + wd*p
        m = lerp(m, g, 1-beta1) ;  v = beta2*v + (1-beta2)*g*g
        p = p - lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)     (bc = 1 - beta**t; 1 without bias_correction)

    Args:
        params: parameters or param-group dicts (CPU or CUDA; float32, float16 or bfloat16; contiguous).
        lr: learning rate. bias_correction: use ``bc1``/``bc2``. betas: ``(beta1, beta2)``. eps: denominator term.
        adamw_mode: decoupled decay (AdamW) instead of L2 on the gradient. weight_decay: decay coefficient.
        amsgrad: must be False (raises otherwise). set_grad_none: ``zero_grad()`` default sets grads to None.
        master_weights: keep float32 masters for fp16/bf16 params (``state["master_param"]``); the kernel
            updates the master and writes the rounded param copy in the same pass.
        skip_nonfinite: skip the whole step when a (divided) grad holds inf/NaN; ``None`` = on with
            ``master_weights``. Skips are reported in ``last_step_skipped`` / ``skipped_steps``.
        assume_stable_grads: skip the per-step ``p.grad`` identity check (about 0.3 us per parameter) and rely
            on post-accumulate-grad hooks to see re-allocated grads; grads assigned by hand then need
            ``invalidate_cache()``. Worth it for thousands of small tensors.
        capturable: keep ``lr`` and the step counters on the device so ``step()`` can be captured in a CUDA
            graph (``lr`` may be a 1-element float32 CUDA tensor, read in place by the kernel; a float lr is kept
            in a device buffer). CUDA parameters only: raises at ``step()`` for CPU ones, as torch.optim does.
            On CUDA, ``step()`` never synchronises with the host whatever this flag says.

    State per parameter equals ``torch.optim.AdamW``'s: ``step`` (0-dim float32), ``exp_avg``, ``exp_avg_sq``
    (float32, shaped like the param), so checkpoints load both ways.
    """

    _owner = "FusedAdam"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adamw_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        *,
        master_weights: bool = False,
        skip_nonfinite: bool | None = None,
        assume_stable_grads: bool = False,
        capturable: bool = False,
    ) -> None:
        defaults = adam_defaults(
            self._owner,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            adamw_mode=adamw_mode,
        )
        super().__init__(
            params,
            defaults,
            master_weights=master_weights,
            skip_nonfinite=skip_nonfinite,
            assume_stable_grads=assume_stable_grads,
            capturable=capturable,
            set_grad_none=set_grad_none,
        )

    def step(
        self,
        closure: Callable[[], Any] | None = None,
        grads: Any = None,
        output_params: Any = None,
        scale: Any = None,
        grad_norms: Any = None,
        div_scale: float = -1,
    ) -> Any:
        """One optimizer step; ``div_scale > 0`` divides every grad first (ColossalAI semantics)."""
        legacy = {"grads": grads, "output_params": output_params, "scale": scale, "grad_norms": grad_norms}
        for name, value in legacy.items():  # kept in apex/ColossalAI's signature for compatibility only
            if value is not None:
                raise TypeError(
                    f"FusedAdam.step(): the legacy argument {name!r} is not supported (it must be None); gradients "
                    "are read from p.grad, and a loss scale is passed as div_scale= or through torch.amp.GradScaler."
                )
        return fused_step(self, closure, div_scale)
