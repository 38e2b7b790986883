# SPDX-License-Identifier: Apache-2.0
"""``gemini`` (``GeminiPlugin``): ZeRO-3 with CPU offload on FSDP2, ColossalAI's arguments mapped onto
:class:`TorchFSDPPlugin`'s fields."""

from __future__ import annotations

from typing import Any

import torch

from stepforge.core.precision import validate_loss_scaler_args

from .torch_fsdp import TorchFSDPPlugin

__all__ = ["GeminiPlugin", "GEMINI_DEFAULT_ONLY"]

#: ColossalAI Gemini arguments with no FSDP2 meaning, accepted only at these (ColossalAI's default) values.
GEMINI_DEFAULT_ONLY: dict[str, Any] = {
    "chunk_config_dict": None,
    "chunk_init_device": None,
    "warmup_non_model_data_ratio": 0.8,
    "steady_cuda_cap_ratio": 0.9,
    "force_outputs_fp32": False,
    "strict_ddp_mode": False,
    "search_range_m": 32,
    "hidden_dim": None,
    "min_chunk_size_m": 32,
    "memstats": None,
    "gpu_margin_mem_ratio": 0.0,
    "enable_gradient_accumulation": False,
    "max_prefetch": 0,
    "enable_async_reduce": True,
    "enable_all_optimization": False,
    "enable_fused_normalization": False,
    "enable_flash_attention": False,
    "enable_sequence_parallelism": False,
    "enable_jit_fused": False,
    "enable_sequence_overlap": False,
    "verbose": False,
    "fp8_communication": False,
    "use_fp8": False,
}


class GeminiPlugin(TorchFSDPPlugin):
    """ColossalAI's ``GeminiPlugin`` on FSDP2; the README table "GeminiPlugin and TorchFSDPPlugin arguments"
    maps each argument (the chunk-manager and kernel ones are accepted at their defaults only,
    ``GEMINI_DEFAULT_ONLY``). As ColossalAI's, ``support_no_sync()`` is ``False`` and ``state_dict()`` the
    full state on rank 0; the optimizer defaults to stepforge-fused's ``HybridAdam``."""

    name = "gemini"
    DEFAULT_PRECISION = "fp16"  # ColossalAI's default
    #: the prepared model's ``state_dict()``: the full state on rank 0, ``{}`` elsewhere (``GeminiDDP``'s default)
    FULL_STATE_DICT_RANK_0_ONLY = True

    def __init__(
        self,
        placement_policy: str = "static",
        offload_optim_frac: float = 0.0,
        offload_param_frac: float = 0.0,
        precision: str | None = None,
        master_weights: bool = True,
        pin_memory: bool = False,
        initial_scale: float = 2.0**16,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2.0**32,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
        shard_param_frac: float = 1.0,
        tp_size: int = 1,
        extra_dp_size: int = 1,
        *,
        device: str | torch.device | None = None,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - set(GEMINI_DEFAULT_ONLY))
        if unknown:
            raise TypeError(f"GeminiPlugin: unexpected argument(s) {', '.join(map(repr, unknown))}.")
        for key, value in kwargs.items():
            if value != GEMINI_DEFAULT_ONLY[key]:
                raise ValueError(
                    f"GeminiPlugin: argument {key}={value!r} has no equivalent on FSDP2 (it tunes ColossalAI's "
                    f"own chunk manager or kernels); leave it at {GEMINI_DEFAULT_ONLY[key]!r}."
                )
        if tp_size != 1:
            raise ValueError(
                f"GeminiPlugin: tp_size={tp_size!r}: tensor parallelism is not offered by this plugin (a later "
                "capability); use tp_size=1 (extra_dp_size gives hybrid sharding)."
            )
        if placement_policy not in ("static", "auto"):
            raise ValueError(
                f"GeminiPlugin: placement_policy must be 'static' or 'auto', got {placement_policy!r}."
            )
        for key, frac in (
            ("shard_param_frac", shard_param_frac),
            ("offload_optim_frac", offload_optim_frac),
            ("offload_param_frac", offload_param_frac),
        ):
            if isinstance(frac, bool) or not isinstance(frac, int | float) or not 0.0 <= frac <= 1.0:
                raise ValueError(f"GeminiPlugin: {key} must be a number in [0, 1], got {frac!r}.")
        if isinstance(extra_dp_size, bool) or not isinstance(extra_dp_size, int) or extra_dp_size < 1:
            raise ValueError(
                f"GeminiPlugin: extra_dp_size must be an int >= 1 dividing the world size, got {extra_dp_size!r}."
            )
        if not master_weights:
            raise ValueError(
                "GeminiPlugin: master_weights=False is not supported; the sharded fp32 parameters are the master "
                "weights (FSDP2 casts a copy for compute)."
            )
        if placement_policy == "auto":
            shard_param_frac, offload_frac = 1.0, 1.0
        else:
            offload_frac = max(float(offload_optim_frac), float(offload_param_frac))
        super().__init__(
            precision=precision,
            reshard_after_forward=True,
            cpu_offload=offload_frac > 0,
            max_norm=max_norm,
            device=device,
        )
        self.placement_policy = placement_policy
        self.shard_param_frac = float(shard_param_frac)
        self.offload_optim_frac = float(offload_optim_frac)
        self.offload_param_frac = float(offload_param_frac)
        self.offload_frac = float(offload_frac)
        self.extra_dp_size = int(extra_dp_size)
        self.tp_size = 1
        self.pin_memory = bool(pin_memory)
        self.norm_type = float(norm_type)
        self.default_optimizer = "HybridAdam"
        self._scaler_kwargs = validate_loss_scaler_args(  # now, not at boost
            "GeminiPlugin",
            initial_scale=initial_scale,
            min_scale=min_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            max_scale=max_scale,
        )

    def supports_no_sync(self) -> bool:
        """``False``: as ColossalAI's Gemini, every micro-batch reduce-scatters its gradients."""
        return False
