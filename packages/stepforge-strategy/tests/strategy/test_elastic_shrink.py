# SPDX-License-Identifier: Apache-2.0
"""An elastic restart at a smaller world size: two ``torchrun --nnodes=1:2`` agents ("nodes", one worker each,
c10d rendezvous on localhost), one of them SIGKILLed with its worker after the checkpoint of step 4; the surviving
agent restarts its worker (``--max-restarts``), the rendezvous completes with one node, and ``Strategy(resume=
"auto", global_batch_size=12)`` resumes that checkpoint at world size 1 (``accumulative_counts`` 6 -> 12) and
finishes. Checked against explicit expectations (see _elastic_worker.py and _world_cases.py):

- the starts: world size 2 from scratch, then world size 1 from ``step_4`` with the counters in the new unit;
- the sample ids of every optimizer step across both attempts: DistributedSampler's documented order, 12 at a
  time (the iterations rank 0 ran after ``step_4`` before its all-reduce failed are lost work, left out);
- the lr of each step after the restart and the final parameters against plain torch on one process.

Bounded: the rendezvous joins time out after 60 s, every collective after 60 s, the whole run after 300 s (then
both agents and every worker are killed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from _elastic_worker import KILL
from _world_cases import GAMMA, GLOBAL, LR, STEPS, N, expected_ids, reference

from stepforge.testing.distributed import free_port, requires_gloo

pytestmark = requires_gloo

HERE = os.path.dirname(os.path.abspath(__file__))
RUN_TIMEOUT_S = 300


def _lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _agent(work: str, port: int, host: bool, log: object) -> subprocess.Popen:
    # last_call_timeout: how long a round with fewer than 2 nodes waits for the other (both start together; after
    # the kill the survivor waits this long, then goes on alone)
    conf = f"is_host={str(host).lower()},join_timeout=60,last_call_timeout=10,close_timeout=10"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=elastic-shrink",
        f"--rdzv-conf={conf}",
        "--max-restarts=2",
        "--monitor-interval=0.2",
        os.path.join(HERE, "_elastic_worker.py"),
        work,
    ]
    paths = os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])
    env = {
        **os.environ,
        "PYTHONPATH": paths,
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    }
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _end(procs: list[subprocess.Popen], work: str) -> None:
    """Kill what is still running: both agents' process groups and every worker (each recorded its pid)."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    folder = os.path.join(work, "pids")
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        try:
            os.kill(int(name), signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.distributed
def test_a_lost_node_restarts_at_world_size_1_and_finishes(tmp_path):
    work = str(tmp_path)
    port = free_port()
    logs = [os.path.join(work, f"agent-{i}.log") for i in range(2)]
    with open(logs[0], "w", encoding="utf-8") as log_a, open(logs[1], "w", encoding="utf-8") as log_b:
        survivor = _agent(work, port, True, log_a)  # hosts the rendezvous store, so it outlives the other
        doomed = _agent(work, port, False, log_b)
        try:
            survivor.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        finally:
            _end([survivor, doomed], work)
    output = ""
    for path in logs:
        with open(path, encoding="utf-8") as f:
            output += f.read()[-4000:] + "\n"
    assert survivor.returncode == 0, (
        f"the surviving agent failed or timed out ({survivor.returncode}):\n{output}"
    )

    assert _lines(os.path.join(work, "deaths.jsonl"))[0]["step"] == KILL
    starts = _lines(os.path.join(work, "starts.jsonl"))
    assert [(s["world_size"], s["resumed_from"]) for s in starts] == [
        (2, None),
        (1, os.path.join(work, "run", f"step_{KILL}")),
    ], output
    epoch = (KILL * GLOBAL - 1) // N
    samples = KILL * GLOBAL - epoch * N
    assert {k: v for k, v in starts[1].items() if k not in ("world_size", "attempt", "resumed_from")} == dict(
        counts=GLOBAL,
        cur_iter=KILL * GLOBAL,
        inner_count=KILL * GLOBAL,
        steps=KILL,
        sched_clock=KILL * GLOBAL,
        epoch_length=N,
        loader=dict(epoch=epoch, batches_yielded=samples, samples=samples),
        lr=pytest.approx(LR * GAMMA ** (KILL // 3), rel=1e-12),
    )

    # every step's samples, from the attempt that committed it
    drawn: dict[int, list[int]] = {}
    for rank in range(2):  # attempt 0: 2 ranks, 6 iterations per step, only what step_4 holds
        for entry in _lines(os.path.join(work, f"ids-{starts[0]['attempt']}-{rank}.jsonl")):
            if entry["iteration"] < KILL * GLOBAL // 2:
                drawn.setdefault(entry["iteration"] // (GLOBAL // 2), []).extend(entry["ids"])
    for entry in _lines(os.path.join(work, f"ids-{starts[1]['attempt']}-0.jsonl")):
        drawn.setdefault(entry["iteration"] // GLOBAL, []).extend(entry["ids"])
    assert sorted(drawn) == list(range(STEPS))
    for step, ids in drawn.items():
        assert len(ids) == GLOBAL and set(ids) == expected_ids(step), f"step {step}"

    result = torch.load(os.path.join(work, "result.pt"), weights_only=True)
    assert result["lrs"] == [LR * GAMMA ** (k // 3) for k in range(KILL, STEPS)]
    want = reference()[-1]
    assert result["params"].keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(result["params"][key], value, rtol=1e-5, atol=1e-6, msg=key)
