# SPDX-License-Identifier: Apache-2.0
"""The mechanism behind "terminate called without an active exception" at exit, made deterministic.

Plain torch, no stepforge. Rank 0 hands a Python-created tensor to an asynchronous gloo all-reduce, drops its
own references (the tensor and the work handle) and returns, so the interpreter starts finalising while a
gloo worker thread still owns the tensor. Rank 1 joins the all-reduce ``--delay`` seconds later. When the
collective completes, the worker thread drops the last reference to the tensor, whose Python object must then
be freed under the GIL; in a finalising interpreter, taking the GIL ends the thread (``pthread_exit``), the
forced unwind crosses a ``noexcept`` C++ frame, and libstdc++ calls ``std::terminate``: SIGABRT.

In a training script the same race exists at a much smaller scale: the main thread's ``wait()`` returns when
the collective is complete, but the worker thread releases its references a moment later; under CPU load that
moment can outlast the rest of the script. ``--teardown destroy`` calls ``dist.destroy_process_group()``
before returning: ``~ProcessGroupGloo`` waits for the work and joins the worker threads while the interpreter
is alive, and the exit is clean.

    python tools/repro/gloo_exit_mechanism.py --teardown none      # rank 0: SIGABRT (returncode -6)
    python tools/repro/gloo_exit_mechanism.py --teardown destroy   # both ranks: 0

Measured on torch 2.13.0+cpu (the project's 2-core machine, 2026-11-28): ``--teardown none`` exited 0 on both
ranks in 3 of 3 runs (``--delay`` 1, 3 and 5 s), so the abort above is not reproduced by this script on that
torch; see "Process exit" in packages/stepforge-strategy/README.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys


def _child(rank: int, port: int, teardown: str, delay: float, keep: bool) -> None:
    import datetime
    import time

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    if rank == 1:
        time.sleep(delay)  # rank 0 is already finalising when the collective completes
        dist.all_reduce(torch.ones(4))
        dist.destroy_process_group()
        return
    t = torch.ones(4)
    work = dist.all_reduce(t, async_op=True)
    if keep:
        # keeping a Python reference until the very end moves the tensor's last release to the main thread
        globals()["_kept"] = (t, work)
    del t, work
    if teardown == "destroy":
        dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teardown", choices=("none", "destroy"), default="none")
    ap.add_argument("--delay", type=float, default=3.0)
    ap.add_argument("--keep", action="store_true", help="rank 0 keeps a Python reference to the tensor")
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank >= 0:
        _child(a.rank, a.port, a.teardown, a.delay, a.keep)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    argv = [sys.executable, os.path.abspath(__file__), "--teardown", a.teardown, "--delay", str(a.delay)]
    argv += ["--port", str(port)] + (["--keep"] if a.keep else [])
    procs = [
        subprocess.Popen([*argv, "--rank", str(r)], env=env, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    codes, notes = [], []
    for p in procs:
        try:
            _, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            notes.append("timeout")
        codes.append(p.returncode)
        notes += [line.strip() for line in err.splitlines() if "terminate" in line][:1]
    verdict = "OK" if all(c == 0 for c in codes) else ("SIGABRT" if -signal.SIGABRT in codes else "FAIL")
    print(f"teardown={a.teardown} keep={a.keep} returncodes={codes} {verdict} {notes}")
    return 0 if verdict == "OK" else 1


if __name__ == "__main__":
    sys.exit(main())
