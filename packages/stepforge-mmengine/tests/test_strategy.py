# SPDX-License-Identifier: Apache-2.0
"""StepforgeStrategy on one process: what FlexibleRunner reads, and clear errors on bad input."""

from __future__ import annotations

import pytest
import torch
from _runs import EXAMPLE_DIR
from mmengine.logging import MMLogger

from stepforge.mmengine import StepforgeModelWrapper, StepforgeStrategy
from stepforge.strategy import ColossalAIOptimWrapper

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


@pytest.fixture
def strategy(tmp_path):
    s = StepforgeStrategy(
        work_dir=str(tmp_path),
        experiment_name=f"unit-{tmp_path.name}",
        env_kwargs=dict(launcher="none", randomness=dict(seed=3), dist_cfg=dict(backend="nccl")),
        log_kwargs=dict(log_level="INFO"),
    )
    yield s
    s.strategy.close()


def test_what_flexible_runner_reads(strategy, tmp_path):
    assert isinstance(strategy.logger, MMLogger)
    assert strategy.rank == 0 and strategy.world_size == 1 and strategy.distributed is False
    assert strategy.seed == 3 and strategy.randomness["seed"] == 3
    assert strategy.log_dir == str(tmp_path / strategy.timestamp)
    assert strategy.experiment_name == f"unit-{tmp_path.name}_{strategy.timestamp}"
    system, runtime = strategy.collect_env()
    assert "PyTorch" in system
    assert runtime["stepforge plugin"] == "single" and runtime["GPU number"] == 1
    if not torch.cuda.is_available():  # the runner's default nccl becomes gloo on a CPU machine
        assert runtime["dist_cfg"] == {"backend": "gloo"}


def test_prepare_builds_from_a_models_config_with_prefixed_names(strategy, monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLE_DIR)
    import toy_regression  # noqa: F401  (registers ToyRegressor)

    model, wrapper = strategy.prepare(
        dict(type="ToyRegressor"),
        optim_wrapper=dict(
            type="StepforgeColossalAIOptimWrapper", optimizer=dict(type="StepforgeLamb", lr=0.1)
        ),
    )
    assert isinstance(model, StepforgeModelWrapper) and model.module is strategy.model.module
    assert isinstance(wrapper, ColossalAIOptimWrapper)
    assert strategy.prepare(dict(type="ToyRegressor")) == (model, wrapper)  # idempotent, as mmengine's
    batch = {"inputs": torch.randn(4, 8), "targets": torch.randn(4, 1)}
    before = model.module.net[0].weight.detach().clone()
    log_vars = model.train_step(batch, optim_wrapper=wrapper)
    assert set(log_vars) == {"loss"}
    assert not torch.equal(model.module.net[0].weight, before)


def test_a_model_without_train_step_support_is_refused(strategy):
    with pytest.raises(TypeError, match="mmengine BaseModel"):
        strategy.prepare(torch.nn.Linear(2, 2))


def test_an_optim_wrapper_that_cannot_drive_the_booster_is_refused(strategy, monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLE_DIR)
    import toy_regression  # noqa: F401

    with pytest.raises(ValueError, match="ColossalAIOptimWrapper"):
        strategy.prepare(
            dict(type="ToyRegressor"),
            optim_wrapper=dict(type="OptimWrapper", optimizer=dict(type="SGD", lr=0.1)),
        )


class _CountingBackend:
    """A torch.compile backend that runs the captured graph as it is and counts the graphs and their calls."""

    def __init__(self) -> None:
        self.graphs = self.runs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1

        def run(*args):
            self.runs += 1
            return gm(*args)

        return run


@pytest.mark.parametrize("disable", [False, True])
def test_flexible_runners_compile_option_compiles_the_models_forward_unless_disabled(
    strategy, monkeypatch, disable
):
    """FlexibleRunner passes ``compile=dict(target="train_step", ...)`` (its default target); train_step lives on
    the strategy's wrapper, so the model's forward (which train_step calls) is what gets compiled, and
    ``disable=True`` compiles nothing."""
    monkeypatch.syspath_prepend(EXAMPLE_DIR)
    import toy_regression  # noqa: F401

    torch.compiler.reset()
    backend = _CountingBackend()
    compile = dict(target="train_step", backend=backend, disable=disable)
    model, wrapper = strategy.prepare(
        dict(type="ToyRegressor"),
        optim_wrapper=dict(type="StepforgeColossalAIOptimWrapper", optimizer=dict(type="SGD", lr=0.1)),
        compile=compile,
    )
    # the runner's dict unchanged
    assert compile == dict(target="train_step", backend=backend, disable=disable)
    batch = {"inputs": torch.randn(4, 8), "targets": torch.randn(4, 1)}
    for _ in range(2):
        model.train_step(batch, optim_wrapper=wrapper)
    assert (backend.graphs, backend.runs) == ((0, 0) if disable else (1, 2))
    torch.compiler.reset()


def test_global_batch_size_derives_accumulative_counts_from_the_loaders_batch_size(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLE_DIR)
    import toy_regression  # noqa: F401  (registers ToyRegressor)

    with pytest.raises(ValueError, match="global_batch_size must be None or a positive int"):
        StepforgeStrategy(work_dir=str(tmp_path), global_batch_size=0)
    s = StepforgeStrategy(
        work_dir=str(tmp_path), env_kwargs=dict(launcher="none", randomness=dict(seed=3)), global_batch_size=8
    )
    _, wrapper = s.prepare(
        dict(type="ToyRegressor"),
        optim_wrapper=dict(type="ColossalAIOptimWrapper", optimizer=dict(type="SGD", lr=0.1)),
        dispatch_kwargs=dict(train_micro_batch_size_per_gpu=4, max_iters=4),  # what FlexibleRunner passes
    )
    assert wrapper.accumulative_counts == 2  # 8 = 1 rank x batch_size 4 x 2
    s.strategy.close()
