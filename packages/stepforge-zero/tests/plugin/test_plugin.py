# SPDX-License-Identifier: Apache-2.0
"""LowLevelZeroPlugin: registry names, argument checks, precision, and end to end on 2 gloo processes.

Reference: the same model trained on one process with torch.optim.AdamW on the concatenated batch (fp32). The
plugin's optimizer averages gradients over the ranks (a sum then a division), which rounds differently from the
single-process mean: parameters agree to rtol 1e-5 / atol 1e-6 after a few steps (measured: about 1e-7).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from stepforge.core import PLUGINS, HyperParameterError, Plugin
from stepforge.testing.distributed import requires_gloo, run_distributed
from stepforge.testing.zero_cases import (
    assert_all_close,
    mlp,
    param_copies,
    rank_rows,
    regression_batch,
    train_reference,
)
from stepforge.zero import (
    LowLevelZeroModel,
    LowLevelZeroOptimizer,
    LowLevelZeroPlugin,
    UnsupportedPrecisionError,
    Zero1Plugin,
    Zero2Plugin,
)

RTOL, ATOL = 1e-5, 1e-6
GLOBAL_BATCH = 8
LR = 1e-2
MAX_NORM = 0.05  # below the gradient norms of these batches (about 1.4), so clipping is active


def _model() -> torch.nn.Module:
    return mlp((6, 32, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return regression_batch(500 + step, GLOBAL_BATCH, 6, 3)


def _reference(steps: range, micro: int = 1, max_norm: float = 0.0) -> list[torch.Tensor]:
    """AdamW on one process; ``micro`` micro-batches per step, their mean losses summed (local accumulation);
    ``max_norm`` > 0: torch.nn.utils.clip_grad_norm_ before each step."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = ([_batch(step * micro + m) for m in range(micro)] for step in steps)
    return train_reference(model, optimizer, batches, max_norm=max_norm)


def _reference_norm() -> torch.Tensor:
    model = _model()
    x, y = _batch(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)


def _train(plugin, model, optimizer, rank: int, world: int, steps: range, micro: int = 1) -> None:
    sl = rank_rows(rank, world, GLOBAL_BATCH)
    for step in steps:
        optimizer.zero_grad()
        for m in range(micro):
            x, y = _batch(step * micro + m)
            if m < micro - 1:
                with plugin.no_sync(model, optimizer):
                    plugin.backward(torch.nn.functional.mse_loss(model(x[sl]), y[sl]), optimizer)
            else:
                plugin.backward(torch.nn.functional.mse_loss(model(x[sl]), y[sl]), optimizer)
        optimizer.step()


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return param_copies(model.unwrap())


def _end_to_end(rank: int, world: int, ckpt: str) -> dict:
    out: dict = {}
    for stage in (1, 2):
        plugin = PLUGINS.get(f"zero{stage}")(precision="fp32")
        assert isinstance(plugin, Plugin) and plugin.world_size == world and plugin.rank == rank
        model = _model()
        model, optimizer = plugin.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
        assert isinstance(model, LowLevelZeroModel) and isinstance(optimizer, LowLevelZeroOptimizer)
        _train(plugin, model, optimizer, rank, world, range(3))
        out[f"stage{stage}"] = _params(model)
        # accumulation over 2 micro-batches, the first inside no_sync
        model = _model()
        model, optimizer = plugin.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
        _train(plugin, model, optimizer, rank, world, range(2), micro=2)
        out[f"stage{stage}_no_sync"] = _params(model)
    # clipping: max_norm inside step (stage 1), and the plugin's clip_grad_norm_ returning the global norm
    plugin = LowLevelZeroPlugin(stage=1, precision="fp32", max_norm=MAX_NORM)
    model = _model()
    model, optimizer = plugin.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    _train(plugin, model, optimizer, rank, world, range(3))
    out["max_norm"] = _params(model)
    plugin = LowLevelZeroPlugin(stage=2, precision="fp32")
    model = _model()
    model, optimizer = plugin.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    x, y = _batch(0)
    sl = rank_rows(rank, world, GLOBAL_BATCH)
    plugin.backward(torch.nn.functional.mse_loss(model(x[sl]), y[sl]), optimizer)
    out["norm"] = plugin.clip_grad_norm_(model, optimizer, 1e9)
    optimizer.zero_grad()
    # DCP save at this world size (stage 2, after 3 steps)
    plugin = LowLevelZeroPlugin(stage=2, precision="fp32")
    model = _model()
    model, optimizer = plugin.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    _train(plugin, model, optimizer, rank, world, range(3))
    model_sd, optim_sd = plugin.get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
    # bf16: the model works in bf16 with fp32 inputs cast on the way in, and replicas stay equal
    plugin = LowLevelZeroPlugin(stage=2, precision="bf16")
    model = _model()
    model, optimizer = plugin.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    before = _params(model)
    _train(plugin, model, optimizer, rank, world, range(2))
    after = _params(model)
    assert all(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    gathered = [None] * world
    dist.all_gather_object(gathered, after)
    for other in gathered:
        for a, b in zip(after, other, strict=True):
            assert torch.equal(a, b)
    return out


def _resume(rank: int, world: int, ckpt: str) -> list[torch.Tensor]:
    plugin = LowLevelZeroPlugin(stage=2, precision="fp32")
    model = _model()
    model, optimizer = plugin.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    model_sd, optim_sd = plugin.get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=ckpt)
    plugin.set_state_dict(model, optimizer, state["model"], state["optim"])
    _train(plugin, model, optimizer, rank, world, range(3, 5))
    return _params(model)


def _assert_close(got, want) -> None:
    assert_all_close(got, want, rtol=RTOL, atol=ATOL)


@requires_gloo
def test_end_to_end_on_two_ranks_and_resume_on_one(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    results = run_distributed(_end_to_end, 2, ckpt, timeout=120)
    plain = _reference(range(3))
    accumulated = _reference(range(2), micro=2)
    for rank in range(2):
        for stage in (1, 2):
            _assert_close(results[rank][f"stage{stage}"], plain)
            _assert_close(results[rank][f"stage{stage}_no_sync"], accumulated)
        _assert_close(results[rank]["max_norm"], _reference(range(3), max_norm=MAX_NORM))
        torch.testing.assert_close(results[rank]["norm"], _reference_norm(), rtol=1e-6, atol=0)
    resumed = run_distributed(_resume, 1, ckpt, timeout=120)[0]
    _assert_close(resumed, _reference(range(5)))


def test_registered_names():
    assert PLUGINS.get("low_level_zero") is LowLevelZeroPlugin
    assert PLUGINS.get("lowlevel-zero") is LowLevelZeroPlugin
    assert PLUGINS.get("LowLevelZeroPlugin") is LowLevelZeroPlugin
    assert PLUGINS.get("zero1") is Zero1Plugin and Zero1Plugin().stage == 1
    assert PLUGINS.get("zero2") is Zero2Plugin and Zero2Plugin(precision="bf16").stage == 2
    for plugin in (LowLevelZeroPlugin(stage=1), LowLevelZeroPlugin(stage=2)):
        assert plugin.supports_no_sync()
        assert isinstance(plugin, Plugin)
    assert LowLevelZeroPlugin().precision == "fp16" and LowLevelZeroPlugin().max_norm == 0.0


def test_a_default_precision_can_be_adopted_an_explicit_one_cannot():
    plugin = LowLevelZeroPlugin(stage=2)
    assert plugin.precision == "fp16"
    plugin.set_precision("bf16")  # what the Booster does with mixed_precision="bf16"
    assert plugin.precision == "bf16" and plugin.dtype == torch.bfloat16
    explicit = Zero2Plugin(precision="fp16")
    explicit.set_precision("fp16")
    with pytest.raises(
        HyperParameterError, match="precision='fp16' was set explicitly; it conflicts with 'bf16'"
    ):
        explicit.set_precision("bf16")
    with pytest.raises(HyperParameterError, match="precision must be one of"):
        LowLevelZeroPlugin().set_precision("fp8")


def test_bad_arguments_are_named():
    with pytest.raises(HyperParameterError, match="stage must be 1 or 2"):
        LowLevelZeroPlugin(stage=3)
    with pytest.raises(HyperParameterError, match="precision must be one of"):
        LowLevelZeroPlugin(precision="fp8")
    with pytest.raises(HyperParameterError, match="zero1 is LowLevelZeroPlugin\\(stage=1\\); got stage=2"):
        Zero1Plugin(stage=2)
    with pytest.raises(HyperParameterError, match="max_norm must be a number >= 0"):
        LowLevelZeroPlugin(max_norm=-1.0)
    with pytest.raises(HyperParameterError, match="backoff_factor must be in \\(0, 1\\)"):
        LowLevelZeroPlugin(backoff_factor=1.5)
    with pytest.raises(HyperParameterError, match="growth_interval must be an int >= 1"):
        LowLevelZeroPlugin(growth_interval=0)
    with pytest.raises(HyperParameterError, match="optimizer must be a built torch.optim.Optimizer"):
        LowLevelZeroPlugin().prepare(_model(), dict(type="AdamW"))


class _Distances(torch.nn.Module):
    """Uses torch.cdist, which torch 2.13 implements on CPU for neither float16 nor bfloat16."""

    def __init__(self) -> None:
        super().__init__()
        self.centres = torch.nn.Parameter(torch.randn(4, 6))
        self.scale = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *, exact: bool = True) -> torch.Tensor:
        return self.scale(torch.cdist(x, self.centres) if exact else x @ self.centres.T)


def test_low_precision_on_cpu_gives_a_clear_error_naming_the_alternative():
    model, _ = LowLevelZeroPlugin(precision="fp16").prepare(_Distances())
    assert model.module.centres.dtype == torch.float16
    with pytest.raises(UnsupportedPrecisionError, match="precision='bf16'") as info:
        model(torch.randn(2, 6))
    assert "not implemented for 'Half'" in str(info.value)
    # fp16 matmuls run on CPU, with fp32 inputs cast on the way in (keyword arguments pass through)
    assert model(torch.randn(2, 6), exact=False).dtype == torch.float16
    model, _ = LowLevelZeroPlugin(precision="bf16").prepare(_Distances())
    with pytest.raises(UnsupportedPrecisionError, match="precision='fp32'"):
        model(torch.randn(2, 6))
    assert model(torch.randn(2, 6), exact=False).dtype == torch.bfloat16
