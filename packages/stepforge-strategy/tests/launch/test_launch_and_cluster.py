# SPDX-License-Identifier: Apache-2.0
"""ColossalAI's launch and cluster helpers from stepforge.strategy, as its scripts call them:
``launch_from_torch(seed=...)``, ``DistCoordinator`` (rank facts, ``print_on_master`` on rank 0 only,
``priority_execution``: the executor's block ends before any other rank's begins) and ``get_accelerator()``
answering for the device present (the CPU here)."""

from __future__ import annotations

import contextlib
import io
import os
import random

import pytest
import torch
import torch.distributed as dist

from stepforge.core.torch_compat import default_store
from stepforge.strategy import (
    Accelerator,
    DistCoordinator,
    get_accelerator,
    launch,
    launch_from_torch,
    set_accelerator,
)
from stepforge.strategy import accelerator as accelerator_module
from stepforge.testing.distributed import requires_gloo, run_distributed


def test_the_cpu_accelerator_answers_what_the_cpu_has():
    cpu = Accelerator("cpu")
    assert (cpu.name, cpu.communication_backend, cpu.support_set_device) == ("cpu", "gloo", False)
    assert cpu.get_current_device() == torch.device("cpu") and cpu.current_device() == 0
    assert cpu.is_available() and cpu.device_count() == 1
    assert cpu.synchronize() is None and cpu.empty_cache() is None
    cpu.set_device(None)
    cpu.set_device(0)
    with pytest.raises(ValueError, match="one CPU device"):
        cpu.set_device(torch.device("cuda", 1))
    with pytest.raises(RuntimeError, match="CUDA only; on the CPU use max_memory_reserved"):
        cpu.max_memory_allocated()
    peak = cpu.max_memory_reserved()
    assert (
        peak >= torch.ones(2**20).numel() * 4
    )  # at least the 4 MiB just allocated were resident at some point
    cpu.manual_seed_all(7)
    first = torch.rand(3)
    state = cpu.get_rng_state()
    second = torch.rand(3)
    cpu.manual_seed(7)
    assert torch.equal(torch.rand(3), first)
    cpu.set_rng_state(state)
    assert torch.equal(torch.rand(3), second)


def test_get_accelerator_is_the_device_present_and_set_accelerator_replaces_it(monkeypatch):
    monkeypatch.setattr(accelerator_module, "_PROCESS_ACCELERATOR", None)
    found = get_accelerator()
    assert found is get_accelerator()  # one per process
    assert found.name == ("cuda" if torch.cuda.is_available() else "cpu")
    set_accelerator("cpu")
    assert get_accelerator().name == "cpu"
    mine = Accelerator("cpu")
    set_accelerator(mine)
    assert get_accelerator() is mine
    with pytest.raises(TypeError, match="'cpu', 'cuda' or an Accelerator"):
        set_accelerator(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is not supported"):
        set_accelerator("npu")


def test_launch_from_torch_names_what_torchrun_did_not_set(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(
        RuntimeError, match="LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set; start the"
    ):
        launch_from_torch()
    with pytest.raises(ValueError, match="rank must be in"):
        launch(rank=2, world_size=2, host="127.0.0.1", port=1)
    assert not dist.is_initialized()


def _coordinate(rank: int, world: int, workdir: str) -> dict:
    out: dict = {}
    launch_from_torch(seed=123)  # the launcher's group is kept; the seed is applied
    out["seeded"] = (torch.initial_seed(), random.random())
    coordinator = DistCoordinator()
    out["facts"] = (coordinator.rank, coordinator.world_size, coordinator.local_rank)
    out["roles"] = (coordinator.is_master(), coordinator.is_last_process(), coordinator.is_node_master())
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        coordinator.print_on_master(f"hello from {rank}")
        coordinator.print_on_node_master(f"node hello from {rank}")
    out["printed"] = printed.getvalue()
    out["on_master_only"] = coordinator.on_master_only()(lambda x: x * 2)(21)

    # priority_execution: rank 0 "downloads" a file inside the block, the other rank reads it inside its block.
    # Rank 0 starts only once rank 1 is about to enter, so a coordinator that let rank 1 in early would show.
    store = default_store()
    path = os.path.join(workdir, "dataset.txt")
    if rank == 1:
        store.set("rank1_calls", "1")
    else:
        store.wait(["rank1_calls"])
    with coordinator.priority_execution():
        out["enter"] = store.add("events", 1)
        if rank == 0:
            with open(path + ".tmp", "w") as f:
                f.write("downloaded")
            os.replace(path + ".tmp", path)
        out["seen"] = open(path).read() if os.path.exists(path) else None
        out["leave"] = store.add("events", 1)
    coordinator.block_all()
    # a non-default executor
    with coordinator.priority_execution(executor_rank=1):
        out["enter_1"] = store.add("events_1", 1)
    return out


@requires_gloo
def test_dist_coordinator_at_two_ranks(tmp_path):
    results = run_distributed(_coordinate, 2, str(tmp_path), timeout=120)
    random.seed(123)
    python_draw = random.random()
    for rank, out in enumerate(results):
        assert out["seeded"] == (123, python_draw), rank
        assert out["facts"] == (rank, 2, rank)
        assert out["roles"] == (rank == 0, rank == 1, rank == 0)
        assert out["on_master_only"] == (42 if rank == 0 else None)
        assert out["seen"] == "downloaded"
    assert results[0]["printed"] == "hello from 0\nnode hello from 0\n" and results[1]["printed"] == ""
    # the executor's block (events 1 and 2) ends before the other rank's (3 and 4) begins
    assert (results[0]["enter"], results[0]["leave"], results[1]["enter"], results[1]["leave"]) == (
        1,
        2,
        3,
        4,
    )
    assert (results[1]["enter_1"], results[0]["enter_1"]) == (1, 2)


_EXIT_SCRIPT = """
import atexit, sys
import torch, torch.distributed as dist
# registered first, so it runs last (atexit is last-in, first-out): what a script's final moment sees
atexit.register(lambda: print("default group at exit:", dist.is_initialized(), flush=True))
from stepforge.strategy import launch_from_torch
launch_from_torch(backend="gloo", seed=3, verbose=False)
t = torch.ones(4)
work = dist.all_reduce(t, async_op=True)  # left to gloo's thread: the script just returns
del t, work
"""


@requires_gloo
def test_launch_from_torch_tears_its_group_down_at_exit(tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "script.py"
    script.write_text(_EXIT_SCRIPT)
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")  # fmt: skip
        procs.append(
            subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
        )
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    # stepforge made the group, so stepforge destroyed it before teardown: gloo's threads were joined in time
    assert all("default group at exit: False" in out for out in outs), outs
