# SPDX-License-Identifier: Apache-2.0
"""mmengine's plain Runner (not flexible) trains with an OptimWrapper dict naming stepforge's optimizers."""

from __future__ import annotations

import pytest
import torch
from _runs import EXAMPLE_DIR
from mmengine.optim import OptimWrapper
from mmengine.runner import Runner

import stepforge.mmengine  # noqa: F401  (registers the Stepforge* names)
from stepforge.fused import CPUAdam
from stepforge.optim import Lamb

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


@pytest.fixture(autouse=True)
def _example_on_path(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLE_DIR)


@pytest.mark.parametrize(
    ("name", "cls", "kwargs"),
    [("StepforgeCPUAdam", CPUAdam, dict(lr=0.05)), ("StepforgeLamb", Lamb, dict(lr=0.05, weight_decay=0.01))],
    ids=["cpu_adam", "lamb"],
)
def test_runner_trains_with_a_stepforge_optimizer(tmp_path, name, cls, kwargs):
    import toy_regression

    runner = Runner(
        model=dict(type="ToyRegressor", dropout=0.0),
        work_dir=str(tmp_path),
        experiment_name=f"runner-{name}",
        train_dataloader=dict(
            dataset=dict(type="ToyRegressionDataset", size=32),
            sampler=dict(type="DefaultSampler", shuffle=False),
            collate_fn=dict(type="default_collate"),
            batch_size=4,
            num_workers=0,
        ),
        train_cfg=dict(by_epoch=False, max_iters=8),
        optim_wrapper=dict(type="OptimWrapper", optimizer=dict(type=name, **kwargs)),
        default_hooks=dict(checkpoint=None, logger=dict(type="LoggerHook", interval=4)),
        randomness=dict(seed=0),
        launcher="none",
    )
    initial = {k: v.detach().clone() for k, v in runner.model.state_dict().items()}
    runner.train()
    assert isinstance(runner.optim_wrapper, OptimWrapper)
    assert type(runner.optim_wrapper.optimizer) is cls

    # the same 8 steps by hand, with the optimizer class used directly
    reference = toy_regression.ToyRegressor(dropout=0.0)
    reference.load_state_dict(initial)
    optimizer = cls(reference.parameters(), **kwargs)
    data = toy_regression.ToyRegressionDataset(size=32)
    for i in range(8):
        batch = [data[j] for j in range(4 * i, 4 * i + 4)]
        inputs = torch.stack([b["inputs"] for b in batch])
        targets = torch.stack([b["targets"] for b in batch])
        reference(inputs, targets, mode="loss")["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    trained = runner.model.state_dict()
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(trained[key], value, rtol=0, atol=0)
