# SPDX-License-Identifier: Apache-2.0
"""One try of the capacity search, run in a process of its own (``bench_capacity.py --one-try SPEC``): build the
contender over a GPT of the given depth on the device, train ``steps`` steps, and write what happened and what it
held to the spec's result file. A device out-of-memory error, a host-memory guard stop or any other failure is
recorded as the result; the process then leaves through ``os._exit`` (no teardown of tens of GB, and nothing of
this try survives into the next one).

The result (JSON): ``ok`` (every step ran and every loss is finite), ``kind`` (``""``, ``"device"``: CUDA out of
memory, ``"host"``: the guard or a host allocation failure, ``"loss"``, ``"error"``), ``reason``, ``depth``,
``parameters``, ``losses``, ``build_s``, ``step_s``, ``device`` (peak allocated/reserved, total, free at start),
``host`` (resident at start, peak, the limit), ``wall_s``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from bench.gpu_train._contenders import build_trainer
from bench.gpu_train._gpt import capacity_shape, random_batch
from bench.gpu_train._memory import (
    HostGuard,
    device_memory,
    host_available_bytes,
    host_peak_rss_bytes,
    host_rss_bytes,
    reset_device_peak,
)

__all__ = ["run_try"]


def _classify(exc: BaseException) -> str:
    if isinstance(exc, torch.OutOfMemoryError):
        return "device"
    text = str(exc).lower()
    if isinstance(exc, MemoryError) or "can't allocate memory" in text or "cannot allocate memory" in text:
        return "host"
    if "out of memory" in text:
        return "device"
    return "error"


def run_try(spec: dict[str, Any]) -> None:
    """Run the try ``spec`` describes (see ``bench_capacity.py``) and write its result; never returns."""
    t_start = time.perf_counter()
    device = torch.device(spec["device"])
    shape = capacity_shape(
        spec["depth"],
        d_model=spec["d_model"],
        heads=spec["heads"],
        vocab=spec["vocab"],
        seq_len=spec["seq_len"],
    )
    result: dict[str, Any] = {
        "contender": spec["contender"],
        "depth": spec["depth"],
        "parameters": shape.parameters,
        "ok": False,
        "kind": "error",
        "reason": "did not finish",
        "losses": [],
        "step_s": [],
    }
    out = Path(spec["result"])

    def write() -> None:
        result["wall_s"] = time.perf_counter() - t_start
        out.write_text(json.dumps(result))

    if device.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)  # the context exists before the baseline is read
    free_at_start = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    result["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    baseline = host_rss_bytes() or 0
    result["host"] = {
        "baseline_rss": baseline,
        "rss_limit": spec.get("host_rss_limit"),
        "available_at_start": host_available_bytes(),
    }

    def stopped_by_guard(reason: str) -> None:
        result.update(ok=False, kind="host", reason=reason)
        result["host"]["peak_rss"] = guard.peak_rss
        write()

    guard = HostGuard(spec.get("host_rss_limit"), spec.get("min_available"), stopped_by_guard).start()
    reset_device_peak(device)
    try:
        t0 = time.perf_counter()
        trainer = build_trainer(spec["contender"], shape, device, lazy=True)
        result["build_s"] = time.perf_counter() - t0
        for step in range(spec["steps"]):
            x, y = random_batch(shape, spec["batch"], step, device)
            t0 = time.perf_counter()
            loss = float(trainer.train_step(x, y))
            result["step_s"].append(time.perf_counter() - t0)
            result["losses"].append(loss)
        finite = all(math.isfinite(v) for v in result["losses"])
        result.update(
            ok=finite, kind="" if finite else "loss", reason="" if finite else "a loss is not finite"
        )
    except BaseException as exc:  # every failure is this try's result
        result.update(
            ok=False,
            kind=_classify(exc),
            reason=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}",
        )
        if result["kind"] == "error":
            result["traceback"] = traceback.format_exc()[-3000:]
    finally:
        guard.stop()
        memory = device_memory(device)
        memory["free_at_start"] = free_at_start
        result["device"] = memory
        result["host"]["peak_rss"] = max(guard.peak_rss, host_peak_rss_bytes())
        write()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
