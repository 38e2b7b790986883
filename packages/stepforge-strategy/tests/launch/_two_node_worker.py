# SPDX-License-Identifier: Apache-2.0
"""Run by torchrun in test_two_node.py: train through Strategy (torch_ddp) and save rank 0's results."""

from __future__ import annotations

import gc
import os
import sys

import torch
import torch.distributed as dist
from _strategy_cases import ITERS, full_params, make_strategy, prepare, train


def main(out: str, work: str) -> None:
    strategy = make_strategy(work, plugin="torch_ddp")
    assert strategy.env.launcher == "pytorch" and strategy.world_size == 2
    prepare(strategy)
    losses = train(strategy, 0, ITERS, strategy.rank)
    params = full_params(strategy.model)
    gathered = [None, None]
    dist.all_gather_object(gathered, losses)
    if strategy.rank == 0:
        torch.save(dict(losses=gathered, params=params, timestamp=strategy.timestamp), out)
    strategy.close()
    # torch's gloo teardown can abort a worker at interpreter exit ("terminate called without an active
    # exception") while DDP objects are still alive: drop them, meet, tear down, and leave without the
    # interpreter's own shutdown (the exit path stepforge.testing.distributed.run_distributed uses)
    del strategy
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
