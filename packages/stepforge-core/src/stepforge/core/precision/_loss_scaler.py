# SPDX-License-Identifier: Apache-2.0
"""``DynamicLossScaler``: the one dynamic loss scaler of stepforge (Booster fp16, FSDP2/gemini, ZeRO), and the
one validation of its arguments (:func:`validate_loss_scaler_args`: the scaler, fp16 mixed precision and every
plugin).

The rule is ColossalAI's ``DynamicGradScaler`` (also Megatron's): an overflowing step resets the clean-step count
and spends one unit of the hysteresis budget; once the budget is spent, every overflow backs the scale off
(``* backoff_factor``, never below ``min_scale``) until ``growth_interval`` clean steps in a row grow it
(``* growth_factor``, never above ``max_scale``) and refill the budget. With ``hysteresis=1`` (the default) this is
``torch.amp.GradScaler``'s rule exactly.

Its ``state_dict`` carries ``GradScaler``'s keys (``scale``, ``growth_factor``, ``backoff_factor``,
``growth_interval``, ``_growth_tracker``) plus ``min_scale``, ``max_scale``, ``hysteresis`` and
``_hysteresis_left``; ``load_state_dict`` also reads a ``GradScaler`` state dict and the format of stepforge-zero's
former scaler (``growth_tracker``, ``hysteresis_left``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, TypedDict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..errors import HyperParameterError

__all__ = [
    "DynamicLossScaler",
    "LossScalerArgs",
    "LOSS_SCALER_DEFAULTS",
    "STATE_KEYS",
    "validate_loss_scaler_args",
]

#: keys of :meth:`DynamicLossScaler.state_dict` (GradScaler's five first).
STATE_KEYS = (
    "scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "_growth_tracker",
    "min_scale",
    "max_scale",
    "hysteresis",
    "_hysteresis_left",
)
# stepforge-zero's scaler (main before core.precision) wrote the two counters without the underscore
_OLD_ZERO_KEYS = {"growth_tracker": "_growth_tracker", "hysteresis_left": "_hysteresis_left"}


class LossScalerArgs(TypedDict):
    """Validated arguments of :class:`~stepforge.core.precision.DynamicLossScaler` (ColossalAI's names)."""

    initial_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    min_scale: float
    max_scale: float
    hysteresis: int


#: ``torch.amp.GradScaler``'s defaults, plus ColossalAI's bounds; hysteresis 1 backs off on every overflow
#: (GradScaler's rule). ColossalAI's plugins pass their own (``growth_interval=1000``, ``hysteresis=2``).
LOSS_SCALER_DEFAULTS = LossScalerArgs(
    initial_scale=2.0**16,
    growth_factor=2.0,
    backoff_factor=0.5,
    growth_interval=2000,
    min_scale=1.0,
    max_scale=2.0**32,
    hysteresis=1,
)


def _number(owner: str, name: str, value: Any, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise HyperParameterError(f"{owner}: {name} must be a finite number, got {value!r}.")
    return float(value)


def _count(owner: str, name: str, value: Any, default: int, low: int = 1) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise HyperParameterError(f"{owner}: {name} must be an int >= {low}, got {value!r}.")
    return value


def validate_loss_scaler_args(
    owner: str,
    *,
    initial_scale: Any = None,
    growth_factor: Any = None,
    backoff_factor: Any = None,
    growth_interval: Any = None,
    min_scale: Any = None,
    max_scale: Any = None,
    hysteresis: Any = None,
    init_scale: Any = None,
) -> LossScalerArgs:
    """Check the dynamic loss scaler's arguments and return them as floats/ints (``None``: the default).

    ``init_scale`` (``torch.amp.GradScaler``'s spelling) is an alias of ``initial_scale``.

    Rules: ``0 < min_scale <= initial_scale <= max_scale``, ``growth_factor > 1``, ``0 < backoff_factor < 1``,
    ``growth_interval`` and ``hysteresis`` ints >= 1.

    Raises:
        HyperParameterError: the first bad argument, named with ``owner`` (the class the user called) and the
            allowed range.
    """
    scale_name = "initial_scale"
    if init_scale is not None:
        scale_name = "init_scale"  # name what the caller passed
        if initial_scale is not None:
            raise HyperParameterError(
                f"{owner}: initial_scale and init_scale are the same argument (init_scale is GradScaler's "
                f"spelling); pass one of them, got initial_scale={initial_scale!r}, init_scale={init_scale!r}."
            )
        initial_scale = init_scale
    d = LOSS_SCALER_DEFAULTS
    initial = _number(owner, scale_name, initial_scale, d["initial_scale"])
    low = _number(owner, "min_scale", min_scale, d["min_scale"])
    high = _number(owner, "max_scale", max_scale, d["max_scale"])
    growth = _number(owner, "growth_factor", growth_factor, d["growth_factor"])
    backoff = _number(owner, "backoff_factor", backoff_factor, d["backoff_factor"])
    if not low > 0:
        raise HyperParameterError(f"{owner}: min_scale must be > 0, got {min_scale!r}.")
    if not high >= low:
        raise HyperParameterError(f"{owner}: max_scale must be >= min_scale ({low:g}), got {max_scale!r}.")
    if not low <= initial <= high:
        raise HyperParameterError(
            f"{owner}: {scale_name} must lie in [min_scale, max_scale] = [{low:g}, {high:g}], got {initial:g}."
        )
    if not growth > 1:
        raise HyperParameterError(f"{owner}: growth_factor must be > 1, got {growth_factor!r}.")
    if not 0 < backoff < 1:
        raise HyperParameterError(f"{owner}: backoff_factor must be in (0, 1), got {backoff_factor!r}.")
    return LossScalerArgs(
        initial_scale=initial,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=_count(owner, "growth_interval", growth_interval, d["growth_interval"]),
        min_scale=low,
        max_scale=high,
        hysteresis=_count(owner, "hysteresis", hysteresis, d["hysteresis"]),
    )


class DynamicLossScaler:
    """Dynamic loss scaling for fp16 training (the rule: see the module docstring).

    Arguments: ColossalAI's ``DynamicGradScaler`` names and order (``init_scale``, GradScaler's spelling, is an
    alias of ``initial_scale``) with ``torch.amp.GradScaler``'s defaults (:data:`LOSS_SCALER_DEFAULTS`), checked
    by :func:`validate_loss_scaler_args`. ``process_group``: the ranks that must agree on skipping a step
    (sharded gradients: FSDP2, ZeRO), over which the overflow flag is all-reduced with MAX (``None``: this process
    decides alone). :attr:`found_inf`: whether the last unscale found an inf or NaN on any rank of the group
    (reset by :meth:`update`).
    """

    def __init__(
        self,
        initial_scale: float | None = None,
        growth_factor: float | None = None,
        backoff_factor: float | None = None,
        growth_interval: int | None = None,
        min_scale: float | None = None,
        max_scale: float | None = None,
        hysteresis: int | None = None,
        process_group: Any = None,
        *,
        init_scale: float | None = None,
    ) -> None:
        args = validate_loss_scaler_args(
            type(self).__name__,
            initial_scale=initial_scale,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            min_scale=min_scale,
            max_scale=max_scale,
            hysteresis=hysteresis,
        )
        self._configure(args)
        self.process_group = process_group
        self._scale = args["initial_scale"]
        self._growth_tracker = 0  # clean steps since the last growth or overflow
        # overflows left before a back-off; 0: every overflow backs off until the next growth
        self._hysteresis_left = self.hysteresis
        self.found_inf = False

    def _configure(self, args: LossScalerArgs) -> None:
        self.growth_factor = args["growth_factor"]
        self.backoff_factor = args["backoff_factor"]
        self.growth_interval = args["growth_interval"]
        self.min_scale = args["min_scale"]
        self.max_scale = args["max_scale"]
        self.hysteresis = args["hysteresis"]

    # -- GradScaler surface --------------------------------------------------------------------------------
    def get_scale(self) -> float:
        """The current scale."""
        return self._scale

    def get_growth_factor(self) -> float:
        """The multiplier applied after ``growth_interval`` clean steps (GradScaler's getter)."""
        return self.growth_factor

    def get_backoff_factor(self) -> float:
        """The multiplier applied on a back-off (GradScaler's getter)."""
        return self.backoff_factor

    def get_growth_interval(self) -> int:
        """Clean steps in a row before a growth (GradScaler's getter)."""
        return self.growth_interval

    def is_enabled(self) -> bool:
        """Always ``True`` (GradScaler's ``enabled``: build no scaler instead of a disabled one)."""
        return True

    def scale(self, outputs: torch.Tensor) -> torch.Tensor:
        """``outputs * scale`` (a new tensor, any shape and floating dtype; backward through it)."""
        return outputs * self._scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide every gradient of ``optimizer``'s param groups by the scale (DTensor gradients through
        their local shards); return whether any rank of the group found an inf or NaN."""
        grads = (p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None)
        return self.unscale_grads_(grads)

    @torch.no_grad()
    def unscale_grads_(self, grads: Iterable[torch.Tensor]) -> bool:
        """Divide ``grads`` in place by the scale and return whether any of them, on any rank of the group,
        holds an inf or NaN (ZeRO passes its gradient shards)."""
        inv = 1.0 / self._scale
        flags: dict[torch.device, list[torch.Tensor]] = {}
        for grad in grads:
            g = grad.to_local() if isinstance(grad, DTensor) else grad
            if g.numel() == 0:
                continue
            # one host sync per device at the end, not one per tensor
            flags.setdefault(g.device, []).append(torch.isfinite(g).all())
            g.mul_(inv)
        local = any(not bool(torch.stack(per_device).all()) for per_device in flags.values())
        self.found_inf = self.agree(local)
        return self.found_inf

    def agree(self, found_inf: bool) -> bool:
        """``found_inf`` all-reduced with MAX over the process group: ``True`` on every rank when one rank
        overflowed (without a group, or outside ``torch.distributed``, the local verdict)."""
        group = self.process_group
        if group is None or not (dist.is_available() and dist.is_initialized()):
            return bool(found_inf)
        flag = torch.tensor([1.0 if found_inf else 0.0], device=_comm_device(group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item() > 0)

    def update(self, overflow: bool | None = None) -> None:
        """Record one step: ``overflow`` (ColossalAI's argument) or, when omitted, :attr:`found_inf` from the
        last unscale (GradScaler's way). Resets :attr:`found_inf`."""
        if overflow is None:
            overflow = self.found_inf
        if overflow:
            self._growth_tracker = 0
            self._hysteresis_left = max(self._hysteresis_left - 1, 0)
            if self._hysteresis_left == 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker >= self.growth_interval:
                self._scale = min(self._scale * self.growth_factor, self.max_scale)
                self._growth_tracker = 0
                self._hysteresis_left = self.hysteresis
        self.found_inf = False

    # -- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: :data:`STATE_KEYS` (floats and ints only), the attributes of
        those names (``scale`` is ``_scale``)."""
        return {key: getattr(self, "_scale" if key == "scale" else key) for key in STATE_KEYS}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load :meth:`state_dict`'s output, a ``torch.amp.GradScaler`` state dict, or a state written by either
        scaler of stepforge before ``core.precision`` (zero's ``growth_tracker``/``hysteresis_left``). Keys it
        lacks keep their current values; the counters restart.

        Raises:
            HyperParameterError: not a loss-scaler state (no ``scale``, an unknown key: the message names it),
                or a value out of range. Nothing is changed then.
        """
        where = f"{type(self).__name__}.load_state_dict"
        if not isinstance(state_dict, Mapping):
            raise HyperParameterError(f"{where}: expected a dict, got {type(state_dict).__name__}.")
        state = dict(state_dict)
        for old, new in _OLD_ZERO_KEYS.items():
            if old in state:
                if new in state:
                    raise HyperParameterError(f"{where}: the state has both {old!r} and {new!r}; keep one.")
                state[new] = state.pop(old)
        unknown = sorted(set(state) - set(STATE_KEYS), key=str)
        if unknown:
            raise HyperParameterError(
                f"{where}: unexpected key {unknown[0]!r} (all unknown: {unknown}); a loss-scaler state has "
                f"{', '.join(STATE_KEYS)}. Pass the dict written by DynamicLossScaler.state_dict() or "
                "torch.amp.GradScaler.state_dict(), not the optimizer's or the whole checkpoint."
            )
        if "scale" not in state:
            raise HyperParameterError(
                f"{where}: the state has no 'scale' key (keys: {sorted(state)}); an empty dict is what a disabled "
                "GradScaler writes, which holds nothing to load."
            )
        state = {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        scale = state["scale"]
        if (
            isinstance(scale, bool)
            or not isinstance(scale, int | float)
            or not (math.isfinite(scale) and scale > 0)
        ):
            raise HyperParameterError(f"{where}: 'scale' must be a finite number > 0, got {scale!r}.")
        # the configuration is checked as the constructor checks it; the scale itself may lie outside
        # [min_scale, max_scale] (a GradScaler state has no bounds)
        low = state.get("min_scale", self.min_scale)
        args = validate_loss_scaler_args(
            where,
            initial_scale=low,
            growth_factor=state.get("growth_factor", self.growth_factor),
            backoff_factor=state.get("backoff_factor", self.backoff_factor),
            growth_interval=state.get("growth_interval", self.growth_interval),
            min_scale=low,
            max_scale=state.get("max_scale", self.max_scale),
            hysteresis=state.get("hysteresis", self.hysteresis),
        )
        tracker = _count(where, "'_growth_tracker'", state.get("_growth_tracker", 0), 0, low=0)
        left = _count(
            where, "'_hysteresis_left'", state.get("_hysteresis_left", args["hysteresis"]), 0, low=0
        )
        self._configure(args)
        self._scale = float(scale)
        self._growth_tracker = tracker
        self._hysteresis_left = min(left, self.hysteresis)
        self.found_inf = False

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(scale={self._scale:g}, growth_factor={self.growth_factor:g}, "
            f"backoff_factor={self.backoff_factor:g}, growth_interval={self.growth_interval}, "
            f"min_scale={self.min_scale:g}, max_scale={self.max_scale:g}, hysteresis={self.hysteresis})"
        )


def _comm_device(group: Any) -> torch.device:
    # NCCL reduces CUDA tensors only; gloo (and the rest) CPU ones
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
