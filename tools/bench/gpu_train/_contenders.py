# SPDX-License-Identifier: Apache-2.0
"""The training setups the one-GPU benches compare, each built over a freshly materialised GPT, bf16 everywhere:

    torch_loop           the plain loop: fp32 parameters, ``torch.autocast(bf16)``, ``torch.optim.AdamW(fused=True)``
    torch_loop_compiled  the same with ``torch.compile(model)``
    booster              ``Booster(plugin="single", mixed_precision="bf16")`` + ``AdamW(fused=True)``
    booster_compiled     the same with ``boost(..., compile=...)``
    strategy             ``Strategy(plugin="single", mixed_precision="bf16")`` + ``ColossalAIOptimWrapper`` over
                         ``AdamW(fused=True)`` (mmengine's API)
    fused                the plain GPU run of the capacity search: the Booster's ``single`` plugin, bf16 autocast,
                         stepforge ``FusedAdam`` (fp32 parameters, gradients and state on the device)
    zero2_offload        ``Booster(plugin=dict(type="zero2", cpu_offload=True), mixed_precision="bf16")`` +
                         ``HybridAdam``: bf16 working parameters on the device; fp32 masters, gradient pieces and
                         Adam state on the host, stepped there by the CPU kernel
    gemini               ``Booster(plugin=dict(type="gemini", placement_policy="auto"), mixed_precision="bf16")``
                         + ``HybridAdam``: FSDP2 with ``CPUOffloadPolicy`` (fp32 shards, gradients and state on the
                         host, each block gathered to the device for its forward and backward)

Each :class:`Trainer` exposes the step in three parts (``forward_loss``, ``backward``, ``step``) so that a bench can
time them apart, and :attr:`Trainer.zero` is the ``LowLevelZeroOptimizer`` of a ZeRO setup (its phase hooks).
"""

from __future__ import annotations

import datetime
import os
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from bench.common._spawn import free_port
from bench.gpu_train._gpt import GPTShape, build, build_lazy

__all__ = ["CONTENDERS", "LR", "Trainer", "build_trainer", "needs_process_group"]

LR = 3e-4


@dataclass(frozen=True)
class Contender:
    """How a setup is built: the dtype the model is materialised in, whether it compiles, what it needs."""

    dtype: torch.dtype
    what: str
    compiled: bool = False
    process_group: bool = False


CONTENDERS: dict[str, Contender] = {
    "torch_loop": Contender(torch.float32, "plain loop, autocast bf16, AdamW(fused=True)"),
    "torch_loop_compiled": Contender(torch.float32, "plain loop + torch.compile", compiled=True),
    "booster": Contender(torch.float32, "Booster(single, bf16) + AdamW(fused=True)"),
    "booster_compiled": Contender(
        torch.float32, "Booster(single, bf16, compile) + AdamW(fused=True)", compiled=True
    ),
    "strategy": Contender(
        torch.float32, "Strategy(single, bf16) + ColossalAIOptimWrapper(AdamW(fused=True))"
    ),
    "fused": Contender(torch.float32, "Booster(single, bf16) + FusedAdam (all on the device)"),
    "zero2_offload": Contender(torch.bfloat16, "Booster(zero2, cpu_offload=True, bf16) + HybridAdam"),
    "gemini": Contender(
        torch.float32, "Booster(gemini auto: FSDP2 + CPUOffloadPolicy, bf16) + HybridAdam", process_group=True
    ),
}


@dataclass
class Trainer:
    """One setup ready to train.

    Attributes:
        name: the :data:`CONTENDERS` key.
        forward_loss: ``(x, y) -> loss`` (the forward and the cross-entropy, inside the setup's context).
        backward: ``loss -> None``.
        step: the optimizer step and ``zero_grad``.
        zero: the ``LowLevelZeroOptimizer`` of a ZeRO setup (``None`` otherwise).
        keep: what must stay alive while training (the Booster, the Strategy, temporary folders).
    """

    name: str
    forward_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    backward: Callable[[torch.Tensor], None]
    step: Callable[[], None]
    zero: Any = None
    keep: list[Any] = field(default_factory=list)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step on one micro-batch; returns the loss (detached, not synchronised)."""
        loss = self.forward_loss(x, y)
        self.backward(loss)
        self.step()
        return loss.detach()


def needs_process_group(name: str) -> bool:
    """Whether contender ``name`` needs ``torch.distributed`` initialised (FSDP2 does, even on one rank)."""
    return CONTENDERS[name].process_group


def init_single_process_group(device: torch.device) -> None:
    """A one-rank process group (NCCL on CUDA, gloo on the CPU) on a free local port, unless one exists."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))


def _cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def build_trainer(
    name: str,
    shape: GPTShape,
    device: torch.device,
    *,
    compile_options: dict[str, Any] | None = None,
    lazy: bool = False,
) -> Trainer:
    """Contender ``name`` over a GPT of ``shape`` materialised on ``device`` (same seed: same weights for all).

    ``compile_options`` are the ``torch.compile`` arguments of the compiled contenders (default: none).
    ``lazy``: the model is built under ``LazyInitContext`` (:func:`build_lazy`) and materialised by the
    contender's plugin where it keeps it, or whole on ``device`` by the plain loops.
    """
    spec = CONTENDERS[name]
    if spec.process_group:
        init_single_process_group(device)
    model = (build_lazy if lazy else build)(shape, device, spec.dtype)
    options = dict(compile_options or {})
    if name in ("torch_loop", "torch_loop_compiled"):
        return _torch_loop(name, model, device, options if spec.compiled else None)
    if name == "strategy":
        return _strategy(name, model)
    from stepforge.core import build_optimizer
    from stepforge.strategy import Booster

    plugin: Any = "single"
    optimizer: Any
    if name == "zero2_offload":
        plugin = dict(type="zero2", cpu_offload=True)
        optimizer = build_optimizer(dict(type="HybridAdam", lr=LR), model.parameters())
    elif name == "gemini":
        plugin = dict(type="gemini", placement_policy="auto")
        optimizer = dict(type="HybridAdam", lr=LR)  # built by the plugin over the offloaded shards
    elif name == "fused":
        optimizer = build_optimizer(dict(type="FusedAdam", lr=LR), model.parameters())
    else:  # booster, booster_compiled
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    # no device=: the plugins place the model on the current CUDA device (or the CPU) themselves, and
    # Zero2Plugin's **kwargs would pass device on to a constructor that has none
    booster = Booster(mixed_precision="bf16", plugin=plugin)
    boosted, opt, *_ = booster.boost(model, optimizer, compile=options if spec.compiled else False)

    def backward(loss: torch.Tensor) -> None:
        booster.backward(loss, opt)

    def step() -> None:
        opt.step()
        opt.zero_grad()

    from stepforge.zero import LowLevelZeroOptimizer

    zero = opt if isinstance(opt, LowLevelZeroOptimizer) else None
    return Trainer(
        name,
        lambda x, y: _cross_entropy(boosted(x), y),
        backward,
        step,
        zero=zero,
        keep=[booster, boosted, opt],
    )


def _torch_loop(
    name: str, model: torch.nn.Module, device: torch.device, compile_options: dict[str, Any] | None
) -> Trainer:
    from stepforge.strategy import LazyInitContext
    from stepforge.strategy.lazy import has_meta_tensors

    if has_meta_tensors(model):  # no Booster to materialise it
        LazyInitContext.materialize(model)
    net = torch.compile(model, **compile_options) if compile_options is not None else model
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)

    def forward_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = net(x)
        return _cross_entropy(logits, y)

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Trainer(name, forward_loss, lambda loss: loss.backward(), step, keep=[net, opt])


def _strategy(name: str, model: torch.nn.Module) -> Trainer:
    from stepforge.strategy import Strategy

    work = tempfile.TemporaryDirectory(prefix="gpu-train-strategy-")
    strategy = Strategy(
        plugin="single", mixed_precision="bf16", work_dir=work.name, log_kwargs=dict(console=False)
    )
    wrapped, wrapper = strategy.prepare(
        model,
        optim_wrapper=dict(type="ColossalAIOptimWrapper", optimizer=dict(type="AdamW", lr=LR, fused=True)),
        dispatch_kwargs=dict(max_iters=10**9),
    )

    def forward_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        context: AbstractContextManager[Any] = (
            wrapper.optim_context(wrapped) if wrapper is not None else nullcontext()
        )
        with context:
            return _cross_entropy(wrapped(x), y)

    def backward(loss: torch.Tensor) -> None:
        wrapper.backward(wrapper.scale_loss(loss))

    def step() -> None:
        wrapper.step()
        wrapper.zero_grad()

    return Trainer(name, forward_loss, backward, step, keep=[work, strategy, wrapped, wrapper])
