# SPDX-License-Identifier: Apache-2.0
"""Optimizer state bytes, read from the optimizer itself rather than from a table that can drift from it.

:class:`OptimizerStateProbe` builds the optimizer of a ``build_optimizer`` config on one stand-in parameter of
the planned shape and dtype on the meta device (no memory), gives it a gradient, steps it once and reads what
it put in ``optimizer.state``: each state tensor's bytes, and whether it lives with the parameter (on its
device) or on the CPU whatever the parameter's device (torch's ``step`` counters). Shapes are probed once each.

An optimizer that cannot step meta tensors (a compiled kernel that needs real memory, a norm read with
``.item()``) is probed instead on small CPU parameters: the bytes of each state tensor are fitted as
``a * numel + b`` from two sizes and checked on a third, 2-D, parameter; state that is not linear in the element
count raises (the estimate would not know it).
"""

from __future__ import annotations

import copy
import math
import weakref
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .errors import OptimizerStateError

__all__ = ["OptimizerStateProbe", "StateTensor", "optimizer_state_probe"]


@dataclass(frozen=True)
class StateTensor:
    """One state tensor the optimizer keeps for a parameter: its ``key`` in ``optimizer.state[param]``, bytes and
    dtype; ``with_param``: created on the parameter's device (``False``: on the CPU whatever that device is)."""

    key: str
    nbytes: int
    dtype: torch.dtype
    with_param: bool


# (numel of the two fit sizes, the 2-D check shape whose numel is the second size)
_FIT_SIZES = (32, 64)
_FIT_CHECK = (8, 8)


def _state_of(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    state = optimizer.state.get(param, {})
    return [(str(k), v) for k, v in state.items() if isinstance(v, torch.Tensor)]


def _holding(optimizer: torch.optim.Optimizer, group: Mapping[str, Any], params: list[Any]) -> Any:
    # a shallow copy (its class and what it pickles) with no state and one group: params, group's hyperparameters
    held = copy.copy(optimizer)
    held.state = defaultdict(dict)
    held.param_groups = [{**group, "params": params}]
    return held


class OptimizerStateProbe:
    """The state layout of an optimizer: the one a ``build_optimizer`` config builds, or an instance's.

    ``optimizer``: ``{"type": ..., **hyperparameters}``, or an instance (probed through copies of it holding
    stand-in parameters). A config without ``type`` is a ``ValueError``, anything else a ``TypeError``.
    """

    def __init__(self, optimizer: Mapping[str, Any] | torch.optim.Optimizer) -> None:
        self.config: dict[str, Any] | None = None
        self._template: torch.optim.Optimizer | None = None
        if isinstance(optimizer, torch.optim.Optimizer):
            self.name = type(optimizer).__name__
            # hyperparameters of the first group; the copy keeps no parameter and no state of the instance
            self._group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
            self._template = _holding(optimizer, self._group, [])
        elif isinstance(optimizer, Mapping):
            if "type" not in optimizer:
                raise ValueError(
                    "OptimizerStateProbe: the optimizer config needs a 'type', e.g. dict(type='AdamW', lr=1e-3); "
                    f"got {dict(optimizer)!r}."
                )
            self.config = dict(optimizer)
            kind = self.config["type"]
            self.name = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
        else:
            raise TypeError(
                "OptimizerStateProbe: the optimizer must be a torch.optim.Optimizer or a build_optimizer config "
                f"(dict(type='AdamW', lr=1e-3)), got {type(optimizer).__name__}."
            )
        self._cache: dict[tuple[tuple[int, ...], torch.dtype], tuple[StateTensor, ...]] = {}
        self._fits: dict[torch.dtype, list[tuple[str, float, float, torch.dtype, bool]]] = {}
        self._temporaries: dict[torch.dtype, tuple[float, float, float]] = {}
        self.method = "meta"  # "cpu-fit" once the meta probe failed

    def _build(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        if self._template is not None:
            return _holding(self._template, self._group, params)  # type: ignore[no-any-return]
        from .build import build_optimizer

        return build_optimizer(dict(self.config or {}), params)

    def state(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[StateTensor, ...]:
        """The state tensors kept for one parameter of ``shape`` and ``dtype``.

        Raises:
            OptimizerStateError: the optimizer cannot be stepped on stand-in parameters (one that needs a
                closure, ``LBFGS``; sparse gradients, ``SparseAdam``; 2-D parameters only, ``Muon``), or its state
                depends on the shape and cannot be probed on meta tensors (``Adafactor``'s factored moments).
        """
        key = (tuple(int(s) for s in shape), dtype)
        found = self._cache.get(key)
        if found is None:
            found = self._probe_meta(*key) if self.method == "meta" else None
            if found is None:
                found = self._from_fit(*key)
            self._cache[key] = found
        return found

    def nbytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Bytes of every state tensor of one parameter of ``shape`` and ``dtype``."""
        return sum(s.nbytes for s in self.state(shape, dtype))

    def _probe_meta(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[StateTensor, ...] | None:
        param = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"))
        try:
            optimizer = self._build([param])
            param.grad = torch.zeros_like(param)
            optimizer.step()
        except Exception:  # any failure on meta tensors: fall back to the CPU fit for this optimizer
            self.method = "cpu-fit"
            return None
        return tuple(
            StateTensor(k, v.numel() * v.element_size(), v.dtype, v.device == param.device)
            for k, v in _state_of(optimizer, param)
        )

    def _fit(self, dtype: torch.dtype) -> list[tuple[str, float, float, torch.dtype, bool]]:
        found = self._fits.get(dtype)
        if found is not None:
            return found
        shapes: list[tuple[int, ...]] = [(_FIT_SIZES[0],), (_FIT_SIZES[1],), _FIT_CHECK]
        params = [torch.nn.Parameter(torch.full(s, 0.5, dtype=dtype)) for s in shapes]
        try:
            optimizer = self._build(list(params))
            for p in params:
                p.grad = torch.full_like(p, 1e-3)
            optimizer.step()
        except Exception as exc:
            raise OptimizerStateError(
                f"the optimizer {self.name!r} cannot be stepped on stand-in parameters (meta, nor small {dtype} "
                f"CPU ones: {type(exc).__name__}: {exc}), so its state size cannot be read (estimate without an "
                "optimizer, or with one of the same state layout)"
            ) from exc
        states = [dict(_state_of(optimizer, p)) for p in params]
        fits = []
        (n1, n2), (small, large, check) = _FIT_SIZES, states
        for name, first in small.items():
            b1 = first.numel() * first.element_size()
            second = large[name]
            b2 = second.numel() * second.element_size()
            per_element = (b2 - b1) / (n2 - n1)
            fixed = b1 - per_element * n1
            other = check.get(name)
            if other is None or other.numel() * other.element_size() != b2:
                raise OptimizerStateError(
                    f"the state {name!r} of the optimizer {self.name!r} depends on the parameter's shape, not only "
                    "on its element count, and it cannot be stepped on meta tensors, so its size cannot be read "
                    "(estimate without an optimizer, or with one of the same state layout)"
                )
            fits.append((name, per_element, fixed, first.dtype, True))
        self._fits[dtype] = fits
        return fits

    def _from_fit(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[StateTensor, ...]:
        numel = math.prod(shape)
        return tuple(
            StateTensor(name, round(per_element * numel + fixed), state_dtype, with_param)
            for name, per_element, fixed, state_dtype, with_param in self._fit(dtype)
        )

    def step_temporaries(self, numels: list[int], dtype: torch.dtype) -> int:
        """Bytes of the temporaries one ``step()`` allocates beside the state, for stepped tensors of ``numels``
        elements: ``a * largest + c * second largest + b * the rest``, fitted from steady-state steps (the second
        step) of the optimizer over one, two and three equal stand-in parameters, counted by torch's
        ``MemTracker``. A loop over tensors keeps one tensor's temporaries and what the previous one left
        (``b`` = 0); a multi-tensor step keeps every tensor's (``a = c = b``)."""
        if not numels:
            return 0
        fit = self._temporaries.get(dtype)
        if fit is None:
            fit = self._temporaries[dtype] = self._fit_temporaries(dtype)
        ordered = sorted(numels, reverse=True)
        second = ordered[1] if len(ordered) > 1 else 0
        rest = sum(ordered[2:])
        return max(0, round(fit[0] * ordered[0] + fit[1] * second + fit[2] * rest))

    def _fit_temporaries(self, dtype: torch.dtype) -> tuple[float, float, float]:
        from .torch_compat import memory_tracker, tracker_bytes

        self.state(_FIT_CHECK, dtype)  # settles the method: meta, or the CPU fit when meta cannot step
        # square stand-ins: an optimizer of matrices only (Muon) steps them too
        shape = (64, 64) if self.method == "meta" else _FIT_CHECK
        n = shape[0] * shape[1]
        device = "meta" if self.method == "meta" else "cpu"
        peaks = []
        for count in (1, 2, 3):
            params = [
                torch.nn.Parameter(torch.full(shape, 0.5, dtype=dtype, device=device)) for _ in range(count)
            ]
            tracker = memory_tracker()
            try:
                optimizer = self._build(list(params))
                for p in params:
                    p.grad = torch.full_like(p, 1e-3)
                optimizer.step()  # the first step creates the state
                with tracker:
                    optimizer.step()
            except Exception as exc:
                raise OptimizerStateError(
                    f"the optimizer {self.name!r} cannot be stepped twice on {count} stand-in {shape} parameters "
                    f"({type(exc).__name__}: {exc}), so the temporaries of its step cannot be read (estimate "
                    "without an optimizer, or with one of the same state layout)"
                ) from exc
            current = sum(d["Total"] for d in tracker_bytes(tracker).values())
            peak = sum(d["Total"] for d in tracker_bytes(tracker, "peak").values())
            peaks.append(max(0, peak - current))
        return peaks[0] / n, max(0.0, peaks[1] - peaks[0]) / n, max(0.0, peaks[2] - peaks[1]) / n


_PROBES: dict[str, OptimizerStateProbe] = {}
# an instance's probe lives as long as the instance (the probe holds a copy of it, never the instance)
_INSTANCE_PROBES: weakref.WeakKeyDictionary[torch.optim.Optimizer, OptimizerStateProbe] = (
    weakref.WeakKeyDictionary()
)


def optimizer_state_probe(optimizer: Mapping[str, Any] | torch.optim.Optimizer) -> OptimizerStateProbe:
    """The probe of ``optimizer`` (a config or an instance), shared by every plan in this process: one probe per
    distinct config, one per instance."""
    if isinstance(optimizer, torch.optim.Optimizer):
        found = _INSTANCE_PROBES.get(optimizer)
        if found is None:
            found = _INSTANCE_PROBES[optimizer] = OptimizerStateProbe(optimizer)
        return found
    key = repr(sorted((str(k), repr(v)) for k, v in optimizer.items()))
    probe = _PROBES.get(key)
    if probe is None:
        probe = _PROBES[key] = OptimizerStateProbe(optimizer)
    return probe
