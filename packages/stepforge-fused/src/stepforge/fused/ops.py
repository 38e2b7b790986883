# SPDX-License-Identifier: Apache-2.0
"""stepforge-fused's kernels as torch operators, ``torch.ops.stepforge_fused.<name>``, registered at import.

Each kernel of the contract (``csrc/README.md``) is an operator defined with ``torch.library`` over the pybind11
binding (design: no libtorch at build time): an explicit schema (:data:`SCHEMAS`) that says what it mutates, a
fake implementation that runs the argument checks and describes the outputs while ``torch.compile`` traces, and
one implementation for the CPU and CUDA dispatch keys (:mod:`._operators.impls`). Inductor calls a mutating
operator on the graph inputs themselves (it re-inplaces the functionalised mutation): no copy of the state.
``torch.library.define`` + ``impl`` rather than ``custom_op``: the latter's Python autograd and version-counter
wrappers cost about 150 us per call on 41 tensors, more than the demo model's whole step.

================== ============================================================================================
``adam_``          Adam/AdamW (:data:`._backend.ADAM`): master weights, bf16 stochastic rounding (CUDA)
``sgd_``           SGD, momentum/nesterov/dampening, master weights (:data:`._backend.SGD`)
``lamb_``          LAMB in one call (:data:`._backend.LAMB`)
``lamb_moments_``  LAMB's first phase: moments, returns the per-tensor norm sums
``lamb_apply_``    LAMB's second phase: the update from (e.g. all-reduced) sums
``l2norm``         global and per-tensor L2 norms
``scale_``         ``dst = src * scale`` with an inf/NaN flag
================== ============================================================================================

Gradients are read only (``scale_`` unscales in a pass of its own), so a compiled step does not mutate its
gradient inputs (CUDA graphs of ``mode="reduce-overhead"`` keep them as plain inputs). ``steps`` (a contiguous
float32 ``(n,)`` tensor, one count per parameter) count the steps taken: an update uses ``step + 1`` and advances
them unless it was skipped (``found_inf`` raised on entry, or raised by ``check_finite``; on CUDA decided on the
device, without a sync). ``lr_tensor`` replaces ``lr`` and ``grad_divisor_tensor`` multiplies ``grad_divisor``.
For example::

    >>> import stepforge.fused, torch
    >>> steps = torch.zeros(len(params))  # one count per parameter, advanced by the call
    >>> torch.ops.stepforge_fused.adam_(params, grads, exp_avgs, exp_avg_sqs, [], steps, 1e-3, None, 0.9, 0.999,
    ...     1e-8, 0.0, True, True, 1.0, None, None, False, False, 0)

The optimizers' eager ``step()`` calls the kernels with cached pointer arrays instead (an operator call reads
every tensor's address, about 0.2 us each: +10-20 ms per step on 20 000 small tensors); their compiled step calls
these operators. On a torch without ``torch.library.register_fake`` (torch < 2.4), or where registering fails,
nothing is registered: :func:`available` is False, :func:`unavailable_reason` says why, compiled steps run eagerly.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ._backend import ADAM, LAMB, SGD
from ._operators.impls import (
    LAMB_PHASES,
    by_name,
    checks,
    l2norm,
    l2norm_checks,
    lamb_apply_,
    lamb_moments_,
    lamb_norms_like,
    scale_,
    scale_checks,
    update,
)

__all__ = ["NAMESPACE", "OPERATORS", "SCHEMAS", "available", "unavailable_reason"]

NAMESPACE = "stepforge_fused"

#: the operator schemas: ``Tensor(x!)`` marks what an operator writes; gradients are never written
SCHEMAS: dict[str, str] = {
    **{spec.op: spec.schema() for spec in (ADAM, SGD, LAMB)},
    **LAMB_PHASES,
    "l2norm": "l2norm(Tensor[] tensors, bool per_tensor) -> (Tensor, Tensor)",
    "scale_": "scale_(Tensor[] src, Tensor(a!)[] dst, float scale, Tensor(b!)? found_inf) -> ()",
}

_Checks = Callable[[dict[str, Any]], Any]
_FakeOut = Callable[[dict[str, Any]], Any] | None


def _l2norm_out(args: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    tensors = args["tensors"]
    device = tensors[0].device if tensors else torch.device("cpu")
    dtype = torch.float64 if device.type == "cpu" else torch.float32
    n = len(tensors) if args["per_tensor"] else 0
    return torch.empty((), dtype=dtype, device=device), torch.empty(n, dtype=torch.float32, device=device)


#: name -> (implementation, its checks on the arguments by name, what its fake returns; None: nothing)
_IMPLS: dict[str, tuple[Callable[..., Any], _Checks, _FakeOut]] = {
    **{
        spec.op: (
            by_name(SCHEMAS[spec.op], functools.partial(update, spec)),
            functools.partial(checks, spec.op, spec),
            None,
        )
        for spec in (ADAM, SGD, LAMB)
    },
    "lamb_moments_": (
        by_name(SCHEMAS["lamb_moments_"], lamb_moments_),
        functools.partial(checks, "lamb_moments_", LAMB),
        lambda a: lamb_norms_like(a["params"]),
    ),
    "lamb_apply_": (
        by_name(SCHEMAS["lamb_apply_"], lamb_apply_),
        functools.partial(checks, "lamb_apply_", LAMB),
        None,
    ),
    "l2norm": (l2norm, l2norm_checks, _l2norm_out),
    "scale_": (scale_, scale_checks, None),
}

#: every operator registered here, as ``torch.ops.stepforge_fused.<name>``
OPERATORS = tuple(SCHEMAS)

_status: dict[str, Any] = {"available": False, "reason": "stepforge.fused.ops.register() has not run"}
_libraries: list[Any] = []  # the torch.library.Library holding the definitions (kept alive)


def _fake(fn: Callable[..., Any], checks: _Checks, out: _FakeOut) -> Callable[..., Any]:
    """The fake implementation: the real checks on fake tensors, then outputs of the right metadata."""
    signature = inspect.signature(fn)

    def fake(*args: Any, **kwargs: Any) -> Any:
        bound = dict(signature.bind(*args, **kwargs).arguments)
        checks(bound)
        return out(bound) if out is not None else None

    fake.__name__ = f"{fn.__name__}_fake"
    return fake


def register() -> bool:
    """Define and register every operator (once per process; called at import). Returns :func:`available`."""
    if _status["available"]:
        return True
    missing = [name for name in ("Library", "register_fake") if not hasattr(torch.library, name)]
    if missing:
        why = f"torch {torch.__version__} has no torch.library.{', torch.library.'.join(missing)} (torch >= 2.4 has them)"
        _status.update(available=False, reason=why)
        return False
    name = ""
    try:
        lib = torch.library.Library(NAMESPACE, "FRAGMENT")
        for name, schema in SCHEMAS.items():
            fn, checks, out = _IMPLS[name]
            lib.define(schema)
            for key in ("CPU", "CUDA"):
                lib.impl(name, fn, key)
            torch.library.register_fake(f"{NAMESPACE}::{name}", _fake(fn, checks, out), lib=lib)
    except Exception as exc:  # an older torch that cannot hold one of the schemas, or a second registration
        _status.update(
            available=False, reason=f"registering {NAMESPACE}::{name} failed: {type(exc).__name__}: {exc}"
        )
        return False
    _libraries.append(lib)
    _status.update(available=True, reason="")
    return True


def available() -> bool:
    """Whether the ``stepforge_fused`` operators are registered (and compiled optimizer steps can use them)."""
    return bool(_status["available"])


def unavailable_reason() -> str:
    """Why the operators are not available (empty when they are)."""
    return str(_status["reason"])


register()
