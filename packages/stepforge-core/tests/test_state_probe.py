# SPDX-License-Identifier: Apache-2.0
"""Optimizer state bytes read from the optimizer itself: torch's Adam family and SGD on meta stand-ins, an
optimizer that cannot step meta tensors through the CPU fit, state the fit cannot describe refused, and an
optimizer instance read through copies of it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from stepforge.core.memory_plan import OptimizerStateProbe, optimizer_state_probe


class _ReadsValues(torch.optim.Optimizer):
    """Keeps an fp32 buffer per element and a 2-element tensor per parameter, and reads a value (``.item()``):
    it cannot step meta tensors."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["buf"] = torch.zeros_like(p, dtype=torch.float32)
                    state["pair"] = torch.zeros(2, dtype=torch.float64)
                scale = float(p.grad.abs().max().item())
                state["buf"].add_(p.grad.float() * scale)


class _ByRows(_ReadsValues):
    """Keeps one value per row: its state depends on the shape, not only on the element count."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["rows"] = torch.zeros(p.shape[0])
                float(p.grad.sum().item())


def test_adamw_state_is_two_moments_in_the_parameter_dtype_and_a_cpu_step() -> None:
    """torch AdamW: ``exp_avg`` and ``exp_avg_sq`` like the parameter (fp32: 8 bytes an element, bf16: 4), on
    its device, and a 4-byte ``step`` kept on the CPU."""
    probe = OptimizerStateProbe(dict(type="AdamW", lr=1e-3))
    fp32 = {s.key: s for s in probe.state((64, 32), torch.float32)}
    assert (fp32["exp_avg"].nbytes, fp32["exp_avg_sq"].nbytes, fp32["step"].nbytes) == (8192, 8192, 4)
    assert fp32["exp_avg"].with_param and not fp32["step"].with_param
    assert probe.nbytes((1000,), torch.bfloat16) == 4000 + 4
    assert probe.method == "meta"


@pytest.mark.parametrize(("config", "per_element"), [(dict(momentum=0.9), 4), (dict(), 0)])
def test_sgd_state_is_the_momentum_buffer_when_there_is_momentum(config: dict, per_element: int) -> None:
    """SGD keeps one buffer like the parameter with momentum, nothing without."""
    probe = OptimizerStateProbe(dict(type="SGD", lr=0.1, **config))
    assert probe.nbytes((256,), torch.float32) == 256 * per_element


def test_an_optimizer_that_reads_values_is_fitted_on_small_cpu_tensors() -> None:
    """An optimizer that cannot step meta tensors is probed on three small CPU parameters: its per-element
    buffer and its fixed 16-byte pair are extrapolated to any size."""
    probe = OptimizerStateProbe(dict(type=_ReadsValues, lr=0.1))
    state = {s.key: s for s in probe.state((1000, 3), torch.float32)}
    assert probe.method == "cpu-fit"
    assert state["buf"].nbytes == 12000 and state["pair"].nbytes == 16
    assert probe.nbytes((7,), torch.bfloat16) == 7 * 4 + 16


def test_state_that_depends_on_the_shape_is_refused() -> None:
    """State sized by rows, not elements, is named in an error: the fit cannot size it."""
    probe = OptimizerStateProbe(dict(type=_ByRows, lr=0.1))
    with pytest.raises(RuntimeError, match="'rows'.*shape"):
        probe.state((10, 10), torch.float32)


def test_a_config_needs_a_type() -> None:
    """``type`` is required (the error shows the expected form)."""
    with pytest.raises(ValueError, match="type"):
        OptimizerStateProbe(dict(lr=1e-3))


def test_probes_are_shared_per_config() -> None:
    """The same config gives the same probe (each shape is probed once per process)."""
    assert optimizer_state_probe(dict(type="SGD", lr=0.1)) is optimizer_state_probe(dict(lr=0.1, type="SGD"))
    assert optimizer_state_probe(dict(type="SGD", lr=0.1)) is not optimizer_state_probe(
        dict(type="SGD", lr=0.2)
    )


def test_an_instance_is_probed_through_copies_never_rebuilt_nor_changed() -> None:
    """An optimizer instance: the layout of its class with its own group's hyperparameters (``amsgrad`` adds
    ``max_exp_avg_sq``), read without calling its constructor (its ``defaults`` may hold a key the constructor
    refuses) and without touching its parameters, groups or state; one probe per instance."""
    built = []

    class Counted(torch.optim.AdamW):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built.append(kwargs)
            super().__init__(*args, **kwargs)

    param = torch.nn.Parameter(torch.ones(3))
    optimizer = Counted([param], lr=1e-3, amsgrad=True)
    optimizer.defaults["not_an_argument"] = 1
    groups = [dict(g) for g in optimizer.param_groups]
    probe = optimizer_state_probe(optimizer)
    state = {s.key: s.nbytes for s in probe.state((64, 32), torch.float32)}
    assert state == {"step": 4, "exp_avg": 8192, "exp_avg_sq": 8192, "max_exp_avg_sq": 8192}
    assert probe.name == "Counted" and len(built) == 1
    assert (
        not optimizer.state
        and optimizer.param_groups == groups
        and optimizer.param_groups[0]["params"] == [param]
    )
    assert optimizer_state_probe(optimizer) is probe


def test_an_optimizer_that_cannot_step_stand_ins_is_named() -> None:
    """LBFGS steps only with a closure: an ``OptimizerStateError`` names it and the reason."""
    from stepforge.core import OptimizerStateError

    optimizer = torch.optim.LBFGS([torch.nn.Parameter(torch.ones(3))])
    with pytest.raises(OptimizerStateError, match="'LBFGS'.*closure"):
        OptimizerStateProbe(optimizer).state((4,), torch.float32)
