# SPDX-License-Identifier: Apache-2.0
"""Plugin constructors: ColossalAI's arguments are mapped, honoured, or refused by name (one process)."""

from __future__ import annotations

import pytest
import torch

from stepforge.strategy import GeminiPlugin, TorchDDPPlugin, TorchFSDPPlugin


def test_gemini_maps_colossalai_arguments():
    assert GeminiPlugin().precision == "fp16" and not GeminiPlugin().cpu_offload  # ColossalAI's defaults
    assert GeminiPlugin(placement_policy="auto").cpu_offload
    assert GeminiPlugin(offload_param_frac=1.0).cpu_offload
    assert GeminiPlugin(offload_optim_frac=1.0).cpu_offload
    g = GeminiPlugin(shard_param_frac=0.25, offload_optim_frac=0.5, offload_param_frac=0.75, extra_dp_size=2)
    assert (g.shard_param_frac, g.offload_frac, g.extra_dp_size, g.cpu_offload) == (0.25, 0.75, 2, True)
    auto = GeminiPlugin(placement_policy="auto", shard_param_frac=0.0)  # auto reads no fraction
    assert (auto.shard_param_frac, auto.offload_frac) == (1.0, 1.0)
    g = GeminiPlugin(precision="bf16", max_norm=1.0, norm_type=2.0, initial_scale=2**8, hysteresis=3)
    assert g.precision == "bf16" and g.max_norm == 1.0 and g._scaler_kwargs["initial_scale"] == 2**8
    assert not g.supports_no_sync() and not g.support_no_sync()
    # arguments of ColossalAI's chunk manager are accepted at their defaults
    GeminiPlugin(chunk_config_dict=None, search_range_m=32, tp_size=1, enable_async_reduce=True)


def test_gemini_plan_takes_leading_units_by_bytes():
    from torch import nn

    from stepforge.strategy.plugins._fsdp_common import leading_units, plan_placement

    assert leading_units([4, 4, 4, 4], 0.5) == [True, True, False, False]
    assert leading_units([4, 4, 4, 4], 0.3) == [True, True, False, False]  # until the bytes reach the goal
    assert leading_units([4, 4, 4, 4], 0.0) == [False] * 4
    assert leading_units([4, 4, 4, 4], 1.0) == [True] * 4
    assert leading_units([4, 4, 0], 1.0) == [True] * 3  # an empty root is sharded with the rest
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(2, 1))
    plan = plan_placement(model, list(model), shard_param_frac=0.6, offload_frac=1.0)
    named = {u.name: (u.param_bytes, u.sharded, u.offload) for u in plan.values()}
    # bytes: 20, 10, 3 floats; root owns nothing. 0.6 of 132 bytes = 79.2: the 80-byte unit alone
    assert named == {
        "0": (80, True, True),
        "1": (40, False, False),
        "2": (12, False, False),
        "": (0, False, False),
    }


def test_offloaded_names_are_the_parameters_of_offloaded_units():
    """A parameter belongs to the innermost chosen block holding it, else to the root (nested blocks too)."""
    from torch import nn

    from stepforge.strategy.plugins._fsdp_common import UnitPlacement, offloaded_names

    inner = nn.Linear(2, 2)
    outer = nn.Sequential(nn.Linear(2, 2), inner)
    model = nn.Sequential(nn.Linear(2, 2), outer, nn.LayerNorm(2))
    chosen = [outer, inner]

    def plan(*offloaded: nn.Module) -> dict[int, UnitPlacement]:
        return {id(u): UnitPlacement("", 0, True, u in offloaded) for u in [*chosen, model]}

    assert offloaded_names(model, chosen, plan(inner)) == {"1.1.weight", "1.1.bias"}
    assert offloaded_names(model, chosen, plan(outer)) == {"1.0.weight", "1.0.bias"}
    assert offloaded_names(model, chosen, plan(model)) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert offloaded_names(model, chosen, plan()) == set()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(chunk_config_dict={"x": 1}), ValueError, "chunk_config_dict"),
        (dict(search_range_m=64), ValueError, "search_range_m"),
        (dict(shard_param_frac=1.5), ValueError, "shard_param_frac"),
        (dict(tp_size=2), ValueError, "tp_size=2: tensor parallelism"),
        (dict(offload_optim_frac=-0.5), ValueError, "offload_optim_frac"),
        (dict(offload_param_frac="all"), ValueError, "offload_param_frac"),
        (dict(extra_dp_size=0), ValueError, "extra_dp_size"),
        (dict(placement_policy="cuda"), ValueError, "placement_policy"),
        (dict(master_weights=False), ValueError, "master_weights"),
        (dict(precision="fp8"), ValueError, "precision"),
        (dict(growth_factor=0.5), ValueError, "growth_factor"),
        (dict(no_such_argument=1), TypeError, "no_such_argument"),
    ],
)
def test_gemini_refuses_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        GeminiPlugin(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(auto_wrap_policy=object()), TypeError, "auto_wrap_policy"),
        (dict(limit_all_gathers=True), TypeError, "limit_all_gathers"),
        (dict(backward_prefetch="NO_PREFETCH"), ValueError, "backward_prefetch"),
        (dict(prefetch_blocks=0), ValueError, "prefetch_blocks"),
        (dict(sync_module_states=True), TypeError, "sync_module_states"),
        (dict(sharding_strategy="NO_SHARD"), ValueError, "NO_SHARD"),
        (dict(precision="fp8"), ValueError, "precision"),
        (dict(max_norm=-1.0), ValueError, "max_norm"),
        (dict(cpu_offload="yes"), TypeError, "cpu_offload"),
        (dict(process_group=object()), TypeError, "process_group"),
        (dict(whatever=1), TypeError, "whatever"),
    ],
)
def test_torch_fsdp_refuses_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        TorchFSDPPlugin(**kwargs)


def test_torch_fsdp_maps_fsdp1_arguments():
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, MixedPrecisionPolicy, ShardingStrategy

    assert TorchFSDPPlugin(sharding_strategy="SHARD_GRAD_OP").reshard_after_forward is False
    assert TorchFSDPPlugin(sharding_strategy="FULL_SHARD").reshard_after_forward is True
    assert TorchFSDPPlugin(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP).reshard_after_forward is False
    assert TorchFSDPPlugin(cpu_offload=CPUOffload(offload_params=True)).cpu_offload
    assert not TorchFSDPPlugin(cpu_offload=CPUOffload(offload_params=False)).cpu_offload
    assert TorchFSDPPlugin().precision == "fp32"
    # FSDP1 prefetching -> FSDP2 explicit prefetching of neighbouring blocks (test_fsdp_prefetch.py runs it)
    from torch.distributed.fsdp import BackwardPrefetch

    both = TorchFSDPPlugin(forward_prefetch=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE).prefetch
    assert (both.forward, both.backward) == (1, 1)
    assert TorchFSDPPlugin(backward_prefetch=None).prefetch.backward == 0  # FSDP1's None: no prefetch
    fsdp1 = TorchFSDPPlugin(
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    )
    policy = fsdp1._mp_policy()
    assert isinstance(policy, MixedPrecisionPolicy)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    with pytest.raises(TypeError, match="mixed_precision must be an FSDP2 MixedPrecisionPolicy"):
        TorchFSDPPlugin(mixed_precision="bf16")


def test_torch_ddp_arguments():
    p = TorchDDPPlugin(bucket_cap_mb=4, find_unused_parameters=True, static_graph=True)
    assert p.ddp_kwargs["bucket_cap_mb"] == 4 and p.ddp_kwargs["find_unused_parameters"]
    assert p.precision is None and p.supports_no_sync()
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        TorchDDPPlugin(bucket_cap_mb=0)
    with pytest.raises(TypeError):
        TorchDDPPlugin(not_an_argument=1)
