# SPDX-License-Identifier: Apache-2.0
"""``torch_ddp`` checkpoint IO at 2 gloo ranks, as ColossalAI's ``test_torch_ddp_checkpoint_io.py`` drives it: for
every combination of ``shard``, ``size_per_shard``, ``use_async`` and ``low_cpu_mem_mode``, boost a model, SGD with
momentum and a StepLR, take a step (``clip_grad_by_norm`` included), save model, optimizer and scheduler, wait
(``_sync_d2h``, ``_sync_io``, a barrier), boost fresh objects with the same Booster and load them: every tensor
equal bitwise on every rank.

The asynchronous saves run their collectives in the background while the main thread goes on with its own (the
scheduler save, the barrier, DDP's all-reduce): they must never meet on one process group, or the ranks wait for
each other until the backend's timeout (what happened with ``dcp.async_save`` on the default group). One process
pair runs all sixteen combinations in a loop, bounded well below gloo's timeout."""

from __future__ import annotations

import itertools
import time

import torch
import torch.distributed as dist
from torch import nn

from stepforge.strategy import Booster, OptimizerWrapper, TorchDDPPlugin
from stepforge.testing.distributed import requires_gloo, run_distributed

# size_per_shard in MiB: 0.01 splits this model's ~30 KB into several shards, 16 keeps it in one file
COMBINATIONS = list(itertools.product([False, True], [0.01, 16], [False, True], [False, True]))


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10)
    )


def _differences(a, b, where: str) -> list[str]:
    if isinstance(a, dict):
        if not isinstance(b, dict) or list(a) != list(b):
            return [f"{where}: keys {list(a)} vs {b if not isinstance(b, dict) else list(b)}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, list | tuple):
        if not isinstance(b, list | tuple) or len(a) != len(b):
            return [f"{where}: length differs"]
        return [
            d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _differences(x, y, f"{where}[{i}]")
        ]
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [f"{where}: tensors differ"]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _every_combination(rank: int, world: int, root: str) -> dict:
    problems: list[str] = []
    seconds = []
    for shard, size_per_shard, use_async, low_cpu_mem_mode in COMBINATIONS:
        start = time.monotonic()
        case = f"shard={shard} size={size_per_shard} async={use_async} low_mem={low_cpu_mem_mode}"
        booster = Booster(plugin=TorchDDPPlugin())
        torch.manual_seed(0)
        model = _net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.5)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
        model, optimizer, criterion, _, _ = booster.boost(
            model, optimizer, lambda x: x.mean(), lr_scheduler=scheduler
        )
        assert isinstance(model.module, nn.parallel.DistributedDataParallel)
        assert isinstance(optimizer, OptimizerWrapper)
        # the same batch on every rank (ColossalAI seeds every rank alike): BatchNorm statistics then agree
        x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
        booster.backward(criterion(model(x)), optimizer)
        optimizer.clip_grad_by_norm(1.0)
        optimizer.step()
        scheduler.step()

        folder = f"{root}/{'-'.join(map(str, (shard, size_per_shard, use_async, low_cpu_mem_mode)))}"
        model_path, optimizer_path, scheduler_path = (
            f"{folder}/model",
            f"{folder}/optimizer",
            f"{folder}/sched",
        )
        if not shard and use_async:  # ColossalAI's test names them so
            model_path, optimizer_path = f"{model_path}.safetensors", f"{optimizer_path}.safetensors"
        booster.save_model(model, model_path, shard=shard, size_per_shard=size_per_shard, use_async=use_async)
        booster.save_optimizer(
            optimizer, optimizer_path, shard=shard, size_per_shard=size_per_shard, use_async=use_async
        )
        booster.save_lr_scheduler(scheduler, scheduler_path)
        booster.checkpoint_io._sync_d2h()
        booster.checkpoint_io._sync_io()
        dist.barrier()

        new_model = _net()
        new_optimizer = torch.optim.SGD(new_model.parameters(), lr=0.001)
        new_scheduler = torch.optim.lr_scheduler.StepLR(new_optimizer, step_size=1, gamma=0.1)
        new_model, new_optimizer, _, _, new_scheduler = booster.boost(
            new_model, new_optimizer, lr_scheduler=new_scheduler
        )
        booster.load_model(new_model, model_path, low_cpu_mem_mode=low_cpu_mem_mode)
        problems += _differences(model.state_dict(), new_model.state_dict(), f"{case} model")
        booster.load_optimizer(new_optimizer, optimizer_path, low_cpu_mem_mode=low_cpu_mem_mode)
        problems += _differences(optimizer.state_dict(), new_optimizer.state_dict(), f"{case} optimizer")
        booster.load_lr_scheduler(new_scheduler, scheduler_path)
        problems += _differences(scheduler.state_dict(), new_scheduler.state_dict(), f"{case} scheduler")
        seconds.append(time.monotonic() - start)
    return {"problems": problems, "cases": len(seconds), "slowest_s": max(seconds)}


@requires_gloo
def test_every_combination_round_trips_at_two_ranks(tmp_path):
    results = run_distributed(_every_combination, 2, str(tmp_path), timeout=240)
    for rank, result in enumerate(results):
        assert result["problems"] == [], f"rank {rank}: {result['problems'][:5]}"
        assert result["cases"] == len(COMBINATIONS) == 16
        assert result["slowest_s"] < 60  # a save waiting on a collective would take gloo's whole timeout
