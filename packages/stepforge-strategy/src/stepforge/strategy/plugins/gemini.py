# SPDX-License-Identifier: Apache-2.0
"""``gemini`` (``GeminiPlugin``): ZeRO-3 with CPU offload, built on FSDP2 (``fully_shard`` +
``CPUOffloadPolicy``), with ColossalAI's arguments.

ColossalAI's Gemini manages parameter chunks itself; here FSDP2 does the sharding, so the chunk and
memory-tracer arguments have no meaning. They are accepted at their ColossalAI defaults and raise, naming the
argument, when set to anything else. The honoured ones:

====================================== ==============================================================
ColossalAI argument                    here
====================================== ==============================================================
``precision`` ``"fp16"``/``"bf16"``    FSDP2 ``MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)``;
                                       ``"fp32"`` also accepted
``placement_policy="static"``          offload as ``offload_param_frac``/``offload_optim_frac`` say
``placement_policy="auto"``            ``CPUOffloadPolicy`` (parameters, gradients, optimizer on CPU)
``offload_param_frac``/``offload_optim_frac`` 0 or 1; FSDP2 offloads parameters, gradients and optimizer
                                       state together, so either at 1 offloads all three
``pin_memory``                         ``CPUOffloadPolicy(pin_memory=...)``, only where an accelerator exists
``max_norm``, ``norm_type``            global-norm clipping over all shards inside ``step``
``initial_scale`` ... ``max_scale``    fp16 dynamic loss scaling (:class:`DynamicLossScaler`)
``master_weights``                     ``True`` only: the sharded fp32 parameters are the masters
====================================== ==============================================================

``support_no_sync()`` is ``False``, as in ColossalAI. The optimizer for offloaded shards defaults to
stepforge-fused's ``HybridAdam`` (``boost(model, dict(lr=1e-3))`` or ``dict(type="CPUAdam", ...)``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from stepforge.core.precision import DynamicLossScaler, validate_loss_scaler_args

from .torch_fsdp import TorchFSDPPlugin

__all__ = ["GeminiPlugin", "GEMINI_DEFAULT_ONLY"]

#: ColossalAI Gemini arguments with no FSDP2 meaning, accepted only at these (ColossalAI's default) values.
GEMINI_DEFAULT_ONLY: dict[str, Any] = {
    "chunk_config_dict": None,
    "chunk_init_device": None,
    "shard_param_frac": 1.0,
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
    "tp_size": 1,
    "extra_dp_size": 1,
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
    """ColossalAI's ``GeminiPlugin`` on FSDP2 (see the module docstring for the argument mapping).

    Raises:
        ValueError: a chunk/tracer argument away from its default, a fraction other than 0 or 1, an unknown
            placement policy or precision, ``master_weights=False``.
        TypeError: an unknown argument.
    """

    name = "gemini"
    DEFAULT_PRECISION = "fp16"  # ColossalAI's default

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
                    f"own chunk manager); leave it at {GEMINI_DEFAULT_ONLY[key]!r}."
                )
        if placement_policy not in ("static", "auto"):
            raise ValueError(
                f"GeminiPlugin: placement_policy must be 'static' or 'auto', got {placement_policy!r}."
            )
        for key, frac in (
            ("offload_optim_frac", offload_optim_frac),
            ("offload_param_frac", offload_param_frac),
        ):
            if frac not in (0, 1):
                raise ValueError(
                    f"GeminiPlugin: {key}={frac!r}: FSDP2 offloads all or nothing; use 0.0 or 1.0."
                )
        if not master_weights:
            raise ValueError(
                "GeminiPlugin: master_weights=False is not supported; the sharded fp32 parameters are the master "
                "weights (FSDP2 casts a copy for compute)."
            )
        offload = placement_policy == "auto" or offload_optim_frac == 1 or offload_param_frac == 1
        super().__init__(
            precision=precision,
            reshard_after_forward=True,
            cpu_offload=offload,
            max_norm=max_norm,
            device=device,
        )
        self.placement_policy = placement_policy
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

    def _offload_policy(self) -> Any:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        from ._fsdp_common import accelerator_available

        if not self.cpu_offload:
            return OffloadPolicy()
        return CPUOffloadPolicy(pin_memory=self.pin_memory and accelerator_available())

    def _make_scaler(self) -> DynamicLossScaler | None:
        if self.precision != "fp16":
            return None
        return DynamicLossScaler(**self._scaler_kwargs, process_group=dist.group.WORLD)
