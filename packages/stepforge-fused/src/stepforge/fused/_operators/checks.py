# SPDX-License-Identifier: Apache-2.0
"""Argument checks of the ``stepforge_fused`` operators, shared by their fake and real implementations.

The kernels take raw addresses (no libtorch at build time), so everything the kernel contract (``csrc/README.md``)
assumes is checked here first: one device and one dtype per list, float32 state, contiguous tensors of matching
sizes. The fake implementations run the same checks, so a bad call fails while ``torch.compile`` traces it, with
the eager message. They run on every call, so they are C-level ``map`` passes; only a failing check walks the list
in Python to name the offending entry.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence

import torch

__all__ = [
    "KERNEL_DTYPES",
    "check_flag",
    "check_list",
    "check_scalar_tensor",
    "check_steps",
    "check_update",
    "one_device",
]

#: Parameter and gradient dtypes the kernels take (codes in ``_backend.DTYPE_CODES``).
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_OP = "stepforge_fused::"
_device = operator.attrgetter("device")
_dtype = operator.attrgetter("dtype")
_numel = torch.Tensor.numel
_contiguous = torch.Tensor.is_contiguous


def one_device(op: str, lists: dict[str, Sequence[torch.Tensor]]) -> torch.device | None:
    """The one device every tensor of ``lists`` lives on (``None`` when all are empty); raises otherwise."""
    devices = {d for tensors in lists.values() for d in map(_device, tensors)}
    if not devices:
        return None
    if len(devices) > 1:
        first = next(t.device for ts in lists.values() for t in ts)
        for name, tensors in lists.items():
            for i, t in enumerate(tensors):
                if t.device != first:
                    raise RuntimeError(
                        f"{_OP}{op}: {name}[{i}] is on {t.device}, other tensors on {first}; one call steps the "
                        "tensors of one device (split the lists by device)."
                    )
    device: torch.device = next(iter(devices))
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"{_OP}{op}: tensors on {device}; the kernels run on CPU and CUDA tensors only.")
    return device


def check_list(
    op: str,
    name: str,
    tensors: Sequence[torch.Tensor],
    n: int,
    *,
    dtypes: tuple[torch.dtype, ...] = KERNEL_DTYPES,
    like: Sequence[torch.Tensor] | None = None,
) -> torch.dtype | None:
    """``tensors`` has ``n`` contiguous entries of one dtype out of ``dtypes``, each with the element count of
    the same entry of ``like``; returns that dtype (``None`` for an empty list)."""
    if len(tensors) != n:
        raise ValueError(f"{_OP}{op}: {name} has {len(tensors)} tensors, expected {n} (one per parameter).")
    if not n:
        return None
    dtype = tensors[0].dtype
    if dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{_OP}{op}: {name}[0] has dtype {dtype}; {name} must be {allowed}.")
    if any(d != dtype for d in map(_dtype, tensors)):
        i = next(i for i, t in enumerate(tensors) if t.dtype != dtype)
        raise TypeError(
            f"{_OP}{op}: {name}[{i}] has dtype {tensors[i].dtype} but {name}[0] {dtype}; one call takes one dtype "
            "per list (split the lists by dtype)."
        )
    if not all(map(_contiguous, tensors)):
        i = next(i for i, t in enumerate(tensors) if not t.is_contiguous())
        raise RuntimeError(
            f"{_OP}{op}: {name}[{i}] is not contiguous; the kernels write memory in place, so pass contiguous "
            "tensors."
        )
    if like is not None and list(map(_numel, tensors)) != list(map(_numel, like)):
        i = next(i for i, (t, p) in enumerate(zip(tensors, like, strict=True)) if t.numel() != p.numel())
        raise ValueError(
            f"{_OP}{op}: {name}[{i}] has {tensors[i].numel()} elements but its parameter {like[i].numel()}."
        )
    return dtype


def check_steps(op: str, steps: torch.Tensor, n: int, device: torch.device | None) -> None:
    """``steps``: the contiguous float32 ``(n,)`` step counts of the call's parameters, on their device."""
    if steps.dtype != torch.float32 or steps.dim() != 1 or steps.numel() != n or not steps.is_contiguous():
        raise ValueError(
            f"{_OP}{op}: steps must be a contiguous float32 tensor of shape ({n},) (one step count per parameter), "
            f"got shape {tuple(steps.shape)} {steps.dtype}."
        )
    if device is not None and steps.device != device:
        raise RuntimeError(f"{_OP}{op}: steps is on {steps.device}; put it on {device} with the parameters.")


def check_scalar_tensor(op: str, name: str, t: torch.Tensor | None, device: torch.device | None) -> None:
    """An optional one-element floating tensor (a learning rate or a divisor) on the CPU or on ``device``."""
    if t is None:
        return
    if t.numel() != 1 or not t.is_floating_point():
        raise ValueError(
            f"{_OP}{op}: {name} must be a one-element floating tensor, got shape {tuple(t.shape)} {t.dtype}."
        )
    if device is not None and t.device != device and t.device.type != "cpu":
        raise RuntimeError(f"{_OP}{op}: {name} is on {t.device}; put it on the CPU or on {device}.")


def check_flag(op: str, found_inf: torch.Tensor | None, device: torch.device | None) -> None:
    """``found_inf``: one float32 element on the tensors' device (the kernels read and raise it in place)."""
    if found_inf is None:
        return
    if found_inf.numel() != 1 or found_inf.dtype != torch.float32 or not found_inf.is_contiguous():
        raise ValueError(
            f"{_OP}{op}: found_inf must be one contiguous float32 element, got shape {tuple(found_inf.shape)} "
            f"{found_inf.dtype}."
        )
    if device is not None and found_inf.device != device:
        raise RuntimeError(
            f"{_OP}{op}: found_inf is on {found_inf.device}; put it on {device} with the tensors."
        )


def check_update(
    op: str,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor] | None,
    states: Mapping[str, Sequence[torch.Tensor]],
    masters: Sequence[torch.Tensor],
) -> tuple[torch.device | None, torch.dtype | None, torch.dtype | None]:
    """The lists of one optimizer update (``grads`` ``None`` where the op takes none); returns ``(device, param
    dtype, grad dtype)``, ``(None, None, None)`` for empty lists (nothing to do)."""
    lists: dict[str, Sequence[torch.Tensor]] = {"params": params, **states, "masters": masters}
    if grads is not None:
        lists["grads"] = grads
    device = one_device(op, lists)
    n = len(params)
    pdtype = check_list(op, "params", params, n)
    gdtype = check_list(op, "grads", grads, n, like=params) if grads is not None else pdtype
    for name, tensors in states.items():
        check_list(op, name, tensors, n, dtypes=(torch.float32,), like=params)
    if masters:
        if pdtype == torch.float32:
            raise ValueError(
                f"{_OP}{op}: masters were given for float32 params; master weights are for float16/bfloat16 "
                "params (pass masters=[] for float32)."
            )
        check_list(op, "masters", masters, n, dtypes=(torch.float32,), like=params)
    return device, pdtype, gdtype
