# SPDX-License-Identifier: Apache-2.0
"""A save that fails on one rank fails on every rank, at once, with the same ``CheckpointError``: synchronous or
``use_async=True`` (then at ``_sync_io``), written by rank 0 alone (models, plain optimizers, schedulers) or by
every rank (a DCP optimizer save whose rank 1 cannot write). No rank is left waiting in a collective the other
left, and the process group stays usable afterwards (an all-reduce right after each failure gives the sum)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from stepforge.strategy import Booster, CheckpointError, GeneralCheckpointIO
from stepforge.testing.distributed import requires_gloo, run_distributed


def _outcome(save: Callable[[], None]) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        save()
        kind, text = "returned", ""
    except CheckpointError as exc:
        kind, text = type(exc).__name__, str(exc)
    except Exception as exc:  # anything else is a failure of the test too, reported by name
        kind, text = type(exc).__name__, str(exc)
    seconds = time.monotonic() - start
    total = torch.ones(1)
    dist.all_reduce(total)  # the group still pairs every rank's collectives
    assert total.item() == dist.get_world_size()
    return kind, text, seconds


def _failing_saves(rank: int, world: int, root: str) -> dict[str, tuple[str, str, float]]:
    blocker = os.path.join(root, "a_file")  # a regular file: nothing can be written below it
    if rank == 0:
        with open(blocker, "w") as f:
            f.write("not a folder")
    dist.barrier()
    bad = os.path.join(blocker, "ckpt")
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    booster = Booster(plugin="torch_ddp")
    model, optimizer, *_ = booster.boost(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    optimizer.backward(model(torch.ones(2, 4)).sum())
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    plain_net = nn.Linear(4, 3)
    plain = torch.optim.SGD(plain_net.parameters(), lr=0.1, momentum=0.9)
    plain_net(torch.ones(2, 4)).sum().backward()
    plain.step()
    general = GeneralCheckpointIO()

    def then_sync(save: Callable[[], None], io=booster.checkpoint_io) -> Callable[[], None]:
        def run() -> None:
            save()
            io._sync_io()

        return run

    out = {
        "model file": _outcome(lambda: booster.save_model(model, f"{bad}.pt")),
        "model shards": _outcome(lambda: booster.save_model(model, bad, shard=True)),
        "scheduler": _outcome(lambda: booster.save_lr_scheduler(scheduler, f"{bad}.sched")),
        "plain optimizer": _outcome(lambda: general.save_optimizer(plain, f"{bad}.optim")),
        "plain optimizer shards": _outcome(lambda: general.save_optimizer(plain, bad, shard=True)),
        "async model file": _outcome(
            then_sync(lambda: booster.save_model(model, f"{bad}.st", use_async=True))
        ),
        "async model shards": _outcome(
            then_sync(lambda: booster.save_model(model, bad, shard=True, use_async=True))
        ),
        "async plain optimizer": _outcome(
            then_sync(lambda: general.save_optimizer(plain, f"{bad}.optim", use_async=True), general)
        ),
    }
    # rank 1 alone cannot write its part of a DCP optimizer save
    from torch.distributed.checkpoint import FileSystemWriter

    real = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError(28, "No space left on device (rank 1)")
        return real(self, plan, planner)

    FileSystemWriter.write_data = write_data
    try:
        out["optimizer, rank 1 fails"] = _outcome(
            lambda: booster.save_optimizer(optimizer, f"{root}/opt", shard=True)
        )
        out["async optimizer, rank 1 fails"] = _outcome(
            then_sync(
                lambda: booster.save_optimizer(optimizer, f"{root}/opt_async", shard=True, use_async=True)
            )
        )
    finally:
        FileSystemWriter.write_data = real
    out["nothing committed"] = ("listing", repr(sorted(os.listdir(root))), 0.0)
    return out


@requires_gloo
def test_a_save_failing_on_one_rank_fails_on_every_rank_at_once(tmp_path):
    ranks = run_distributed(_failing_saves, 2, str(tmp_path), timeout=150)
    assert ranks[0].keys() == ranks[1].keys()
    for case in ranks[0]:
        (kind0, text0, s0), (kind1, text1, s1) = ranks[0][case], ranks[1][case]
        if case == "nothing committed":
            assert text0 == text1 == repr(["a_file"]), text0  # no directory, no temporary one left
            continue
        assert kind0 == kind1 == "CheckpointError", (case, kind0, text0, kind1, text1)
        assert text0 == text1, case  # the same error on every rank
        assert "rank 1" in text0 if "rank 1 fails" in case else "a_file" in text0, (case, text0)
        assert s0 < 30 and s1 < 30, (case, s0, s1)  # at once, not after a collective's timeout
