# SPDX-License-Identifier: Apache-2.0
"""A user's script for ``test_pending.py``, run as ``python _exit_script.py RANK PORT FOLDER`` in 2 fresh
interpreters (as torchrun starts them): ColossalAI's ``test_torch_ddp_plugin.py`` steps with the torch_ddp
plugin, asynchronous saves left pending, rank 1's Booster (and its checkpoint IO) dropped and collected while
rank 0's lives on, one more collective, then a normal return: no ``_sync_io``, no ``destroy_process_group``."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import os
import sys
import threading

import torch
import torch.distributed as dist
from torch import nn

from stepforge.strategy import Booster, TorchDDPPlugin


def _report_threads(rank: int) -> None:
    # registered before stepforge is used, so it runs after stepforge's own exit handler
    names = sorted(t.name for t in threading.enumerate())
    print(f"rank {rank}: threads at exit {names}", file=sys.stderr, flush=True)


def main(rank: int, port: int, folder: str) -> None:
    atexit.register(_report_threads, rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    plugin = TorchDDPPlugin()
    booster = Booster(plugin=plugin)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model, optimizer, criterion, loader, _ = booster.boost(
        net,
        torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9),
        lambda x: x.mean(),
        dataloader=plugin.prepare_dataloader(torch.randn(8, 16), batch_size=2),
    )
    for i, batch in enumerate(loader):
        with booster.no_sync(model) if i == 0 else contextlib.nullcontext():
            booster.backward(criterion(model(batch)), optimizer)
        if i == 1:
            optimizer.clip_grad_by_norm(1.0)
            optimizer.step()
            break
    booster.save_model(model, f"{folder}/model", shard=True, use_async=True)
    booster.save_optimizer(optimizer, f"{folder}/optimizer", shard=True, use_async=True)
    if rank == 1:  # this rank's checkpoint IO is finalised now, the other rank's at exit
        del booster, plugin, model, optimizer, criterion, loader
        gc.collect()
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == 2.0
    print(f"rank {rank}: returning", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
