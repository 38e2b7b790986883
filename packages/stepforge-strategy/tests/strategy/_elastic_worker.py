# SPDX-License-Identifier: Apache-2.0
"""One worker of the elastic test (test_elastic_shrink.py), started by one of two ``torchrun --nnodes=1:2`` agents.

``python _elastic_worker.py <work>``: the run of :mod:`_world_cases` (``global_batch_size=12``, a registered
``DistributedSampler`` loader) on ``torch_ddp`` with ``Strategy(resume="auto")``, saving ``step_<k>`` after every
optimizer step. At world size 2, rank 1 SIGKILLs its own agent and then itself right after saving ``step_<KILL>``:
the whole second "node" is gone. The surviving agent's worker fails at its next gradient all-reduce, the agent
restarts it (``--max-restarts``), the rendezvous completes with the one node left, and the restarted worker, at
world size 1, resumes ``step_<KILL>`` by itself and finishes.

Each worker appends the sample ids of every iteration to ``ids-<attempt>-<rank>.jsonl``; rank 0 appends each start
to ``starts.jsonl`` and the run that finishes writes ``result.pt`` (parameters, the lr of each step it took, the
counters after its resume).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist
from _strategy_cases import full_params
from _world_cases import GLOBAL, STEPS, batches, counters, prepare_run, train

from stepforge.strategy import Strategy

KILL = 4  # rank 1 ends its node after saving step_4 (mid-epoch 1: 12 of its 36 samples drawn)
TIMEOUT_S = 60  # the process group's: a rank waiting for the dead node fails, never hangs


def _append(path: str, entry: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")


def _dist_cfg(work: str, attempt: str, world_size: int) -> dict[str, Any]:
    """A FileStore per attempt and world size (the agent's store kept stale addresses after a restart: see
    _fault_worker.py), shared by the ranks of one rendezvous round."""
    return dict(
        timeout=TIMEOUT_S,
        init_method=f"file://{os.path.join(work, f'pg-store-{attempt}-{world_size}')}",
        rank=int(os.environ["RANK"]),
        world_size=world_size,
    )


def main(work: str) -> None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    os.makedirs(os.path.join(work, "pids"), exist_ok=True)  # so the test can end workers left behind
    open(os.path.join(work, "pids", str(os.getpid())), "w").close()
    torch.set_num_threads(1)
    s = Strategy(
        plugin="torch_ddp",
        work_dir=os.path.join(work, "run"),
        experiment_name="elastic",
        env_kwargs=dict(randomness=dict(seed=7), dist_cfg=_dist_cfg(work, attempt, world_size)),
        log_kwargs=dict(console=False),
        resume="auto",
        global_batch_size=GLOBAL,
    )
    loader = prepare_run(s, world_size)
    resumed = counters(s, loader)
    if rank == 0:
        _append(
            os.path.join(work, "starts.jsonl"),
            dict(world_size=world_size, attempt=attempt, resumed_from=s.resumed_from, **resumed),
        )
    model, wrapper, schedulers = s._components()
    stream = batches(loader)
    ids_path = os.path.join(work, f"ids-{attempt}-{rank}.jsonl")
    lrs: list[float] = []
    step = wrapper._window.steps
    while step < STEPS:
        got = train(s, stream, step + 1)
        lrs += got["lrs"]
        for it, ids in got["ids"].items():
            _append(ids_path, dict(iteration=it, ids=ids))
        step += 1
        s.save_checkpoint(f"step_{step}", max_keep_ckpts=2)
        if world_size == 2 and rank == 1 and step == KILL:
            _append(os.path.join(work, "deaths.jsonl"), dict(step=step, agent=os.getppid()))
            os.kill(os.getppid(), signal.SIGKILL)  # the agent of this "node"...
            os.kill(os.getpid(), signal.SIGKILL)  # ...and its worker
    if rank == 0:
        torch.save(dict(params=full_params(model), lrs=lrs, resumed=resumed), os.path.join(work, "result.pt"))
    s.close()
    del s, model, wrapper, schedulers
    gc.collect()  # DDP objects hold the group: drop them, then tear it down while the interpreter is alive
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
