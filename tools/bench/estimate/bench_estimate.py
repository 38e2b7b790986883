# SPDX-License-Identifier: Apache-2.0
"""How accurate ``stepforge.strategy.estimate`` is: every plugin x precision x optimizer at 1, 2 and 4 gloo ranks
on a byte-level GPT of about 32 M parameters, estimate against measurement, beside DeepSpeed's formulas.

Each case is measured by ``_measure.run_rank`` on every rank (torch's ``MemTracker`` over every
allocation from building the model on; rank 0 is compared, the rank the estimate describes): the total held after
``boost``, after step 2's ``optimizer.step()`` (split into parameters, gradients, fp32 masters, optimizer state
and the rest, ``buffers``), what step 2's forward keeps (activations), the peak over step 2, and peak RSS growth.
The estimate of the same configuration is made in this process from a meta model (``estimate(...)`` with the
micro-batch and the loss as the criterion). On a CPU device the device and the host are one memory: totals
compare device + host, the peak the estimate's peak of both together.

With ``--accumulation N`` every optimizer step takes N micro-batches through ``ColossalAIOptimWrapper`` as the GPT
demo runs them (``--demo`` uses the demo's 4): the estimate plans the window (``accumulation_steps=N``), the
peak is step 2's window, and what a rank holds between the window's micro-batches is compared too (``window``).

Goals: every total (after boost, held after the step, peak, between micro-batches) within 10% of the measurement,
every component
within 15% (components under 1% of the held total are reported, not judged: a 2 KiB torch-internal tensor);
closer than DeepSpeed's formula wherever that applies: ``estimate_zero2_model_states_mem_needs`` (zero2 with
and without CPU offload) and ``estimate_zero3_model_states_mem_needs`` (torch_fsdp, gemini) for AdamW with
16-bit parameters (``runtime/zero/stage_1_and_2.py``, ``stage3.py``), compared with the held total.

    python tools/bench/estimate/bench_estimate.py                     # -> bench-out/cpu-<date>-estimate.json/.png
    python tools/bench/estimate/bench_estimate.py --plugins zero2 --worlds 2 --configs adamw-bf16
    python tools/bench/estimate/bench_estimate.py --accumulation 4 --worlds 1 2 --configs adamw-bf16
    python tools/bench/estimate/bench_estimate.py --demo              # zero2, bf16, CPUAdam, accumulation 4
    python tools/bench/estimate/bench_estimate.py --fake-worlds 8 64 256 1024   # -> <device>-<date>-estimate-fake-worlds.*
    python tools/bench/estimate/bench_estimate.py --tiny --out /tmp/x # seconds (CI keeps it working)

``--fake-worlds`` measures rank 0 and the last rank of each world on torch's fake process group instead, one
process per plugin playing every world in turn, on the CPU or (``--device cuda``) on the one GPU, where
``torch.cuda.max_memory_allocated`` over step 2 is compared with the estimate's device peak too
(``cuda_ratios``). Nothing is reduced or gathered there: the values are garbage, the buffers real.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the `bench` package

from bench.common import _machine, _report
from bench.common._spawn import free_port
from bench.estimate import _measure as measure
from bench.estimate._goals import cuda_judge, cuda_summary, deepspeed_bytes, judge, plot, summary

__all__ = ["main"]

#: what `nox -s bench_smoke` runs (tools/bench/smoke.py): seconds, every code path, no timing judged
SMOKE_ARGS = ("--tiny", "--no-plot", "--out", "{out}")

SIZE = dict(d_model=512, layers=10, heads=8, seq_len=128, micro_batch=4)
TINY = dict(d_model=32, layers=1, heads=2, seq_len=16, micro_batch=2)
#: examples/train_gpt_demo.py's default model and micro-batch (--demo)
DEMO = dict(d_model=96, layers=3, heads=4, seq_len=64, micro_batch=8)
#: examples/train_gpt_demo.py's default accumulative_counts (--demo)
DEMO_ACCUMULATION = 4
#: plugin label -> (registry name, plugin arguments)
PLUGINS: dict[str, tuple[str, dict[str, Any]]] = {
    "single": ("single", {}),
    "torch_ddp": ("torch_ddp", {}),
    "zero1": ("zero1", {}),
    "zero2": ("zero2", {}),
    "zero2-offload": ("zero2", {"cpu_offload": True}),
    "torch_fsdp": ("torch_fsdp", {}),
    "gemini": ("gemini", {}),
}


def _measure(case: dict[str, Any], world: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="bench-estimate-") as out:
        mp.start_processes(
            measure.run_rank, args=(world, case, free_port(), out), nprocs=world, start_method="spawn"
        )
        return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]


#: the plugins of a --fake-worlds run: the sharded ones (DDP's memory does not depend on the world, and its reducer
#: cannot run on the fake group: torch's comm hook asserts on the fake all-reduce's empty result)
FAKE_PLUGINS = ("zero1", "zero2", "zero2-offload", "torch_fsdp", "gemini")


def run_fake_plugin(
    label: str, configs: list[str], worlds: list[int], size: dict[str, int], accumulation: int, device: str
) -> list[dict[str, Any]]:
    """Rank 0 and rank ``N - 1`` of every world on the fake process group, measured in one process, beside the
    estimate of that rank."""
    from stepforge.testing.fake_world import run_isolated

    name, kwargs = PLUGINS[label]
    runs = [
        (
            rank,
            world,
            dict(plugin=name, plugin_kwargs=kwargs, config=config, size=size, accumulation=accumulation),
        )
        for config in configs
        for world in worlds
        for rank in dict.fromkeys((0, world - 1))
    ]
    start = time.perf_counter()
    measured = run_isolated(measure.run_fake_ranks, runs, timeout=3600)
    wall = (time.perf_counter() - start) / len(runs)
    model = measure.build_model(size)  # DeepSpeed's ZeRO-3 formula reads its largest layer
    rows = []
    for (rank, world, case), result in zip(runs, measured, strict=True):
        if "error" in result:
            raise RuntimeError(f"{label} {case['config']} rank {rank} of {world}: {result['error']}")
        est = measure.estimate_of(case, world, rank=rank, backend="fake", device=device)
        row = dict(
            plugin=label,
            config=case["config"],
            world=world,
            rank=rank,
            accumulation=accumulation,
            estimate=est,
            measured=result,
            wall_s=round(wall, 1),
        )
        row["deepspeed"] = deepspeed_bytes(label, case["config"], world, est["parameters"], model)
        row.update(judge(row))
        row.update(
            cuda_judge(est, result)
        )  # the allocator's own counts against the estimate's device figures
        rows.append(row)
    return rows


def run_case(
    label: str, config: str, world: int, size: dict[str, int], accumulation: int = 1
) -> dict[str, Any]:
    """Measure and estimate one configuration; the ratios and the DeepSpeed comparison."""
    name, kwargs = PLUGINS[label]
    case = dict(plugin=name, plugin_kwargs=kwargs, config=config, size=size, accumulation=accumulation)
    start = time.perf_counter()
    ranks = _measure(case, world)
    est = measure.estimate_of(case, world)
    row = dict(
        plugin=label,
        config=config,
        world=world,
        accumulation=accumulation,
        estimate=est,
        measured=ranks[0],
        measured_max_total=max(r["after_step"]["total"] for r in ranks),
        wall_s=round(time.perf_counter() - start, 1),
    )
    row["deepspeed"] = deepspeed_bytes(label, config, world, est["parameters"], measure.build_model(size))
    row.update(judge(row))
    return row


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-out")
    p.add_argument("--plugins", nargs="+", default=list(PLUGINS), choices=list(PLUGINS))
    p.add_argument(
        "--configs", nargs="+", default=list(measure.DEFAULT_CONFIGS), choices=list(measure.CONFIGS)
    )
    p.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument(
        "--tiny", action="store_true", help="a tiny GPT, two plugins at 1 and 2 ranks, accumulation 1 and 2"
    )
    p.add_argument(
        "--demo",
        action="store_true",
        help="the GPT demo's default model, zero2 + bf16 + CPUAdam at 2 ranks, accumulation 4",
    )
    p.add_argument(
        "--accumulation",
        nargs="+",
        type=int,
        default=None,
        help="micro-batches per optimizer step, one run each (default 1; --demo: 4; --tiny: 1 and 2)",
    )
    p.add_argument(
        "--fake-worlds",
        nargs="+",
        type=int,
        default=None,
        help="measure rank 0 and the last rank of these worlds on the fake process group (plugins: "
        + ", ".join(FAKE_PLUGINS)
        + "; --configs default adamw-bf16)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="--fake-worlds only: where the model trains (default: cuda when torch sees a GPU)",
    )
    p.add_argument("--stem", default=None, help="--fake-worlds only: the output's file name without suffix")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    if args.device is not None:
        try:
            args.device = measure.fake_device(args.device)
        except ValueError as exc:
            p.error(str(exc))
    return args


def main_fake_worlds(args: argparse.Namespace, size: dict[str, int], plugins: list[str]) -> Path:
    """The ``--fake-worlds`` run: every plugin's rows, the summary, JSON and PNG."""
    device = measure.fake_device(args.device)
    configs = args.configs if args.configs != list(measure.DEFAULT_CONFIGS) else ["adamw-bf16"]
    accumulation = (args.accumulation or [1])[0]
    machine = _machine.machine_info(threads=1)
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    parameters = sum(p.numel() for p in measure.build_model(size).parameters())
    stem = args.stem or f"{device}-{machine['date_utc'][:10]}-estimate-fake-worlds" + (
        "-tiny" if args.tiny else ""
    )

    def save() -> dict[
        str, Any
    ]:  # after every plugin: a run stopped at its time limit keeps what it measured
        payload = dict(
            benchmark="estimate on the fake process group",
            machine=machine,
            device=device,
            wall_s=round(time.perf_counter() - start, 1),
            model=dict(size, parameters=parameters, kind="ByteGPT (examples)"),
            accumulation=[accumulation],
            configs={c: measure.CONFIGS[c] for c in configs},
            cases=rows,
            summary=summary(rows),
        )
        if cuda_rows := cuda_summary(rows):
            payload["summary"]["cuda"] = cuda_rows
        _report.save_json(Path(args.out) / f"{stem}.json", payload)
        return payload

    for label in plugins:
        for row in run_fake_plugin(label, configs, args.fake_worlds, size, accumulation, device):
            rows.append(row)
            r, cuda = row["ratios"], row.get("cuda_ratios")
            on_device = f"  cuda held {cuda['held']:.3f} peak {cuda['peak']:.3f}" if cuda else ""
            print(
                f"{label:14s} {row['config']:11s} rank {row['rank']:4d} of {row['world']:4d}  held "
                f"{r['held_total']:.3f}  boost {r['after_boost']:.3f}  peak {r['peak']:.3f}  acts "
                f"{r['activations']:.3f}{on_device}",
                flush=True,
            )
        payload = save()
    path = Path(args.out) / f"{stem}.json"
    if not args.no_plot:
        plot(
            Path(args.out) / f"{stem}.png",
            rows,
            title=f"estimate / measured, rank 0 and N-1 of N fake ranks, "
            f"{payload['model']['parameters'] / 1e6:.1f} M-param GPT on {device} ({machine['device']})",
        )
    _print_summary(payload)
    return path


def _print_summary(payload: dict[str, Any]) -> None:
    for line in payload["summary"]["rows"]:
        print(
            f"  {line['quantity']:28s} {line['min']:.3f}-{line['max']:.3f}  within ±{line['goal'] * 100:.0f}%: {line['within']}/{line['cases']}"
        )
    print("  " + payload["summary"]["deepspeed"])
    for key, line in payload["summary"].get("cuda", {}).items():
        print(
            f"  torch.cuda {key:4s} (device)        {line['min']:.3f}-{line['max']:.3f}  within "
            f"±{line['goal'] * 100:.0f}%: {line['within']}/{line['cases']}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    size = TINY if args.tiny else DEMO if args.demo else SIZE
    if args.fake_worlds:
        plugins = args.plugins if args.plugins != list(PLUGINS) else list(FAKE_PLUGINS)
        print(f"{len(plugins)} plugins -> {main_fake_worlds(args, size, plugins)}")
        return 0
    if args.tiny:
        args.plugins, args.configs, args.worlds = ["single", "zero2"], ["adamw-bf16"], [1, 2]
    if args.demo:
        args.plugins, args.configs, args.worlds = ["zero2"], ["cpuadam-bf16"], [2]
    default = [DEMO_ACCUMULATION] if args.demo else [1, 2] if args.tiny else [1]
    accumulations = args.accumulation or default
    if min(accumulations) < 1:
        raise SystemExit(f"--accumulation must be >= 1, got {accumulations}")
    machine = _machine.machine_info(threads=1)
    start = time.perf_counter()
    rows = []
    cases = [
        (label, config, world, steps)
        for label in args.plugins
        for config in args.configs
        for world in args.worlds
        for steps in accumulations
        if label != "single" or world == 1
    ]
    for label, config, world, steps in cases:
        row = run_case(label, config, world, size, steps)
        rows.append(row)
        r = row["ratios"]
        window = f"  window {r['window']:.3f}" if r.get("window") is not None else ""
        print(
            f"{label:14s} {config:11s} N={world} accum {steps}  held {r['held_total']:.3f}  boost "
            f"{r['after_boost']:.3f}  peak {r['peak']:.3f}{window}  acts {r['activations']:.3f}  "
            f"({row['wall_s']:.0f} s)",
            flush=True,
        )
    wall = time.perf_counter() - start
    model = measure.build_model(size)
    payload = dict(
        benchmark="estimate",
        machine=machine,
        wall_s=round(wall, 1),
        model=dict(size, parameters=sum(p.numel() for p in model.parameters()), kind="ByteGPT (examples)"),
        accumulation=accumulations,
        configs={c: measure.CONFIGS[c] for c in args.configs},
        cases=rows,
        summary=summary(rows),
    )
    stem = (
        f"cpu-{machine['date_utc'][:10]}-estimate"
        + ("-tiny" if args.tiny else "-demo" if args.demo else "")
        + (f"-accum{'-'.join(map(str, accumulations))}" if max(accumulations) > 1 and not args.tiny else "")
    )
    path = _report.save_json(Path(args.out) / f"{stem}.json", payload)
    if not args.no_plot:
        plot(
            Path(args.out) / f"{stem}.png",
            rows,
            title=f"estimate / measured, {payload['model']['parameters'] / 1e6:.1f} M-param GPT, gloo ranks on {machine['device']}"
            + (
                f", {'/'.join(map(str, accumulations))} micro-batches per step"
                if max(accumulations) > 1
                else ""
            ),
        )
    print(f"{len(rows)} cases in {wall:.0f} s -> {path}")
    _print_summary(payload)
    if args.tiny:  # the fake-group path too: rank 0 and 7 of 8
        args.fake_worlds = [8]
        main_fake_worlds(args, size, ["zero2", "torch_fsdp"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
