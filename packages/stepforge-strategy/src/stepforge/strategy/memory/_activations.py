# SPDX-License-Identifier: Apache-2.0
"""Activation memory from a traced forward and backward on fake tensors (no memory is allocated).

The model is copied onto the meta device (its parameters and buffers are not copied: the copy gets meta
stand-ins), materialised as fake CPU tensors in the dtype the plugin computes in, and run on fake inputs of the
example micro-batch's shapes under torch's ``MemTracker``, which counts every tensor storage autograd keeps and
every temporary, by category. Under the Booster's autocast the same autocast runs (on the CPU device type: its
op lists are close to, not identical with, CUDA's).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stepforge.core.torch_compat import (
    fake_tensor_mode,
    memory_tracker,
    tracker_bytes,
    tracker_module_peaks,
)

__all__ = ["ActivationTrace", "ModulePeak", "trace_activations", "split_inputs"]


@dataclass(frozen=True)
class ModulePeak:
    """One module in the traced forward and backward: ``order``: when its forward first ran (0 first);
    ``forward``/``backward``: activations and temporaries alive at its peak in forward and in backward;
    ``backward_grads``: the model's gradients built by then."""

    order: int
    forward: int
    backward: int
    backward_grads: int


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
    """

    forward: int
    peak: int
    peak_with_grads: int
    grads: int
    modules: dict[str, ModulePeak] = field(default_factory=dict)


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
    ``FakeTensorMode``), floating ones in ``dtype`` when given (as the plugin casts them)."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                kind = dtype if dtype is not None and p.is_floating_point() else p.dtype
                sub._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=kind), p.requires_grad)
        for name, b in list(sub._buffers.items()):
            if b is not None:
                kind = dtype if dtype is not None and b.is_floating_point() else b.dtype
                sub._buffers[name] = torch.empty(b.shape, dtype=kind)


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
            out[name] = ModulePeak(order[id(module)], _split(peaks["forward"])[0], back, back_grads)
    return out


def trace_activations(
    model: nn.Module,
    inputs: Any,
    *,
    compute_dtype: torch.dtype | None = None,
    autocast_dtype: torch.dtype | None = None,
    criterion: Callable[[Any], torch.Tensor] | None = None,
) -> ActivationTrace:
    """Run ``model`` forward and backward on fake copies of ``inputs`` and count what it keeps.

    Args:
        model: the model (real or meta; not changed, its data is not copied).
        inputs: what its forward takes (see :func:`split_inputs`); real or meta tensors.
        compute_dtype: the dtype the plugin casts floating parameters, buffers and inputs to (``None``: as
            they are).
        autocast_dtype: run the forward under ``torch.autocast`` of this dtype (the Booster's mixed precision).
        criterion: a function of the output returning the loss (default: the output's mean).

    Raises:
        RuntimeError: the forward cannot run on fake tensors (it reads values: ``.item()``, data-dependent
            shapes); the message says so.
    """
    copied = _meta_copy(model)
    mode = fake_tensor_mode()
    args, kwargs = split_inputs(inputs)
    with mode:
        _materialise(copied, compute_dtype)
        fake_args = tuple(_fake_leaf(mode, a, compute_dtype) for a in args)
        fake_kwargs = {k: _fake_leaf(mode, v, compute_dtype) for k, v in kwargs.items()}
        tracker = memory_tracker()
        tracker.track_external(copied)
        order: dict[int, int] = {}

        def first_forward(module: nn.Module, _: Any) -> None:
            order.setdefault(id(module), len(order))

        hook = nn.modules.module.register_module_forward_pre_hook(first_forward)
        autocast = (
            torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
        )
        try:
            with tracker:
                with autocast:
                    output = copied(*fake_args, **fake_kwargs)
                loss = criterion(output) if criterion is not None else _loss(output)
                forward, _ = _activation_bytes(tracker_bytes(tracker, "current"))
                loss.backward()
                _, grads = _activation_bytes(tracker_bytes(tracker, "current"))
        except (RuntimeError, NotImplementedError) as exc:
            raise RuntimeError(
                f"estimate: the model's forward/backward could not be traced on fake tensors ({type(exc).__name__}: "
                f"{exc}); a forward that reads tensor values (.item(), data-dependent shapes) cannot be traced. "
                "Estimate without inputs (no activations) or make the forward value-independent."
            ) from exc
        finally:
            hook.remove()
        peak_acts, peak_grads = _activation_bytes(tracker_bytes(tracker, "peak"))
        modules = _module_peaks(tracker, copied, order)
    return ActivationTrace(
        forward=forward,
        peak=max(forward, peak_acts),
        peak_with_grads=max(forward, peak_acts + peak_grads),
        grads=grads,
        modules=modules,
    )
