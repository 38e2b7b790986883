# SPDX-License-Identifier: Apache-2.0
"""Activation memory from a traced forward and backward on fake tensors (no memory is allocated).

The model is copied onto the meta device (its parameters and buffers are not copied: the copy gets meta
stand-ins), materialised as fake CPU tensors in the dtype the plugin computes in, and run on fake inputs of the
example micro-batch's shapes under torch's ``MemTracker``, which counts every tensor storage autograd keeps and
every temporary, by category. Under the Booster's autocast the same autocast runs (on the CPU device type: its
op lists are close to, not identical with, CUDA's).

A forward that reads tensor values (``.item()``, data-dependent shapes: MoE routing, some attention-mask code)
or meets an op without a fake kernel cannot run on fake tensors; by default (``method="auto"``) it is then run on
real CPU tensors instead, counted the same way (:func:`trace_activations`; :attr:`ActivationTrace.method` says
which ran). The trace also records what is alive at each module's own forward and backward peak, from which the
estimate composes a sharded layout's peak unit by unit.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from stepforge.core.torch_compat import (
    fake_tensor_mode,
    memory_tracker,
    tracker_bytes,
    tracker_module_peaks,
)

from ._model import _transformers

__all__ = [
    "ActivationTrace",
    "ModulePeak",
    "TRACE_METHODS",
    "checkpoint_blocks",
    "trace_activations",
    "split_inputs",
]


@dataclass(frozen=True)
class ModulePeak:
    """One module in the traced forward and backward: ``order``: when its forward first ran (0 first);
    ``forward``/``backward``: activations and temporaries alive at its peak in forward and in backward;
    ``backward_grads``: the model's gradients built by then; ``entry``: activations alive as its forward
    starts."""

    order: int
    forward: int
    backward: int
    backward_grads: int
    entry: int = 0


@dataclass(frozen=True)
class ActivationTrace:
    """Bytes one forward and backward of the micro-batch keep beside the parameters.

    Attributes:
        forward: activations and temporaries alive when the loss is computed (what autograd saved).
        peak: the most activations and temporaries alive at once, backward included.
        peak_with_grads: the most activations, temporaries and the model's gradients alive at once (a
            replicated layout keeps every gradient in ``param.grad``).
        grads: the model's gradients at the end of backward (in the compute dtype).
        modules: per module (``named_modules`` names) what is alive at its own peaks (:class:`ModulePeak`): a
            sharded layout adds what it gathers while that module runs.
        method: how it was traced: ``"fake"`` (fake tensors) or ``"real"`` (real CPU tensors; see
            :func:`trace_activations`).
    """

    forward: int
    peak: int
    peak_with_grads: int
    grads: int
    modules: dict[str, ModulePeak] = field(default_factory=dict)
    method: str = "fake"


def split_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """What the forward takes: a tensor is one positional argument, a tuple or list the positional arguments,
    a mapping the keyword arguments."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, tuple | list):
        return tuple(inputs), {}
    return (inputs,), {}


def _meta_copy(model: nn.Module) -> nn.Module:
    """``model`` deep-copied with meta stand-ins for its parameters and buffers (their data is not copied)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    return copy.deepcopy(model, memo)


def _materialise(module: nn.Module, dtype: torch.dtype | None) -> None:
    """Replace every meta parameter and buffer of ``module`` by an uninitialised CPU tensor (fake inside a
    ``FakeTensorMode``), floating ones in ``dtype`` when given (as the plugin casts them). A tensor registered
    in several modules (tied embeddings) is replaced by one tensor: its gradient is built once."""
    # id -> (the meta tensor, kept alive so that no other takes its id; its stand-in)
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for sub in module.modules():
        for table, is_param in ((sub._parameters, True), (sub._buffers, False)):
            for name, t in list(table.items()):
                if t is None:
                    continue
                if id(t) not in made:
                    kind = dtype if dtype is not None and t.is_floating_point() else t.dtype
                    empty = torch.empty(t.shape, dtype=kind)
                    made[id(t)] = (t, nn.Parameter(empty, t.requires_grad) if is_param else empty)
                table[name] = made[id(t)][1]  # type: ignore[assignment]


def _fake_leaf(mode: Any, value: Any, dtype: torch.dtype | None) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    kind = dtype if dtype is not None and value.is_floating_point() else value.dtype
    if value.is_meta:
        return torch.empty(value.shape, dtype=kind, device="cpu")
    return mode.from_tensor(value).to(kind)


def _loss(output: Any) -> torch.Tensor:
    """The output's mean: a tensor's, else a ``loss`` entry's (Hugging Face outputs), else the first floating
    tensor's."""
    if isinstance(output, torch.Tensor):
        return output.float().mean()
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        loss: torch.Tensor = output["loss"]
        return loss
    leaves = list(output.values()) if isinstance(output, Mapping) else list(output)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.float().mean()
    raise TypeError(
        f"estimate: the model's output ({type(output).__name__}) holds no floating-point tensor to take the mean "
        "of; pass criterion=... (a function of the output returning the loss)."
    )


def _split(device: dict[str, int]) -> tuple[int, int]:
    """``(activations and temporaries, gradients)`` of one device's snapshot."""
    return device.get("Activation", 0) + device.get("Temp", 0) + device.get("Other", 0), device.get(
        "Gradient", 0
    )


def _activation_bytes(snapshot: dict[str, dict[str, int]]) -> tuple[int, int]:
    acts = grads = 0
    for device in snapshot.values():
        a, g = _split(device)
        acts, grads = acts + a, grads + g
    return acts, grads


def _module_peaks(tracker: Any, model: nn.Module, order: dict[int, int]) -> dict[str, ModulePeak]:
    out = {}
    for name, module in model.named_modules():
        peaks = tracker_module_peaks(tracker, module)
        if "forward" in peaks and "backward" in peaks and id(module) in order:
            back, back_grads = _split(peaks["backward"])
            entry = _split(peaks["entry"])[0] if "entry" in peaks else 0
            out[name] = ModulePeak(order[id(module)], _split(peaks["forward"])[0], back, back_grads, entry)
    return out


#: how activations are traced: ``"fake"``: on fake tensors (nothing allocated); ``"real"``: on real CPU tensors
#: (the model copied in the compute dtype, its gradients and activations allocated for one forward and backward);
#: ``"auto"``: fake, and real when the forward reads values fake tensors do not have
TRACE_METHODS = ("auto", "fake", "real")


def _real_copy(model: nn.Module) -> nn.Module:
    """``model`` deep-copied with real CPU tensors: a real parameter or buffer's values copied, a meta one's
    drawn (floating parameters ``N(0, 0.02)``, as transformers initialises them; buffers and integer tensors
    zero, valid indices)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if p.is_meta:
            data = torch.zeros(p.shape, dtype=p.dtype)
            if p.is_floating_point():
                data.normal_(0, 0.02)
        else:
            data = p.detach().to("cpu", copy=True)
        memo[id(p)] = nn.Parameter(data, p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.zeros(b.shape, dtype=b.dtype) if b.is_meta else b.detach().to("cpu", copy=True)
    return copy.deepcopy(model, memo)


def _cast(module: nn.Module, dtype: torch.dtype | None) -> None:
    if dtype is not None:
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if p is not None and p.is_floating_point():
                    sub._parameters[name] = nn.Parameter(p.detach().to(dtype), p.requires_grad)
            for name, b in list(sub._buffers.items()):
                if b is not None and b.is_floating_point():
                    sub._buffers[name] = b.to(dtype)


def _real_leaf(value: Any, dtype: torch.dtype | None) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    kind = dtype if dtype is not None and value.is_floating_point() else value.dtype
    if value.is_meta:
        return (
            torch.randn(value.shape).to(kind)
            if value.is_floating_point()
            else torch.zeros(value.shape, dtype=kind)
        )
    return value.to("cpu", kind)


def checkpoint_blocks(model: nn.Module) -> None:
    """Recompute ``model``'s blocks in backward (activation checkpointing), as training would: a transformers
    model through its own ``activation_checkpointing_enable()`` (``gradient_checkpointing_enable()`` before
    transformers 5), any other module by running each of its blocks
    (the outermost of the units FSDP shards: ``ModuleList``/``Sequential`` elements) under
    ``torch.utils.checkpoint``."""
    transformers = _transformers()
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        hf: Any = model
        if hf.supports_gradient_checkpointing:
            # transformers 5 names it activation_checkpointing_enable (the old name warns)
            if hasattr(hf, "activation_checkpointing_enable"):
                hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return
    from ..plugins._fsdp_common import default_blocks

    blocks = default_blocks(model)
    inner = {id(m) for b in blocks for m in b.modules() if m is not b}
    for block in blocks:
        if id(block) not in inner:
            block.forward = functools.partial(_checkpointed, block.forward)


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _run(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    autocast_dtype: torch.dtype | None,
    criterion: Callable[[Any], torch.Tensor] | None,
    method: str,
    checkpointing: bool,
) -> ActivationTrace:
    """One forward and backward of ``model`` under ``MemTracker`` (in whatever tensor mode is active)."""
    model.train()
    if checkpointing:
        checkpoint_blocks(model)
    tracker = memory_tracker()
    tracker.track_external(model)
    order: dict[int, int] = {}

    def first_forward(module: nn.Module, _: Any) -> None:
        order.setdefault(id(module), len(order))

    hook = nn.modules.module.register_module_forward_pre_hook(first_forward)
    autocast = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
    try:
        with tracker:
            with autocast:
                output = model(*args, **kwargs)
            loss = criterion(output) if criterion is not None else _loss(output)
            forward, _ = _activation_bytes(tracker_bytes(tracker, "current"))
            del output  # a training loop keeps the loss, not the output (logits), through backward
            loss.backward()
            _, grads = _activation_bytes(tracker_bytes(tracker, "current"))
    finally:
        hook.remove()
    peak_acts, peak_grads = _activation_bytes(tracker_bytes(tracker, "peak"))
    return ActivationTrace(
        forward=forward,
        peak=max(forward, peak_acts),
        peak_with_grads=max(forward, peak_acts + peak_grads),
        grads=grads,
        modules=_module_peaks(tracker, model, order),
        method=method,
    )


def trace_activations(
    model: nn.Module,
    inputs: Any,
    *,
    compute_dtype: torch.dtype | None = None,
    autocast_dtype: torch.dtype | None = None,
    criterion: Callable[[Any], torch.Tensor] | None = None,
    method: str = "auto",
    activation_checkpointing: bool = False,
) -> ActivationTrace:
    """Run ``model`` forward and backward on copies of ``inputs`` and count what it keeps.

    Args:
        model: the model (real or meta; not changed).
        inputs: what its forward takes (see :func:`split_inputs`); real or meta tensors.
        compute_dtype: the dtype the plugin casts floating parameters, buffers and inputs to (``None``: as
            they are).
        autocast_dtype: run the forward under ``torch.autocast`` of this dtype (the Booster's mixed precision).
        criterion: a function of the output returning the loss (default: the output's mean).
        method: one of :data:`TRACE_METHODS`. ``"fake"`` allocates nothing but cannot run a forward that reads
            tensor values (``.item()``, data-dependent shapes: MoE routing, some attention-mask code) or an op
            without a fake kernel; ``"real"`` runs on real CPU tensors with the values of ``inputs`` (meta
            inputs: zeros, or normal floats) and of the model (a meta model's parameters drawn ``N(0, 0.02)``),
            allocating the model in ``compute_dtype`` and one forward and backward; the activations of a
            value-dependent forward are those of these values. ``"auto"``: fake, then real.
        activation_checkpointing: trace the copy with its blocks recomputed in backward
            (:func:`checkpoint_blocks`); checkpointing the model already has (``torch.utils.checkpoint`` in
            its forward, torch's ``checkpoint_wrapper``, transformers' ``gradient_checkpointing_enable()``) is
            traced as it is either way. The copy is traced in training mode.

    Raises:
        ValueError: an unknown ``method``.
        RuntimeError: ``method="fake"`` and the forward cannot run on fake tensors; the message says so.
    """
    if method not in TRACE_METHODS:
        raise ValueError(f"estimate: trace must be one of {TRACE_METHODS}, got {method!r}.")
    args, kwargs = split_inputs(inputs)
    if method != "real":
        copied = _meta_copy(model)
        mode = fake_tensor_mode()
        try:
            with mode:
                _materialise(copied, compute_dtype)
                fake_args = tuple(_fake_leaf(mode, a, compute_dtype) for a in args)
                fake_kwargs = {k: _fake_leaf(mode, v, compute_dtype) for k, v in kwargs.items()}
                return _run(
                    copied,
                    fake_args,
                    fake_kwargs,
                    autocast_dtype,
                    criterion,
                    "fake",
                    activation_checkpointing,
                )
        except (RuntimeError, NotImplementedError) as exc:
            if method == "fake":
                raise RuntimeError(
                    "estimate: the model's forward/backward could not be traced on fake tensors "
                    f"({type(exc).__name__}: {exc}); a forward that reads tensor values (.item(), "
                    "data-dependent shapes) cannot be traced on them. Pass trace='real' (or 'auto') to trace "
                    "it on real CPU tensors, or estimate without inputs (no activations)."
                ) from exc
    real = _real_copy(model)
    _cast(real, compute_dtype)
    real_args = tuple(_real_leaf(a, compute_dtype) for a in args)
    real_kwargs = {k: _real_leaf(v, compute_dtype) for k, v in kwargs.items()}
    return _run(real, real_args, real_kwargs, autocast_dtype, criterion, "real", activation_checkpointing)
