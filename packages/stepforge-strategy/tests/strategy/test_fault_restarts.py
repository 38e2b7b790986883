# SPDX-License-Identifier: Apache-2.0
"""Faults survived: 2 ranks under ``torchrun --max-restarts=6`` with ``Strategy(resume="auto")``, a rank SIGKILLed 5
times at seeded moments (in the forward, while a save writes its files, after a save's marker before its rename,
between its directory rename and the ``last_checkpoint`` rename), finish with parameters bitwise equal to an
uninterrupted run; every restart resumes the last committed checkpoint (so it loses at most the work since),
and no temporary checkpoint directory is left. The rank's own process kills itself (``_fault_worker.py`` wraps
its own ``os.fsync``/``os.replace`` and forward); the library has no test hook.

Bounded: torchrun's rendezvous times out after 60 s, every collective after 120 s (the process group timeout), the
whole run after 400 s (then torchrun and every worker are killed). About 75 s on 2 loaded cores.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import pytest
import torch
from _fault_worker import ITERS, SAVE_EVERY

from stepforge.testing.distributed import requires_gloo

pytestmark = requires_gloo

HERE = os.path.dirname(os.path.abspath(__file__))

RUN_TIMEOUT_S = 400
KINDS = ("forward", "save_write", "before_rename", "between_renames")


def fault_plan(seed: int, n: int = 5) -> list[dict]:
    """``n`` faults at increasing iterations, every kind at least once, seeded."""
    rng = random.Random(seed)
    kinds = list(KINDS) + [rng.choice(KINDS) for _ in range(n - len(KINDS))]
    rng.shuffle(kinds)
    ats = sorted(rng.sample(range(1, ITERS - SAVE_EVERY), n))
    plan = []
    for kind, at in zip(kinds, ats, strict=True):
        # only rank 0 commits (the renames); either rank computes and writes its shards
        rank = 0 if kind in ("before_rename", "between_renames") else rng.randrange(2)
        plan.append({"kind": kind, "rank": rank, "at": at})
    return plan


def expected_restart(death: dict) -> int:
    """The iteration a restart continues at: the last checkpoint committed AND named by ``last_checkpoint``."""
    if death["kind"] == "forward":  # killed in iteration i: iter_k with k <= i is committed
        return death["iteration"] // SAVE_EVERY * SAVE_EVERY
    return death["iteration"] - SAVE_EVERY  # killed in the save of iter_k: the previous one


def _kill_workers(work: str) -> None:
    """End every worker process the run started that is still alive (each records its pid)."""
    folder = os.path.join(work, "pids")
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        try:
            os.kill(int(name), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _lines(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.distributed
def test_five_sigkills_under_torchrun_restarts(tmp_path):
    work = str(tmp_path)
    plan = fault_plan(seed=2026)
    plan_path = os.path.join(work, "plan.json")
    with open(plan_path, "w", encoding="utf-8") as f:
        json.dump(plan, f)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--max-restarts=6",
        "--monitor-interval=0.2",
        "--rdzv-conf=join_timeout=60,close_timeout=10",
        os.path.join(HERE, "_fault_worker.py"),
        work,
        plan_path,
    ]
    log_path = os.path.join(work, "torchrun.log")
    with open(log_path, "w", encoding="utf-8") as log:  # a file, not a pipe: no reader can block on it
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        finally:
            _kill_workers(work)
    with open(log_path, encoding="utf-8") as f:
        output = f.read()
    assert proc.returncode == 0, f"torchrun failed or timed out ({proc.returncode}):\n{output[-6000:]}"

    deaths = _lines(os.path.join(work, "deaths.jsonl"))
    assert [(d["kind"], d["rank"], d["at"]) for d in deaths] == [
        (p["kind"], p["rank"], p["at"]) for p in plan
    ]
    assert {d["kind"] for d in deaths} == set(KINDS)
    starts = _lines(os.path.join(work, "starts.jsonl"))
    assert len(starts) == len(plan) + 1 and starts[0]["start"] == 0 and starts[0]["resumed_from"] is None
    for death, start in zip(deaths, starts[1:], strict=True):
        want = expected_restart(death)
        assert start["start"] == want, f"after {death}: restarted at {start}, expected iteration {want}"
        named = None if want == 0 else os.path.join(work, "run", f"iter_{want}")
        assert start["resumed_from"] == named

    result = torch.load(os.path.join(work, "result.pt"), weights_only=True)
    assert result["got"].keys() == result["want"].keys() and len(result["want"]) == 4
    for key, want in result["want"].items():
        assert torch.equal(result["got"][key], want), f"{key} differs from the uninterrupted run"

    run = os.path.join(work, "run")
    entries = os.listdir(run)
    assert not [e for e in entries if ".tmp-" in e or ".old-" in e], entries
    ckpts = sorted(e for e in entries if e.startswith("iter_"))
    assert ckpts == [f"iter_{ITERS - SAVE_EVERY}", f"iter_{ITERS}"]  # max_keep_ckpts=2, all committed
    assert all(os.path.isfile(os.path.join(run, c, "COMMIT.json")) for c in ckpts)
