# SPDX-License-Identifier: Apache-2.0
"""One rank of ``bench_estimate.py``: train a configuration for two steps and measure what the rank holds.

Every tensor storage the rank allocates, from building the model on, is counted by torch's ``MemTracker``
(``stepforge.core.torch_compat.memory_tracker``): the total live bytes after ``boost``, at the end of step 2's
forward, after step 2's ``optimizer.step()`` (before ``zero_grad``), and the peak over step 2. The total after
the step is split by walking the live objects: the model's parameters (local shards), their gradients (and
ZeRO's reduced gradient pieces), ZeRO's separate fp32 masters, the optimizer's state; whatever else is alive
(model buffers, buckets, pools, tables, gathered parameters) is ``buffers``. Each storage counts once. Peak RSS
growth (``ru_maxrss``) is recorded beside it.

With ``case["accumulation"]`` N > 1 each optimizer step takes N micro-batches through ``ColossalAIOptimWrapper``
as the GPT demo drives it (the forward inside ``optim_context``, every micro-batch but the window's last under the
plugin's ``no_sync``): step 2's window is measured, and also the total held between its first and second
micro-batch (``window``), with the bytes in the parameters' ``.grad`` at that point.

:func:`run_fake_ranks` measures one rank of a large world instead, on torch's fake process group in one process
(``--fake-worlds``, ``bench_architectures.py --fake``); on a CUDA device ``torch.cuda.memory_allocated``/
``max_memory_allocated`` are recorded beside the tracker's totals. :func:`estimate_of` is the estimate of the
same case, the figures both benches compare.

Imported by the drivers (``estimate/bench_estimate.py``, ``estimate/bench_architectures.py``) as ``measure``;
:func:`run_rank` and :func:`run_cases` run in each spawned process, :func:`run_fake_ranks` in one per plugin or
world.
"""

from __future__ import annotations

import datetime
import os
import resource
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

__all__ = [
    "CONFIGS",
    "build_model",
    "batch",
    "criterion_for",
    "workload",
    "measure_rank",
    "run_cases",
    "run_fake_ranks",
    "run_rank",
    "fake_device",
    "estimate_of",
]

#: precision x optimizer configurations the bench measures
CONFIGS: dict[str, dict[str, Any]] = {
    "adamw-fp32": dict(precision="fp32", optimizer=dict(type="AdamW", lr=1e-4)),
    "adamw-bf16": dict(precision="bf16", optimizer=dict(type="AdamW", lr=1e-4)),
    "sgd-fp32": dict(precision="fp32", optimizer=dict(type="SGD", lr=1e-2, momentum=0.9)),
    # the GPT demo's own (examples/train_gpt_demo.py: zero2, bf16, CPUAdam): --demo only
    "cpuadam-bf16": dict(
        precision="bf16", optimizer=dict(type="CPUAdam", lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    ),
}
#: the configurations measured by default
DEFAULT_CONFIGS = ("adamw-fp32", "adamw-bf16", "sgd-fp32")


def build_model(size: dict[str, int]) -> torch.nn.Module:
    """The bench's byte-level GPT (``examples/gpt_demo_model.py``), seeded."""
    from gpt_demo_model import ByteGPT

    torch.manual_seed(0)
    return ByteGPT(size["d_model"], size["layers"], size["heads"], size["seq_len"])


def batch(size: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch: ``(inputs, targets)``, int64 ``(micro_batch, seq_len)``."""
    g = torch.Generator().manual_seed(1)
    shape = (size["micro_batch"], size["seq_len"])
    return torch.randint(0, 256, shape, generator=g), torch.randint(0, 256, shape, generator=g)


def workload(case: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor], Any]:
    """``(build the model, the micro-batch as keyword arguments, the loss of the output)`` of ``case``: the
    bench's GPT of ``case["size"]``, or ``case["arch"]`` of ``_architectures`` (with ``case["checkpointing"]``)."""
    if "arch" in case:
        from bench.estimate import _architectures as arch

        kwargs = arch.inputs(case["arch"])
        return (
            lambda: arch.build(case["arch"], checkpointing=case.get("checkpointing", False)),
            kwargs,
            arch.loss_of(case["arch"], kwargs),
        )
    x, y = batch(case["size"])
    return lambda: build_model(case["size"]), dict(idx=x), criterion_for(y)


def criterion_for(targets: torch.Tensor) -> Any:
    """The language-model loss of ``targets`` as a function of the logits."""

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    return loss


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _storages(tensors: Iterable[Any]) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = _local(t).untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    return out


def components(model: torch.nn.Module, optimizer: Any, total: int) -> dict[str, int]:
    """``total`` split into params, grads, master, optimizer_state and the rest (``buffers``), by walking the
    live objects; each storage counted once (the first category that holds it)."""
    from stepforge.core import unwrap_optimizer
    from stepforge.zero import LowLevelZeroOptimizer

    zero = isinstance(optimizer, LowLevelZeroOptimizer)
    inner = optimizer if zero else unwrap_optimizer(optimizer)
    layout = inner.layout if zero else None
    stepped = inner.optim if zero else inner
    params = list(model.parameters())
    groups = {
        "params": _storages(params),
        "master": _storages(s.master for s in layout.slots if s.separate_master)
        if layout is not None
        else {},
        "grads": _storages([p.grad for p in params] + ([s.grad for s in layout.slots] if layout else [])),
        "optimizer_state": _storages(v for st in stepped.state.values() for v in st.values()),
    }
    seen: set[int] = set()
    out: dict[str, int] = {}
    for name, storages in groups.items():
        out[name] = sum(n for ptr, n in storages.items() if ptr not in seen)
        seen |= set(storages)
    out["buffers"] = total - sum(out.values())
    return out


def _total(tracker: Any, kind: str = "current") -> int:
    from stepforge.core.torch_compat import tracker_bytes

    return sum(dev.get("Total", 0) for dev in tracker_bytes(tracker, kind).values())


def _booster(case: dict[str, Any]) -> Any:
    from stepforge.strategy import Booster

    precision = CONFIGS[case["config"]]["precision"]
    kwargs = dict(case.get("plugin_kwargs", {}))
    name = case["plugin"]
    if name in ("zero1", "zero2", "torch_fsdp", "gemini"):
        return Booster(plugin=dict(type=name, precision=precision, **kwargs))
    return Booster(
        mixed_precision=None if precision == "fp32" else precision, plugin=dict(type=name, **kwargs)
    )


def run_rank(rank: int, world: int, case: dict[str, Any], port: int, out_dir: str) -> None:
    """Measure ``case`` as ``rank`` of ``world`` gloo ranks and write ``rank<r>.pt`` into ``out_dir``."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    torch.save(measure_rank(case), os.path.join(out_dir, f"rank{rank}.pt"))
    _leave()


def run_cases(rank: int, world: int, cases: list[dict[str, Any]], port: int, out_dir: str) -> None:
    """Measure every case in turn as ``rank`` of ``world`` gloo ranks (one process group for all) and write
    ``rank<r>.pt``: one result per case, ``{"error": message}`` for a case that failed on this rank."""
    import gc

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    results: list[dict[str, Any]] = []
    for case in cases:
        try:
            results.append(measure_rank(case))
        except Exception as exc:  # reported per case: the other cases still run
            results.append(dict(error=f"{type(exc).__name__}: {exc}"))
        gc.collect()
        dist.barrier()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    _leave()


def run_fake_ranks(runs: list[tuple[int, int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Measure each ``(rank, world, case)`` in turn in this process, as that rank on torch's fake process group:
    the collectives move nothing (the values are garbage) but every buffer the plugin allocates for them is real.
    On a GPU machine every simulated rank runs on the one device. One result per run, ``{"error": message}`` for
    a run that failed (the others still run)."""
    import gc

    from stepforge.testing.fake_world import fake_group

    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = "0"
    out: list[dict[str, Any]] = []
    for rank, world, case in runs:
        gc.collect()  # the previous run's cycles freed before this one counts
        with fake_group(rank, world):
            try:
                out.append(measure_rank(case))
            except Exception as exc:  # reported per run, as run_cases does
                out.append(dict(error=f"{type(exc).__name__}: {exc}"))
    return out


def fake_device(requested: str | None) -> str:
    """Where a fake-group run trains: ``requested``, by default CUDA when torch sees a GPU. The plugins place the
    model on ``cuda:LOCAL_RANK`` whenever a GPU is visible, so ``"cpu"`` there (and ``"cuda"`` without one) is
    refused with a ``ValueError`` naming the fix."""
    visible = torch.cuda.is_available()
    device = requested or ("cuda" if visible else "cpu")
    if device == "cuda" and not visible:
        raise ValueError("--device cuda: torch sees no GPU here; use --device cpu")
    if device == "cpu" and visible:
        raise ValueError(
            "--device cpu: torch sees a GPU, where the plugins place the model; hide it with CUDA_VISIBLE_DEVICES=''"
        )
    return device


def estimate_of(
    case: dict[str, Any], world: int, *, rank: int = 0, backend: str | None = None, device: str = "cpu"
) -> dict[str, Any]:
    """``estimate(...)`` of ``case`` as ``rank`` of ``world`` (the model, micro-batch and loss of :func:`workload`;
    the measured group's ``backend``: ZeRO reduces by all-reduce on gloo, by reduce-scatter elsewhere; the
    ``device`` the model trains on): the figures the benches compare, the device's and the host's summed and
    apart."""
    from bench.estimate._goals import COMPONENTS
    from stepforge.strategy import estimate

    build, inputs, loss = workload(dict(case, checkpointing=False))  # the estimate wraps the blocks itself
    config = CONFIGS[case["config"]]
    est = estimate(
        build,
        case["plugin"],
        world_size=world,
        precision=config["precision"],
        optimizer=config["optimizer"],
        inputs=inputs,
        criterion=loss,
        rank=rank,
        device=device,
        backend=backend,
        accumulation_steps=case.get("accumulation", 1),
        activation_checkpointing=case.get("checkpointing", False),
        **case["plugin_kwargs"],
    )
    held = {c: est.device[c] + est.host[c] for c in COMPONENTS}
    return dict(
        device_held=sum(est.device[c] for c in COMPONENTS),
        device_peak=est.peak("device"),
        after_boost=est.after_boost["device"] + est.after_boost["host"],
        window=est.window["device"] + est.window["host"],
        held=held,
        held_total=sum(held.values()),
        activations=est.device["activations"],
        peak=est.peak(None),
        sent_bytes=est.sent_bytes,
        parameters=est.parameters,
        trace=est.activations.method if est.activations is not None else None,
    )


def measure_rank(case: dict[str, Any]) -> dict[str, Any]:
    """Build, boost and train ``case`` for two steps in the initialised process group; what this rank held.
    On a CUDA device ``cuda`` adds ``torch.cuda``'s own counts: allocated after boost and after step 2, and
    ``max_memory_allocated`` over step 2."""
    import warnings

    warnings.filterwarnings("ignore")
    from stepforge.core.torch_compat import memory_tracker
    from stepforge.strategy import get_accelerator

    build, x, loss_of = workload(case)
    # where the plugin computes, not where the parameters live (gemini keeps its shards on the host)
    device = get_accelerator().get_current_device()
    cuda = _CudaCounts(device.type == "cuda")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracker = memory_tracker()
    with tracker:
        model = build()
        booster = _booster(case)
        model, optimizer, *_ = booster.boost(model, dict(CONFIGS[case["config"]]["optimizer"]))
    boosted = _total(tracker)
    cuda.after_boost()
    after_boost = components(model, optimizer, boosted)
    x = {k: v.to(device) for k, v in x.items()}
    steps = case.get("accumulation", 1)
    if steps > 1:
        result = _measure_window(model, optimizer, booster, tracker, x, loss_of, steps, cuda)
        return _finish(dict(after_boost=dict(total=boosted, **after_boost), **result), rss0, cuda)

    with tracker:
        booster.backward(loss_of(model(**x)), optimizer)
        optimizer.step()
        optimizer.zero_grad()
        tracker.reset_mod_stats()
    base = _total(tracker)
    cuda.reset_peak()
    with tracker:  # entering again starts the peak from here: step 2's peak
        loss = loss_of(model(**x))
        forward_end = _total(tracker)
        booster.backward(loss, optimizer)
        del loss
        optimizer.step()
        held = _total(tracker)
        peak = _total(tracker, "peak")
        cuda.after_step()
        after_step = components(model, optimizer, held)
        optimizer.zero_grad()
    result = dict(
        after_boost=dict(total=boosted, **after_boost),
        after_step=dict(total=held, **after_step),
        activations=forward_end - base,
        peak=peak,
    )
    return _finish(result, rss0, cuda)


class _CudaCounts:
    """``torch.cuda``'s allocator counts beside the tracker's, when the plugin computes on CUDA (else nothing), less
    what was allocated before the model was built (an earlier run's leftovers in this process are not this
    rank's)."""

    def __init__(self, on: bool) -> None:
        self.on, self.counts = on, {}
        self.base = torch.cuda.memory_allocated() if on else 0

    def after_boost(self) -> None:
        if self.on:
            self.counts["after_boost"] = torch.cuda.memory_allocated() - self.base

    def reset_peak(self) -> None:
        if self.on:
            torch.cuda.reset_peak_memory_stats()

    def after_step(self) -> None:
        if self.on:
            self.counts.update(
                after_step=torch.cuda.memory_allocated() - self.base,
                peak=torch.cuda.max_memory_allocated() - self.base,
            )


def _finish(result: dict[str, Any], rss0: int, cuda: _CudaCounts) -> dict[str, Any]:
    """Add the peak RSS growth and the CUDA counts."""
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result["rss_growth"] = (rss1 - rss0) * 1024
    if cuda.counts:
        result["cuda"] = dict(cuda.counts)
    return result


def _leave() -> None:
    from bench.common._spawn import leave_process_group

    leave_process_group()


def _measure_window(
    model: Any,
    optimizer: Any,
    booster: Any,
    tracker: Any,
    x: torch.Tensor,
    loss_of: Any,
    steps: int,
    cuda: _CudaCounts,
) -> dict[str, Any]:
    """Two optimizer steps of ``steps`` micro-batches each through ``ColossalAIOptimWrapper`` (the demo's loop);
    step 2 measured: the activations of its first forward, what is held after its first micro-batch's backward
    (``window``, and the bytes in ``.grad`` then), after its ``step()``, and its peak."""
    from stepforge.strategy import ColossalAIOptimWrapper

    wrapper = ColossalAIOptimWrapper(optimizer, booster=booster, accumulative_counts=steps)
    wrapper.initialize_count_status(model, 0, 2 * steps)

    def micro_batch() -> torch.Tensor:
        tracker.reset_mod_stats()  # MemTracker's module statistics take one forward each (its peak stays)
        with wrapper.optim_context(model):
            return loss_of(model(**x))

    with tracker:
        for _ in range(steps):
            wrapper.backward(wrapper.scale_loss(micro_batch()))
        wrapper.step()
        wrapper.zero_grad()
        tracker.reset_mod_stats()
    base = _total(tracker)
    cuda.reset_peak()
    window: dict[str, int] = {}
    with tracker:  # entering again starts the peak from here: step 2's window
        for i in range(steps):
            loss = micro_batch()
            if i == 0:
                forward_end = _total(tracker)
            wrapper.backward(wrapper.scale_loss(loss))
            del loss
            if i == 0:
                grads = _storages(p.grad for p in model.parameters())
                window = dict(total=_total(tracker), param_grads=sum(grads.values()))
        assert wrapper.should_update()
        wrapper.step()
        held = _total(tracker)
        peak = _total(tracker, "peak")
        cuda.after_step()
        after_step = components(model, optimizer, held)
        wrapper.zero_grad()
    return dict(
        after_step=dict(total=held, **after_step),
        window=window,
        activations=forward_end - base,
        peak=peak,
    )
