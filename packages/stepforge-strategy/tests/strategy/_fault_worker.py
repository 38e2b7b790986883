# SPDX-License-Identifier: Apache-2.0
"""One rank of the fault test (test_fault_restarts.py), started by ``torchrun --max-restarts``.

``python _fault_worker.py <work> <plan.json>``: trains a tiny model on ``torch_ddp`` with
``Strategy(resume="auto")``, saving ``iter_<k>`` every :data:`SAVE_EVERY` iterations (``max_keep_ckpts=2``).
The plan lists faults in order (``kind``, ``rank``, ``at``); a run arms only the first one not yet recorded in
``<work>/deaths.jsonl`` and, on its rank, SIGKILLs its own process at the first matching moment at or after
iteration ``at``, after appending the death to that file (so the restarted run arms the next fault instead):

- ``forward``: in the model's forward (a forward pre-hook);
- ``save_write``: inside a save, at its first ``os.fsync`` (DCP syncs each data file it wrote);
- ``before_rename``: inside a save, at the rename onto ``iter_<k>`` (rank 0: the marker is written, the
  temporary directory not yet renamed);
- ``between_renames``: inside a save, at the rename onto ``last_checkpoint`` (rank 0: the directory is renamed,
  the pointer still names the previous checkpoint).

Only this process's own ``os.fsync``/``os.replace``/``os.rename`` are wrapped: the library has no test hook.
Rank 0 appends each start to ``<work>/starts.jsonl``; the run that completes writes its final parameters and
those of an uninterrupted run in the same processes (a fresh Strategy without saves) to ``<work>/result.pt``.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from stepforge.strategy import Strategy

ITERS = 18
SAVE_EVERY = 3
COUNTS = 2
TIMEOUT_S = (
    120  # every collective and the first connection: a rank waiting for a dead peer fails, never hangs
)


def _record(path: str, entry: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _lines(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class Fault:
    """The fault armed in this run on this rank (none when the plan's next entry is for another rank)."""

    def __init__(self, work: str, entry: dict[str, Any] | None, rank: int) -> None:
        self.deaths = os.path.join(work, "deaths.jsonl")
        self.entry = entry if entry is not None and entry["rank"] == rank else None
        self.iteration = 0
        self.saving = False
        self.fsyncs = 0
        real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

        def fsync(fd: Any) -> None:
            if self.saving:
                self.fsyncs += 1
                if self.fsyncs == 1 and self._due("save_write"):
                    self.die()
            real_fsync(fd)

        def before_rename(dst: Any) -> None:
            name = os.path.basename(os.fspath(dst))
            if self.saving and name == f"iter_{self.iteration}" and self._due("before_rename"):
                self.die()  # committed in its temporary directory, not renamed yet
            if self.saving and name == "last_checkpoint" and self._due("between_renames"):
                self.die()  # renamed, the pointer still names the previous checkpoint

        def replace(src: Any, dst: Any, **kwargs: Any) -> None:
            before_rename(dst)
            real_replace(src, dst, **kwargs)

        def rename(src: Any, dst: Any, **kwargs: Any) -> None:
            before_rename(dst)
            real_rename(src, dst, **kwargs)

        if self.entry is not None:  # os.rename too: a writer may rename with either
            os.fsync, os.replace, os.rename = fsync, replace, rename

    def die(self) -> None:
        assert self.entry is not None
        _record(self.deaths, {**self.entry, "iteration": self.iteration})
        os.kill(os.getpid(), signal.SIGKILL)

    def _due(self, kind: str) -> bool:
        return self.entry is not None and self.entry["kind"] == kind and self.iteration >= self.entry["at"]

    def forward_hook(self, module: nn.Module, args: Any) -> None:
        if self._due("forward"):
            self.die()

    def save(self, strategy: Strategy, iteration: int) -> None:
        self.iteration, self.saving, self.fsyncs = iteration, True, 0
        try:
            strategy.save_checkpoint(f"iter_{iteration}", max_keep_ckpts=2)
        finally:
            self.saving = False


def _batch(iteration: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * iteration + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)


def _dist_cfg(work: str) -> dict[str, Any]:
    """``init_process_group`` arguments: a FileStore of this restart attempt instead of torchrun's agent store.

    Observed with torch 2.13 on this machine: after a restart, gloo's connectFullMesh through the agent's store
    read addresses of the killed attempt (connection refused) or hung past the process-group timeout. A store
    file per attempt (``TORCHELASTIC_RESTART_COUNT``) holds only this attempt's keys.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dict(
        timeout=TIMEOUT_S,
        init_method=f"file://{os.path.join(work, f'pg-store-{attempt}')}",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )


def _strategy(work_dir: str, resume: bool | str, dist_cfg: dict[str, Any]) -> Strategy:
    s = Strategy(
        plugin="torch_ddp",
        work_dir=work_dir,
        experiment_name="faults",
        env_kwargs=dict(randomness=dict(seed=3), dist_cfg=dist_cfg),
        log_kwargs=dict(console=False),
        resume=resume,
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 2))
    s.prepare(
        model,
        optim_wrapper=dict(optimizer=dict(type="AdamW", lr=0.05), accumulative_counts=COUNTS),
        param_scheduler=[dict(type="CosineAnnealingLR", eta_min=0.001, by_epoch=False)],
        dispatch_kwargs=dict(max_iters=ITERS),
    )
    return s


def _train(s: Strategy, rank: int, fault: Fault | None) -> dict[str, torch.Tensor]:
    model, wrapper, schedulers = s._components()
    if fault is not None:
        model.register_forward_pre_hook(fault.forward_hook)
    model.train()
    for it in range(s.dispatch_kwargs.get("cur_iter", 0), ITERS):
        if fault is not None:
            fault.iteration = it
        x, y = _batch(it, rank)
        with wrapper.optim_context(model):
            loss = (model(x) - y).square().mean()
        wrapper.update_params(loss)
        for sched in schedulers:
            sched.step()
        if fault is not None and (it + 1) % SAVE_EVERY == 0:
            fault.save(s, it + 1)
    return {k: v.detach().clone() for k, v in get_model_state_dict(model).items()}


def main(work: str, plan_path: str) -> None:
    with open(plan_path, encoding="utf-8") as f:
        plan = json.load(f)
    rank = int(os.environ["RANK"])
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung run's stacks, on demand
    os.makedirs(os.path.join(work, "pids"), exist_ok=True)  # so the test can end workers torchrun left behind
    open(os.path.join(work, "pids", str(os.getpid())), "w").close()
    deaths = _lines(os.path.join(work, "deaths.jsonl"))
    torch.set_num_threads(1)
    s = _strategy(os.path.join(work, "run"), "auto", _dist_cfg(work))
    if rank == 0:
        _record(
            os.path.join(work, "starts.jsonl"),
            {
                "start": s.dispatch_kwargs.get("cur_iter", 0),
                "resumed_from": s.resumed_from,
                "deaths": len(deaths),
            },
        )
    fault = Fault(work, plan[len(deaths)] if len(deaths) < len(plan) else None, rank)
    got = _train(s, rank, fault)
    s.close()
    ref = _strategy(os.path.join(work, "reference"), False, {})  # uninterrupted, never saves (group reused)
    want = _train(ref, rank, None)
    ref.close()
    if rank == 0:
        torch.save({"got": got, "want": want}, os.path.join(work, "result.pt"))
    del s, ref
    gc.collect()  # DDP objects hold the group: drop them, then tear it down while the interpreter is alive
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
