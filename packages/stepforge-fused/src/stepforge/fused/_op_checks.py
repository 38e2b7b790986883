# SPDX-License-Identifier: Apache-2.0
"""Argument checks of the ``stepforge_fused`` torch operators, shared by their fake and real implementations.

The kernels take raw addresses (design: no libtorch at build time), so everything the kernel contract
(``csrc/README.md``) assumes is checked here first: one device and one dtype per list, float32 state, contiguous
tensors of matching sizes. The fake (meta) implementations run the same checks, so a bad call fails while
``torch.compile`` traces it, with the same message as in eager mode.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["KERNEL_DTYPES", "check_flag", "check_list", "check_scalar_tensor", "check_update", "one_device"]

#: Parameter and gradient dtypes the kernels take (codes in ``_backend.DTYPE_CODES``).
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_OP = "stepforge_fused::"


def one_device(op: str, lists: dict[str, Sequence[torch.Tensor]]) -> torch.device | None:
    """The one device every tensor of ``lists`` lives on (``None`` when all are empty); raises otherwise."""
    device = None
    first = ""
    for name, tensors in lists.items():
        for i, t in enumerate(tensors):
            if device is None:
                device, first = t.device, f"{name}[{i}]"
            elif t.device != device:
                raise RuntimeError(
                    f"{_OP}{op}: {name}[{i}] is on {t.device} but {first} on {device}; one call steps the tensors "
                    "of one device (split the lists by device)."
                )
    if device is not None and device.type not in ("cpu", "cuda"):
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
    dtype = None
    for i, t in enumerate(tensors):
        if dtype is None:
            dtype = t.dtype
            if dtype not in dtypes:
                allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
                raise TypeError(f"{_OP}{op}: {name}[{i}] has dtype {t.dtype}; {name} must be {allowed}.")
        elif t.dtype != dtype:
            raise TypeError(
                f"{_OP}{op}: {name}[{i}] has dtype {t.dtype} but {name}[0] {dtype}; one call takes one dtype per "
                "list (split the lists by dtype)."
            )
        if not t.is_contiguous():
            raise RuntimeError(
                f"{_OP}{op}: {name}[{i}] is not contiguous; the kernels write memory in place, so pass "
                "contiguous tensors."
            )
        if like is not None and t.numel() != like[i].numel():
            raise ValueError(
                f"{_OP}{op}: {name}[{i}] has {t.numel()} elements but its parameter {like[i].numel()}."
            )
    return dtype


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
        raise RuntimeError(f"{_OP}{op}: found_inf is on {found_inf.device}; put it on {device} with the tensors.")


def check_update(
    op: str,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor] | None,
    states: dict[str, Sequence[torch.Tensor]],
    masters: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor] | None,
) -> tuple[torch.device | None, torch.dtype | None, torch.dtype | None]:
    """The lists of one optimizer update (``grads``/``steps`` ``None`` where the op takes none).

    Returns:
        ``(device, param dtype, grad dtype)``; ``(None, None, None)`` for empty lists (nothing to do).
    """
    lists: dict[str, Sequence[torch.Tensor]] = {"params": params, **states, "masters": masters}
    if grads is not None:
        lists["grads"] = grads
    if steps is not None:
        lists["steps"] = steps
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
    if steps is not None:
        check_list(op, "steps", steps, n, dtypes=(torch.float32,))
        for i, s in enumerate(steps):
            if s.numel() != 1:
                raise ValueError(f"{_OP}{op}: steps[{i}] must hold one element (the step count), got {s.numel()}.")
    return device, pdtype, gdtype
