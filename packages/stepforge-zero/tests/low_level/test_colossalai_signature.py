# SPDX-License-Identifier: Apache-2.0
"""ColossalAI's ``LowLevelZeroOptimizer`` constructor on one process: its names, order and defaults
(from ``colossalai/zero/low_level/low_level_optim.py`` at 4f9953b), the aliases of stepforge's names,
``forced_dtype``, ``master_weights=False``, ``verbose``, ``backward_context``, torch's state-dict key order, and
ColossalAI's rule that only parameters requiring grad are managed (frozen ones get no master, state or gather).
Expected values are written out (exactly representable numbers), never produced by the code under test."""

from __future__ import annotations

import contextlib
import inspect
import logging

import pytest
import torch
from torch import nn

from stepforge.core import HyperParameterError
from stepforge.zero import LowLevelZeroOptimizer

# ColossalAI's positional parameters after ``optimizer``, in order, with their defaults
COLOSSALAI_SIGNATURE = [
    ("pg_to_param_list", None),
    ("initial_scale", 2**16),
    ("min_scale", 1),
    ("growth_factor", 2.0),
    ("backoff_factor", 0.5),
    ("growth_interval", 2000),
    ("hysteresis", 2),
    ("max_scale", 2**24),
    ("clip_grad_norm", 0.0),
    ("verbose", False),
    # differs on purpose: None = ColossalAI's 1 Mi off gloo, 4 Mi on gloo (measured: stepforge.zero.comm.algorithm)
    ("reduce_bucket_size", None),
    ("communication_dtype", None),
    ("overlap_communication", False),
    ("partition_grad", False),
    ("cpu_offload", False),
    ("dp_process_group", None),
    ("extra_dp_group", None),
    ("forced_dtype", None),
    ("master_weights", True),
    ("overlap_allgather", False),
    ("fp8_communication", False),
    ("backward_context", None),
]


def _sgd(model: nn.Module, lr: float = 0.5) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=lr)


def _linear(dtype: torch.dtype = torch.float32) -> nn.Linear:
    layer = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    return layer.to(dtype)


def test_signature_is_colossalais_in_order_with_its_defaults():
    params = list(inspect.signature(LowLevelZeroOptimizer).parameters.values())
    assert params[0].name == "optimizer"
    positional = [(p.name, p.default) for p in params[1 : 1 + len(COLOSSALAI_SIGNATURE)]]
    assert positional == COLOSSALAI_SIGNATURE
    keyword_only = {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert {"params", "stage", "max_norm", "process_group", "norm_type"} <= keyword_only


def test_colossalai_names_and_stepforge_aliases():
    model = _linear()
    opt = LowLevelZeroOptimizer(_sgd(model), partition_grad=True, clip_grad_norm=1.5)
    assert (
        opt.config.stage,
        opt.config.max_norm,
        opt.config.overlap_communication,
        opt.reduce_bucket_size,
    ) == (
        2,
        1.5,
        False,
        2**20,
    )
    assert (opt.scaler.get_scale(), opt.scaler.growth_interval, opt.scaler.max_scale) == (
        2.0**16,
        2000,
        2.0**24,
    )
    same = LowLevelZeroOptimizer(
        _sgd(_linear()), partition_grad=True, stage=2, max_norm=1.5, clip_grad_norm=1.5
    )
    assert (same.config.stage, same.config.max_norm) == (2, 1.5)
    with pytest.raises(HyperParameterError, match="stage=1.*partition_grad=True"):
        LowLevelZeroOptimizer(_sgd(_linear()), partition_grad=True, stage=1)
    with pytest.raises(HyperParameterError, match="max_norm=1.0.*clip_grad_norm=2.0"):
        LowLevelZeroOptimizer(_sgd(_linear()), clip_grad_norm=2.0, max_norm=1.0)
    with pytest.raises(HyperParameterError, match="partition_grad must be a bool"):
        LowLevelZeroOptimizer(_sgd(_linear()), partition_grad=2)
    # stepforge's earlier second positional argument, the params of a config, still works
    cfg = LowLevelZeroOptimizer(dict(type="SGD", lr=0.5), _linear().parameters())
    assert len(cfg.layout.slots) == 1


def test_bad_colossalai_arguments_name_themselves():
    sentinel = object()
    cases = [
        (dict(extra_dp_group=sentinel), "dp_process_group should be provided when extra_dp_group"),
        (
            dict(dp_process_group=sentinel, pg_to_param_list={sentinel: []}),
            "not be provided at the same time",
        ),
        (dict(pg_to_param_list={sentinel: [], object(): []}), "pg_to_param_list must map one process group"),
        (dict(pg_to_param_list={sentinel: []}), "exactly the optimizer's parameters"),
        (dict(communication_dtype=torch.int8), "communication_dtype must be None or a floating"),
        (dict(forced_dtype="bf16"), "forced_dtype must be None or a floating"),
        (dict(fp8_communication=1), "fp8_communication must be a bool"),
        (dict(backward_context=3), "backward_context must be a callable"),
        (dict(norm_type=-1.0), "norm_type must be > 0"),
    ]
    for kwargs, message in cases:
        with pytest.raises(HyperParameterError, match=message):
            LowLevelZeroOptimizer(_sgd(_linear()), **kwargs)


def test_forced_dtype_casts_the_working_parameters_in_place():
    model = _linear()
    weight = model.weight
    opt = LowLevelZeroOptimizer(_sgd(model), forced_dtype=torch.bfloat16)
    assert model.weight is weight and weight.dtype == torch.bfloat16
    master = opt.working_to_master_param[id(weight)]
    assert master.dtype == torch.float32 and master.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_master_weights_false_steps_the_working_parameters_without_an_fp32_copy():
    model = _linear(torch.bfloat16)
    opt = LowLevelZeroOptimizer(_sgd(model, lr=0.5), master_weights=False)
    master = opt.working_to_master_param[id(model.weight)]
    assert master.dtype == torch.bfloat16 and master.data_ptr() == model.weight.data_ptr()
    model(torch.ones(1, 4, dtype=torch.bfloat16)).sum().backward()  # gradient: ones
    opt.step()
    assert model.weight.tolist() == [[0.5, 1.5, 2.5, 3.5]]


def test_verbose_logs_a_skipped_step(caplog):
    model = _linear(torch.float16)
    with caplog.at_level(logging.INFO, logger="stepforge.zero"):
        opt = LowLevelZeroOptimizer(_sgd(model), verbose=True, initial_scale=4.0, hysteresis=1)
    with caplog.at_level(logging.INFO, logger="stepforge.zero"):
        opt.backward(model(torch.full((1, 4), float("inf"), dtype=torch.float16)).sum())
        opt.step()
    messages = [r.getMessage() for r in caplog.records if r.name == "stepforge.zero"]
    assert any("stage 1 over 1 ranks" in m for m in messages)
    assert any("found overflow, step skipped (loss scale now 2)" in m for m in messages)
    assert opt.skipped_steps == 1 and model.weight.tolist() == [[1.0, 2.0, 3.0, 4.0]]


def test_backward_context_wraps_every_backward():
    entered: list[str] = []

    @contextlib.contextmanager
    def context():
        entered.append("in")
        yield
        entered.append("out")

    model = _linear()
    opt = LowLevelZeroOptimizer(_sgd(model), backward_context=context)
    opt.backward(model(torch.ones(1, 4)).sum())
    opt.backward_by_grad(model(torch.ones(1, 4)), torch.ones(1, 1))
    assert entered == ["in", "out", "in", "out"]


def test_state_dict_lists_per_parameter_keys_in_torchs_order():
    model = nn.Linear(3, 2)
    opt = LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert list(opt.state_dict()["state"][0]) == ["step", "exp_avg", "exp_avg_sq"]
    assert list(opt.state_dict()["state"][1]) == ["step", "exp_avg", "exp_avg_sq"]


def test_parameters_that_do_not_require_grad_are_not_managed():
    model = nn.Sequential(_linear(torch.bfloat16), nn.Linear(1, 1, bias=False).to(torch.bfloat16))
    with torch.no_grad():
        model[1].weight.fill_(2.0)
    model[0].requires_grad_(False)  # a frozen base weight, as peft leaves it under LoRA
    opt = LowLevelZeroOptimizer(_sgd(model, lr=0.25))
    assert set(opt.working_to_master_param) == {id(model[1].weight)}  # no fp32 master of the frozen weight
    model(torch.ones(1, 4, dtype=torch.bfloat16)).sum().backward()  # model[1]'s gradient: 1 + 2 + 3 + 4 = 10
    opt.step()
    assert model[0].weight.tolist() == [[1.0, 2.0, 3.0, 4.0]] and model[0].weight.grad is None
    assert model[1].weight.tolist() == [[-0.5]]  # 2 - 0.25 * 10
    state = opt.state_dict()
    assert [g["params"] for g in state["param_groups"]] == [[0]] and list(
        state["state"]
    ) == []  # SGD: no state
