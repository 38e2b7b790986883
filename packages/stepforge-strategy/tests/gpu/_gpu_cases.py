# SPDX-License-Identifier: Apache-2.0
"""The runs of the strategy GPU tests (importable by the spawned rank): a tiny model trained through
``Strategy`` with a plugin and a precision, and the same steps as a plain fp32 torch loop on the same device.

Each optimizer step takes a window of ``COUNTS`` micro-batches (``accumulative_counts``); the reference takes
one step on the concatenated window with the mean loss, which is the same gradient.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from stepforge.core import unwrap_optimizer
from stepforge.testing.models import block_net

D_IN, MICRO, COUNTS, STEPS = 6, 8, 2, 6
LR, WD = 1e-2, 0.01

#: name -> the plugin spec (precision added by :func:`plugin_spec`)
PLUGINS: dict[str, Any] = {
    "torch_ddp": dict(type="torch_ddp"),
    "torch_fsdp": dict(type="torch_fsdp"),
    "gemini": dict(type="gemini", placement_policy="auto"),  # every unit sharded and offloaded to CPU
    "gemini_static": dict(type="gemini", placement_policy="static"),  # sharded, kept on the device
    "zero2": dict(type="zero2", initial_scale=2**16),  # ColossalAI's 2**32 skips the first steps in fp16
    "zero2_offload": dict(type="zero2", initial_scale=2**16, cpu_offload=True),
}
PRECISIONS = ("fp32", "bf16", "fp16")
#: plugins whose default precision is fp16: fp32 must be asked for in the plugin itself
_OWN_PRECISION = ("torch_fsdp", "gemini", "gemini_static", "zero2", "zero2_offload")
#: name -> (where the model's parameters live, where the optimizer's parameters live) on a GPU run
PLACEMENT = {
    "torch_ddp": ("cuda", "cuda"),
    "torch_fsdp": ("cuda", "cuda"),
    "gemini": ("cpu", "cpu"),  # FSDP2's CPUOffloadPolicy: shards on the CPU, gathered onto the GPU per unit
    "gemini_static": ("cuda", "cuda"),
    "zero2": ("cuda", "cuda"),
    "zero2_offload": ("cuda", "cpu"),  # working parameters on the GPU, fp32 master pieces on the CPU
}


def make_model() -> nn.Module:
    return block_net(0, d_in=D_IN, width=16)


def window(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s whole window (``COUNTS * MICRO`` rows), on the CPU."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(COUNTS * MICRO, D_IN, generator=g)
    return x, torch.sin(x.sum(dim=1, keepdim=True)) + 0.1 * torch.randn(COUNTS * MICRO, 1, generator=g)


def start_state() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in make_model().state_dict().items()}


def reference(device: str) -> dict[str, torch.Tensor]:
    """Plain fp32 torch on ``device``: AdamW, one step per window."""
    model = make_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(STEPS):
        x, y = window(step)
        opt.zero_grad()
        F.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


def plugin_spec(name: str, precision: str) -> tuple[dict[str, Any], str | None]:
    """(plugin dict, the Strategy's ``mixed_precision``): half precisions go through the Booster's
    ``mixed_precision`` (adopted by the plugins that own precision), fp32 through the plugin."""
    spec = dict(PLUGINS[name])
    if precision == "fp32":
        if name in _OWN_PRECISION:
            spec["precision"] = "fp32"
        return spec, None
    return spec, precision


def make_strategy(work: str, name: str, precision: str) -> Any:
    from stepforge.strategy import Strategy

    plugin, mixed = plugin_spec(name, precision)
    return Strategy(
        plugin=plugin,
        mixed_precision=mixed,
        work_dir=work,
        experiment_name=f"{name}_{precision}",
        env_kwargs=dict(randomness=dict(seed=7)),
        log_kwargs=dict(console=False),
    )


def prepare(strategy: Any) -> tuple[Any, Any]:
    return strategy.prepare(
        make_model(),
        optim_wrapper=dict(optimizer=dict(type="AdamW", lr=LR, weight_decay=WD), accumulative_counts=COUNTS),
        dispatch_kwargs=dict(max_iters=STEPS * COUNTS),
    )


def train(model: Any, wrapper: Any, device: torch.device, first: int, stop: int) -> None:
    """Optimizer steps ``first..stop-1``: each window's micro-batches, forward and backward in optim_context."""
    for step in range(first, stop):
        x, y = window(step)
        for m in range(COUNTS):
            rows = slice(m * MICRO, (m + 1) * MICRO)
            with wrapper.optim_context(model):
                loss = F.mse_loss(model(x[rows].to(device)).float(), y[rows].to(device))
            wrapper.update_params(loss)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full fp32 CPU state (gathered under FSDP2), keys without wrapper prefixes."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    out = {}
    for key, value in get_model_state_dict(model, options=options).items():
        while key.startswith("module."):
            key = key[len("module.") :]
        out[key] = value.detach().float().cpu().clone()
    return out


def strategy_run(work: str, name: str, precision: str) -> dict[str, Any]:
    strategy = make_strategy(work, name, precision)
    model, wrapper = prepare(strategy)
    device = strategy.plugin.device
    train(model, wrapper, device, 0, STEPS)
    inner = unwrap_optimizer(wrapper.optimizer)  # the torch optimizer: ZeRO's steps the master pieces
    params = [p for group in inner.param_groups for p in group["params"]]
    out = dict(
        state=full_state(model),
        device=device.type,
        param_devices=sorted({p.device.type for p in model.parameters()}),
        master_devices=sorted({p.device.type for p in params}),
        skipped=wrapper.optimizer.skipped_steps,
        backend=torch.distributed.get_backend(),
    )
    strategy.close()
    return out


def resume_run(work: str, name: str, precision: str) -> dict[str, Any]:
    """Save after half the steps, go on; a new Strategy resumes the checkpoint and takes the same steps."""
    half = STEPS // 2
    strategy = make_strategy(os.path.join(work, "a"), name, precision)
    model, wrapper = prepare(strategy)
    device = strategy.plugin.device
    train(model, wrapper, device, 0, half)
    path = strategy.save_checkpoint("half")
    saved = full_state(model)
    train(model, wrapper, device, half, STEPS)
    expected = full_state(model)
    strategy.close()
    again = make_strategy(os.path.join(work, "b"), name, precision)
    model2, wrapper2 = prepare(again)
    again.resume(path)
    loaded = full_state(model2)
    train(model2, wrapper2, device, half, STEPS)
    out = dict(saved=saved, loaded=loaded, expected=expected, got=full_state(model2))
    again.close()
    return out


def amp_wrapper_run(device: str) -> dict[str, Any]:
    """stepforge-strategy's ``AmpOptimWrapper`` (fp16 autocast, ``torch.amp.GradScaler``) on a plain module."""
    from stepforge.strategy import AmpOptimWrapper

    model = make_model().to(device)
    wrapper = AmpOptimWrapper(
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD),
        dtype="float16",
        accumulative_counts=COUNTS,
    )
    scales = []
    for step in range(STEPS):
        train(model, wrapper, device, step, step + 1)
        scales.append(float(wrapper.loss_scaler.get_scale()))
    return dict(
        state={k: v.detach().float().cpu() for k, v in model.state_dict().items()},
        scaler=type(wrapper.loss_scaler).__name__,
        enabled=wrapper.loss_scaler.is_enabled(),
        scales=scales,
    )
