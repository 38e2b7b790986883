# SPDX-License-Identifier: Apache-2.0
"""One argument specification per update kernel (``adam``, ``sgd``, ``lamb``), and the two calls made from it.

A :class:`KernelSpec` says what a kernel takes besides the shared arguments: its state lists and its
hyper-parameters, each read from the param group. From it come

- the operator's schema (:func:`KernelSpec.schema`, registered by :mod:`._operators`) and its implementation
  (:mod:`._operators.impls`),
- the eager step's call of the pybind kernel on a bucket's cached pointer arrays (:func:`launch`), and
- the compiled step's call of the operator on tensor lists (:func:`call_operator`).

So adding an Adam argument means the kernel (and its binding), one :class:`Arg` in :data:`ADAM`, and the class
that puts it into its param groups. The shared arguments, in kernel order::

    params, grads, *states, masters, sizes, per-tensor (steps or SGD's first_run), param dtype, grad dtype, lr,
    *hyper, grad_divisor, found_inf, check_finite, ctx (CPU threads / CUDA stream), **keywords (CUDA)

and in operator order ``params, grads, *states, masters, per-tensor, lr, lr_tensor, *hyper, grad_divisor,
grad_divisor_tensor, found_inf, check_finite, stochastic_rounding, seed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from ._backend import DTYPE_CODES
from ._step.buckets import Bucket, Launch

__all__ = ["ADAM", "LAMB", "SGD", "Arg", "KernelSpec", "call_operator", "launch", "lr_args"]


@dataclass(frozen=True)
class Arg:
    """One hyper-parameter of a kernel: its operator name and type, and where the param group keeps it.

    Attributes:
        name: the operator argument (schema) name.
        type: ``"float"`` or ``"bool"``.
        key: the param-group key. index: element of a tuple value (``betas``, ``trust_clip``), or None.
    """

    name: str
    type: str
    key: str
    index: int | None = None

    def read(self, group: dict[str, Any]) -> float | bool:
        value = group[self.key]
        if self.index is not None:
            value = value[self.index]
        return float(value) if self.type == "float" else bool(value)


@dataclass(frozen=True)
class KernelSpec:
    """What one update kernel takes besides the shared arguments (see the module docstring).

    Attributes:
        kernel: the pybind function (``_cpu.adam``). op: the operator (``torch.ops.stepforge_fused.adam_``).
        states: ``(state key, operator list name)`` per state list, in kernel order.
        hyper: the hyper-parameters, in kernel order.
        first_run: the per-tensor argument is SGD's first-run flags (else the step counts).
        optional_states: the state lists may be empty (SGD without momentum).
    """

    kernel: str
    op: str
    states: tuple[tuple[str, str], ...]
    hyper: tuple[Arg, ...]
    first_run: bool = False
    optional_states: bool = False

    def values(self, group: dict[str, Any]) -> list[float | bool]:
        """The hyper-parameters of ``group``, in kernel order."""
        return [a.read(group) for a in self.hyper]

    def arg_names(self) -> list[str]:
        """The operator's argument names, in order."""
        return [
            "params", "grads", *(name for _key, name in self.states), "masters",
            "first_run" if self.first_run else "steps", "lr", "lr_tensor", *(a.name for a in self.hyper),
            "grad_divisor", "grad_divisor_tensor", "found_inf", "check_finite", "stochastic_rounding", "seed",
        ]  # fmt: skip

    def schema(self) -> str:
        """The operator schema: ``Tensor(x!)`` marks what it writes (never the gradients)."""
        marks = iter("abcde")  # found_inf is always (f!): the schemas registered before this spec existed
        lists = [f"Tensor({next(marks)}!)[] params", "Tensor[] grads"]
        lists += [f"Tensor({next(marks)}!)[] {name}" for _key, name in self.states]
        lists.append(f"Tensor({next(marks)}!)[] masters")
        lists.append(
            f"Tensor({next(marks)}!)? first_run" if self.first_run else f"Tensor({next(marks)}!) steps"
        )
        hyper = [f"{a.type} {a.name}" for a in self.hyper]
        tail = [
            "float grad_divisor", "Tensor? grad_divisor_tensor", "Tensor(f!)? found_inf",
            "bool check_finite", "bool stochastic_rounding", "int seed",
        ]  # fmt: skip
        args = ", ".join([*lists, "float lr", "Tensor? lr_tensor", *hyper, *tail])
        return f"{self.op}({args}) -> ()"


_BETAS = (Arg("beta1", "float", "betas", 0), Arg("beta2", "float", "betas", 1), Arg("eps", "float", "eps"))
_ADAM_STATES = (("exp_avg", "exp_avgs"), ("exp_avg_sq", "exp_avg_sqs"))

#: Adam/AdamW (FusedAdam, CPUAdam, HybridAdam; adam_math.h)
ADAM = KernelSpec(
    "adam",
    "adam_",
    _ADAM_STATES,
    (
        *_BETAS,
        Arg("weight_decay", "float", "weight_decay"),
        Arg("adamw_mode", "bool", "adamw_mode"),
        Arg("bias_correction", "bool", "bias_correction"),
    ),
)

#: SGD with momentum/nesterov/dampening (FusedSGD; sgd_math.h)
SGD = KernelSpec(
    "sgd",
    "sgd_",
    (("momentum_buffer", "momentum_buffers"),),
    (
        Arg("momentum", "float", "momentum"),
        Arg("dampening", "float", "dampening"),
        Arg("weight_decay", "float", "weight_decay"),
        Arg("nesterov", "bool", "nesterov"),
        Arg("wd_after_momentum", "bool", "wd_after_momentum"),
    ),
    first_run=True,
    optional_states=True,
)

#: LAMB (FusedLAMB; lamb_math.h): apex's names (``adam_w_mode``); the last two are the trust-ratio clamp
LAMB = KernelSpec(
    "lamb",
    "lamb_",
    _ADAM_STATES,
    (
        *_BETAS,
        Arg("weight_decay", "float", "weight_decay"),
        Arg("adam_w_mode", "bool", "adam_w_mode"),
        Arg("bias_correction", "bool", "bias_correction"),
        Arg("grad_averaging", "bool", "grad_averaging"),
        Arg("use_nvlamb", "bool", "use_nvlamb"),
        Arg("trust_clip_min", "float", "trust_clip", 0),
        Arg("trust_clip_max", "float", "trust_clip", 1),
    ),
)


def launch(
    spec: KernelSpec, module: ModuleType, bucket: Bucket, group: dict[str, Any], at: Launch, **kw: Any
) -> Any:
    """The eager step's kernel call on ``bucket`` (its cached pointer arrays) with the scalars in ``at``;
    returns the kernel's answer: whether its finite check skipped the update (None: decided on the device)."""
    ptrs = bucket.ptrs
    return getattr(module, spec.kernel)(
        ptrs["params"],
        ptrs["grads"],
        *[ptrs.get(key) for key, _name in spec.states],
        ptrs.get("masters"),
        bucket.sizes,
        bucket.first_run if spec.first_run else at.steps,
        DTYPE_CODES[bucket.param_dtype],
        DTYPE_CODES[bucket.grad_dtype],
        at.lr,
        *spec.values(group),
        at.divisor,
        at.found_inf_ptr,
        at.check_finite,
        at.ctx,
        **at.kw,
        **kw,
    )


def lr_args(group: dict[str, Any]) -> tuple[float, torch.Tensor | None]:
    """``(lr, lr_tensor)`` of an operator call: a tensor lr is read by the graph (no recompile when it changes),
    a float lr is a constant of the graph."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        return 0.0, lr
    return float(lr), None


def call_operator(
    spec: KernelSpec,
    group: dict[str, Any],
    lists: list[list[torch.Tensor]],
    per_tensor: torch.Tensor | None,
    grad_divisor: float,
    grad_divisor_tensor: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    check_finite: bool,
) -> None:
    """The compiled step's call of ``spec``'s operator: ``lists`` = ``[params, grads, *states, masters]``,
    ``per_tensor`` the step counts (or SGD's first-run flags)."""
    lr, lr_tensor = lr_args(group)
    getattr(torch.ops.stepforge_fused, spec.op)(
        *lists, per_tensor, lr, lr_tensor, *spec.values(group), grad_divisor, grad_divisor_tensor, found_inf,
        check_finite, False, 0,
    )  # fmt: skip
