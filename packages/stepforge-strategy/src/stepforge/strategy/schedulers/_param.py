# SPDX-License-Identifier: Apache-2.0
"""Parameter schedulers with mmengine's semantics (``mmengine.optim.scheduler.param_scheduler``).

Every scheduler is *chainable*: it reads the current value from the param group and multiplies or moves it,
so two schedulers over disjoint ``[begin, end)`` ranges (a warm-up then a decay) compose as in mmengine. The
clock ``_global_step`` counts calls to :meth:`ParamScheduler.step`; inside ``[begin, end)`` the local
``last_step`` advances and ``_get_value`` decides the new value. Construction performs the first ``step()``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from stepforge.accum import GradAccumOptimizer, OptimWrapper

__all__ = [
    "INF",
    "ParamScheduler",
    "StepParamScheduler",
    "MultiStepParamScheduler",
    "ConstantParamScheduler",
    "ExponentialParamScheduler",
    "CosineAnnealingParamScheduler",
    "LinearParamScheduler",
    "PolyParamScheduler",
    "OneCycleParamScheduler",
]

#: mmengine's "no end" sentinel.
INF = int(1e9)


def _check_factor(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(
            f"{name} must lie in [0, 1] (a multiplicative factor of the initial value), got {value}"
        )


class ParamScheduler:
    """Base class: schedules ``param_group[param_name]`` of ``optimizer`` over the steps ``[begin, end)``.

    Args:
        optimizer: a ``torch.optim.Optimizer`` or anything with ``param_groups`` (an optim wrapper).
        param_name: the param-group key to schedule (``"lr"``, ``"momentum"``, ``"weight_decay"``...).
        begin: first step (inclusive) at which the scheduler acts.
        end: step (exclusive) after which it stops acting.
        last_step: ``-1`` for a fresh schedule; otherwise the groups must hold ``initial_<param_name>``.
        by_epoch: whether the caller steps it once per epoch (True) or once per iteration (False).
        verbose: print each new value.
    """

    def __init__(
        self,
        optimizer: Any,
        param_name: str,
        begin: int = 0,
        end: int = INF,
        last_step: int = -1,
        by_epoch: bool = True,
        verbose: bool = False,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer | OptimWrapper | GradAccumOptimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer or an optim wrapper, got {type(optimizer).__name__}"
            )
        if end <= begin:
            raise ValueError(f"end must be larger than begin, got begin={begin}, end={end}")
        if not isinstance(last_step, int) or last_step < -1:
            raise ValueError(f"last_step must be an int >= -1, got {last_step!r}")
        self.optimizer = optimizer
        self.param_name = param_name
        self.begin = begin
        self.end = end
        self.by_epoch = by_epoch
        self.verbose = verbose
        key = f"initial_{param_name}"
        if last_step == -1:
            for group in optimizer.param_groups:
                if param_name not in group:
                    raise KeyError(f"param group has no {param_name!r} to schedule; keys: {sorted(group)}")
                group.setdefault(key, group[param_name])
        else:
            for i, group in enumerate(optimizer.param_groups):
                if key not in group:
                    raise KeyError(f"param_groups[{i}] has no {key!r}: resuming a schedule needs it")
        self.base_values = [group[key] for group in optimizer.param_groups]
        self.last_step = last_step
        self._global_step = -1
        self._last_value: list[float] = []
        self.step()

    def state_dict(self) -> dict[str, Any]:
        """Everything but the optimizer (mmengine's layout)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "anneal_func")}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.__dict__.update({k: v for k, v in state_dict.items() if k != "optimizer"})

    def get_last_value(self) -> list[float]:
        """The values set by the last :meth:`step`, one per param group."""
        return self._last_value

    def _get_value(self) -> list[float]:  # pragma: no cover - every subclass defines it
        raise TypeError(f"{type(self).__name__} must define _get_value")

    def _current(self) -> list[float]:
        return [group[self.param_name] for group in self.optimizer.param_groups]

    def step(self) -> None:
        """Advance the clock by one; inside ``[begin, end)`` compute and set the new values."""
        self._global_step += 1
        if self.begin <= self._global_step < self.end:
            self.last_step += 1
            for i, (group, value) in enumerate(
                zip(self.optimizer.param_groups, self._get_value(), strict=True)
            ):
                group[self.param_name] = value
                if self.verbose:
                    print(f"Adjusting parameter value of group {i} to {value:.4e}.")
        self._last_value = self._current()

    @classmethod
    def build_iter_from_epoch(
        cls, *args: Any, begin: int = 0, end: int = INF, by_epoch: bool = True, epoch_length: int | None = None,
        **kwargs: Any,
    ) -> ParamScheduler:  # fmt: skip
        """mmengine's ``convert_to_iter_based``: epochs -> iterations (``begin``/``end`` and step-like args)."""
        if not by_epoch:
            raise ValueError("convert_to_iter_based=True needs an epoch-based scheduler (by_epoch=True)")
        if not isinstance(epoch_length, int) or epoch_length <= 0:
            raise ValueError(
                f"convert_to_iter_based=True needs epoch_length (a positive int in dispatch_kwargs), "
                f"got {epoch_length!r}"
            )
        for name in cls._epoch_scaled:
            if kwargs.get(name) is not None:
                value = kwargs[name]
                kwargs[name] = (
                    [v * epoch_length for v in value]
                    if isinstance(value, list | tuple)
                    else value * epoch_length
                )
        begin = int(begin * epoch_length)
        if end != INF:
            end = int(end * epoch_length)
        kwargs.update(begin=begin, end=end, by_epoch=False)  # not in kwargs: they are parameters here
        return cls(*args, **kwargs)

    #: constructor arguments measured in steps that ``convert_to_iter_based`` multiplies by the epoch length
    _epoch_scaled: tuple[str, ...] = ()


class StepParamScheduler(ParamScheduler):
    """Multiply by ``gamma`` every ``step_size`` steps."""

    _epoch_scaled = ("step_size",)

    def __init__(
        self, optimizer: Any, param_name: str, step_size: int, gamma: float = 0.1, **kwargs: Any
    ) -> None:
        if not isinstance(step_size, int) or step_size <= 0:
            raise ValueError(f"step_size must be a positive int, got {step_size!r}")
        self.step_size = step_size
        self.gamma = gamma
        super().__init__(optimizer, param_name, **kwargs)

    def _get_value(self) -> list[float]:
        if self.last_step == 0 or self.last_step % self.step_size != 0:
            return self._current()
        return [v * self.gamma for v in self._current()]


class MultiStepParamScheduler(ParamScheduler):
    """Multiply by ``gamma`` at each milestone (a repeated milestone applies ``gamma`` that many times)."""

    _epoch_scaled = ("milestones",)

    def __init__(
        self, optimizer: Any, param_name: str, milestones: Sequence[int], gamma: float = 0.1, **kwargs: Any
    ) -> None:
        self.milestones = Counter(milestones)
        self.gamma = gamma
        super().__init__(optimizer, param_name, **kwargs)

    def _get_value(self) -> list[float]:
        if self.last_step not in self.milestones:
            return self._current()
        return [v * self.gamma ** self.milestones[self.last_step] for v in self._current()]


class ConstantParamScheduler(ParamScheduler):
    """``factor`` * the value from ``begin`` until ``end - 1``, then back to the value."""

    def __init__(self, optimizer: Any, param_name: str, factor: float = 1.0 / 3, **kwargs: Any) -> None:
        _check_factor("factor", factor)
        self.factor = factor
        self.total_iters = kwargs.get("end", INF) - kwargs.get("begin", 0) - 1
        super().__init__(optimizer, param_name, **kwargs)

    def _get_value(self) -> list[float]:
        if self.last_step == 0:
            return [v * self.factor for v in self._current()]
        if self.last_step != self.total_iters:
            return self._current()
        return [v * (1.0 / self.factor) for v in self._current()]


class ExponentialParamScheduler(ParamScheduler):
    """Multiply by ``gamma`` every step after the first."""

    def __init__(self, optimizer: Any, param_name: str, gamma: float, **kwargs: Any) -> None:
        self.gamma = gamma
        super().__init__(optimizer, param_name, **kwargs)

    def _get_value(self) -> list[float]:
        if self.last_step == 0:
            return self._current()
        return [v * self.gamma for v in self._current()]


class CosineAnnealingParamScheduler(ParamScheduler):
    """Cosine from the current value to ``eta_min`` (or ``eta_min_ratio`` * initial) over ``T_max`` steps."""

    _epoch_scaled = ("T_max",)

    def __init__(
        self,
        optimizer: Any,
        param_name: str,
        T_max: int | None = None,
        eta_min: float | None = None,
        eta_min_ratio: float | None = None,
        **kwargs: Any,
    ) -> None:
        if eta_min is None and eta_min_ratio is None:
            eta_min = 0.0
        if eta_min is not None and eta_min_ratio is not None:
            raise ValueError("give either eta_min or eta_min_ratio, not both")
        self.T_max = T_max or (kwargs.get("end", INF) - kwargs.get("begin", 0))
        self.eta_min = eta_min
        self.eta_min_ratio = eta_min_ratio
        super().__init__(optimizer, param_name, **kwargs)

    def _eta_min(self, base: float) -> float:
        if self.eta_min_ratio is not None:
            return base * self.eta_min_ratio
        assert self.eta_min is not None, "__init__ sets eta_min=0.0 when neither is given"
        return self.eta_min

    def _get_value(self) -> list[float]:
        t, tmax = self.last_step, self.T_max
        if t == 0:
            return self._current()
        if (t - 1 - tmax) % (2 * tmax) == 0:
            return [
                v + (base - self._eta_min(base)) * (1 - math.cos(math.pi / tmax)) / 2
                for base, v in zip(self.base_values, self._current(), strict=True)
            ]
        return [
            (1 + math.cos(math.pi * t / tmax))
            / (1 + math.cos(math.pi * (t - 1) / tmax))
            * (v - self._eta_min(base))
            + self._eta_min(base)
            for base, v in zip(self.base_values, self._current(), strict=True)
        ]


class LinearParamScheduler(ParamScheduler):
    """Linear from ``start_factor`` * value at ``begin`` to ``end_factor`` * value at ``end - 1``."""

    def __init__(
        self,
        optimizer: Any,
        param_name: str,
        start_factor: float = 1.0 / 3,
        end_factor: float = 1.0,
        **kwargs: Any,
    ) -> None:
        _check_factor("start_factor", start_factor)
        _check_factor("end_factor", end_factor)
        self.start_factor = start_factor
        self.end_factor = end_factor
        self.total_iters = kwargs.get("end", INF) - kwargs.get("begin", 0) - 1
        super().__init__(optimizer, param_name, **kwargs)

    def _get_value(self) -> list[float]:
        if self.last_step == 0:
            return [v * self.start_factor for v in self._current()]
        d = self.end_factor - self.start_factor
        return [
            v * (1.0 + d / (self.total_iters * self.start_factor + (self.last_step - 1) * d))
            for v in self._current()
        ]


class PolyParamScheduler(ParamScheduler):
    """Polynomial decay to ``eta_min`` with ``power`` over ``[begin, end)``."""

    def __init__(
        self, optimizer: Any, param_name: str, eta_min: float = 0.0, power: float = 1.0, **kwargs: Any
    ) -> None:
        self.eta_min = eta_min
        self.power = power
        self.total_iters = kwargs.get("end", INF) - kwargs.get("begin", 0) - 1
        super().__init__(optimizer, param_name, **kwargs)

    def _get_value(self) -> list[float]:
        if self.last_step == 0:
            return self._current()
        f = (1 - 1 / (self.total_iters - self.last_step + 1)) ** self.power
        return [(v - self.eta_min) * f + self.eta_min for v in self._current()]


class OneCycleParamScheduler(ParamScheduler):
    """The 1cycle policy (learning rate only), mmengine's phases and annealing functions."""

    _epoch_scaled = ("total_steps",)

    def __init__(
        self,
        optimizer: Any,
        param_name: str,
        eta_max: float | Sequence[float] = 0.0,
        total_steps: int | None = None,
        pct_start: float = 0.3,
        anneal_strategy: str = "cos",
        div_factor: float = 25.0,
        final_div_factor: float = 1e4,
        three_phase: bool = False,
        **kwargs: Any,
    ) -> None:
        if param_name != "lr":
            raise ValueError(f"OneCycle schedules the learning rate only, got param_name={param_name!r}")
        if total_steps is None:
            total_steps = kwargs.get("end", INF) - kwargs.get("begin", 0)
        if not isinstance(total_steps, int) or total_steps <= 0:
            raise ValueError(f"total_steps must be a positive int, got {total_steps!r}")
        if not isinstance(pct_start, float) or not 0 <= pct_start <= 1:
            raise ValueError(f"pct_start must be a float in [0, 1], got {pct_start!r}")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"anneal_strategy must be 'cos' or 'linear', got {anneal_strategy!r}")
        self.total_steps = total_steps
        self.anneal_strategy = anneal_strategy
        ends = [float(pct_start * total_steps) - 1]
        names = [("initial", "max")]
        if three_phase:
            ends.append(float(2 * pct_start * total_steps) - 2)
            names += [("max", "initial"), ("initial", "min")]
        else:
            names.append(("max", "min"))
        ends.append(total_steps - 1)
        self._phases = [(end, f"{a}_lr", f"{b}_lr") for end, (a, b) in zip(ends, names, strict=True)]
        groups = optimizer.param_groups
        if isinstance(eta_max, list | tuple):
            if len(eta_max) != len(groups):
                raise ValueError(
                    f"expected {len(groups)} values for eta_max (one per group), got {len(eta_max)}"
                )
            max_values = list(eta_max)
        else:
            max_values = [eta_max] * len(groups)
        if kwargs.get("last_step", -1) == -1:
            for group, top in zip(groups, max_values, strict=True):
                group["initial_lr"] = top / div_factor
                group["max_lr"] = top
                group["min_lr"] = group["initial_lr"] / final_div_factor
        super().__init__(optimizer, param_name, **kwargs)

    def _anneal(self, start: float, end: float, pct: float) -> float:
        if self.anneal_strategy == "cos":
            return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
        return (end - start) * pct + start

    def _get_value(self) -> list[float]:
        t = self.last_step
        if t > self.total_steps:
            raise ValueError(f"stepped {t + 1} times, more than total_steps={self.total_steps}")
        values = []
        for group in self.optimizer.param_groups:
            start_step = 0.0
            for i, (end_step, start_key, end_key) in enumerate(self._phases):
                if t <= end_step or i == len(self._phases) - 1:
                    pct = (t - start_step) / (end_step - start_step)
                    values.append(self._anneal(group[start_key], group[end_key], pct))
                    break
                start_step = end_step
        return values
