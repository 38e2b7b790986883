# SPDX-License-Identifier: Apache-2.0
"""The parts of ``bench_compile.py``: parameter lists (GPT-2 small, the demo GPT), the contenders, and one
measured group of contenders (compile time of the first step, steady-state step time timed round-robin, peak
transient memory)."""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[3]

__all__ = [
    "CONTENDERS",
    "Result",
    "demo_shapes",
    "fresh_cache_dir",
    "gpt2_small_shapes",
    "measure_group",
    "tiny_shapes",
    "warm_up_compiler",
]

LR = 1e-3


def gpt2_small_shapes(
    layers: int = 12, d: int = 768, vocab: int = 50257, ctx: int = 1024
) -> list[tuple[int, ...]]:
    """GPT-2 small's parameters (124M, 148 tensors; the output head shares the token embedding)."""
    shapes: list[tuple[int, ...]] = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [
            (d,),
            (d,),
            (d, 3 * d),
            (3 * d,),
            (d, d),
            (d,),
            (d,),
            (d,),
            (d, 4 * d),
            (4 * d,),
            (4 * d, d),
            (d,),
        ]
    return [*shapes, (d,), (d,)]


def demo_shapes() -> list[tuple[int, ...]]:
    """The demo GPT's parameters (``examples/train_gpt_demo.py`` defaults: d_model 96, 3 layers, 4 heads)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt_demo_model import ByteGPT  # type: ignore[import-not-found]

    return [tuple(p.shape) for p in ByteGPT(96, 3, 4, 64).parameters()]


def tiny_shapes() -> list[tuple[int, ...]]:
    """A seconds-long stand-in (CI smoke runs)."""
    return [(64, 32), (32,), (8, 8, 4)]


def _fused() -> Any:
    import stepforge.fused as sf

    return sf


def _optim() -> Any:
    import stepforge.optim as so

    return so


#: name -> (family, factory(params, lr tensor)); family "torch" rows are the baselines
CONTENDERS: dict[str, tuple[str, Callable[[list[torch.Tensor], torch.Tensor], torch.optim.Optimizer]]] = {
    "FusedAdam": ("stepforge", lambda ps, lr: _fused().FusedAdam(ps, lr=lr, weight_decay=0.01)),
    "CPUAdam": ("stepforge", lambda ps, lr: _fused().CPUAdam(ps, lr=lr, weight_decay=0.01)),
    "FusedLAMB": ("stepforge", lambda ps, lr: _fused().FusedLAMB(ps, lr=lr, weight_decay=0.01)),
    "FusedSGD": ("stepforge", lambda ps, lr: _fused().FusedSGD(ps, lr=lr, momentum=0.9)),
    "Lamb": ("stepforge", lambda ps, lr: _optim().Lamb(ps, lr=lr, weight_decay=0.01)),
    "Lars": ("stepforge", lambda ps, lr: _optim().Lars(ps, lr=lr, momentum=0.9, weight_decay=1e-4)),
    # torch refuses a tensor lr for foreach without capturable (CPU has no capturable): a float lr, constant here
    "AdamW(foreach)": (
        "torch",
        lambda ps, lr: torch.optim.AdamW(
            ps, lr=lr if lr.is_cuda else float(lr), weight_decay=0.01, foreach=True, capturable=lr.is_cuda
        ),
    ),
    "AdamW(fused)": ("torch", lambda ps, lr: torch.optim.AdamW(ps, lr=lr, weight_decay=0.01, fused=True)),
}


@dataclass
class Result:
    """One contender on one parameter list, eager or compiled."""

    model: str
    optimizer: str
    family: str
    mode: str  # "eager" or "compiled"
    first_step_s: float = float("nan")  # compiled: dynamo + inductor + the first step; eager: state creation
    samples_ms: list[float] = field(default_factory=list)
    graph_breaks: int = 0
    graphs: int = 0
    fullgraph: bool | None = (
        None  # compiled with fullgraph=True (torch's optimizers break the graph on purpose)
    )
    peak_extra_mb: float = float("nan")  # transient allocation of one steady-state step
    error: str | None = None
    reference_for: str | None = None  # the baseline run timed beside this optimizer (a group's reference)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms) if self.samples_ms else float("nan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_extra_mb(step: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        _sync(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    # the CPU allocator's records (torch profiler memory events): every tensor allocation, inductor's included
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak / 2**20


def fresh_cache_dir() -> str:
    """A new temporary inductor cache directory, removed when the process exits."""
    path = tempfile.mkdtemp(prefix="bench-compile-inductor-")
    atexit.register(shutil.rmtree, path, True)
    return path


def warm_up_compiler(device: torch.device) -> float:
    """Compile and run a trivial function once, so the one-time start-up of dynamo and inductor (imports, the
    C++ toolchain probe) is not charged to the first contender; returns its seconds."""
    t0 = time.perf_counter()
    fn = torch.compile(lambda x: x * 2 + 1, fullgraph=True)
    fn(torch.ones(8, device=device))
    _sync(device)
    torch._dynamo.reset()
    return time.perf_counter() - t0


def _compile_first(
    opt: torch.optim.Optimizer, compile_mode: str | None, result: Result, cold_cache: bool
) -> Callable[[], Any]:
    """Compile ``opt.step`` with fullgraph=True and take the first step; where dynamo refuses the full graph
    (torch.optim's step breaks it on purpose around the update, ``_use_grad_for_differentiable``), compile it
    without fullgraph, as torch's compiled-optimizer recipe does (the time of the refused attempt is included)."""
    from torch._dynamo.exc import Unsupported
    from torch._dynamo.utils import counters

    if cold_cache:
        # a fresh on-disk inductor cache: identical kernels compiled for an earlier contender are not reused
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = fresh_cache_dir()
    for fullgraph in (True, False):
        counters.clear()
        step = torch.compile(opt.step, fullgraph=fullgraph, mode=compile_mode)
        try:
            step()
        except Unsupported:
            if not fullgraph:
                raise
            continue
        result.fullgraph = fullgraph
        result.graph_breaks = sum(counters["graph_break"].values())
        result.graphs = int(counters["stats"]["unique_graphs"])
        return step
    raise AssertionError("unreachable")


def measure_group(
    results: list[Result],
    params: list[torch.Tensor],
    *,
    device: torch.device,
    warmup: int,
    repeats: int,
    compile_mode: str | None,
    cold_cache: bool = True,
) -> list[Result]:
    """Build every contender of ``results`` on ``params`` (grads already set; each optimizer has its own state),
    time each one's first step (compiling it for ``mode == "compiled"``), then time them round-robin (A, B, C, A,
    B, C, ...) for ``repeats`` steady-state steps after ``warmup``: the drift of a shared machine hits the
    contenders of a group alike, so ratios within a group are the numbers to trust."""
    torch._dynamo.reset()
    steps: list[Callable[[], Any] | None] = []
    opts = []
    for result in results:
        opt = CONTENDERS[result.optimizer][1](params, torch.tensor(LR, device=device))
        opts.append(opt)
        step: Callable[[], Any] | None = opt.step
        try:
            t0 = time.perf_counter()
            if result.mode == "compiled":
                step = _compile_first(opt, compile_mode, result, cold_cache)
            else:
                opt.step()
            _sync(device)
            result.first_step_s = time.perf_counter() - t0
        except Exception as exc:  # a contender that cannot compile is reported, not fatal
            result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            step = None
        steps.append(step)
    live = [(r, s) for r, s in zip(results, steps, strict=True) if s is not None]
    for _ in range(warmup):
        for _r, step in live:
            step()
    _sync(device)
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            for result, step in live:
                t0 = time.perf_counter_ns()
                step()
                _sync(device)
                result.samples_ms.append((time.perf_counter_ns() - t0) / 1e6)
    finally:
        gc.enable()
    for result, step in live:
        result.peak_extra_mb = _peak_extra_mb(step, device)
    del opts, steps, live
    torch._dynamo.reset()
    gc.collect()
    return results
