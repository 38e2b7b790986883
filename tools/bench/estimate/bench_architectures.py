# SPDX-License-Identifier: Apache-2.0
"""How accurate ``stepforge.strategy.estimate`` is on models it was not tuned on: transformers' GPT-2 (tied head),
Llama (grouped-query attention, RMSNorm), BERT (masked LM, padded attention mask), T5 (encoder-decoder), Mixtral
(mixture of experts, value-dependent routing), ViT and the project's GPT, built from small configs
(``_architectures.py``), each trained two steps with every plugin at 1, 2 and 4 gloo ranks, and with activation
checkpointing (transformers' ``gradient_checkpointing_enable()``; ByteGPT's blocks in torch's
``checkpoint_wrapper``) for ``zero2`` and ``torch_fsdp`` at 2 ranks.

Each world is one spawned gloo group whose ranks measure every case in turn (``_measure.run_cases``: torch's
``MemTracker`` over every allocation from building the model on: the total after ``boost``, held after step 2,
step 2's forward and its peak); rank 0 is compared with ``estimate(...)`` of the same configuration made here
from the same model builder, micro-batch and loss, on a CPU device where device and host are one memory (the
peak compared is the estimate's peak of both together). The estimate says how it traced the activations
(``trace``: ``fake`` tensors, or ``real`` CPU tensors where the forward reads values, as Mixtral's routing does).

``--fake`` measures rank 0 (``--last-rank``: and rank N-1) of each world on torch's fake process group instead,
one process per world, on the CPU or (``--device cuda``, the default where torch sees a GPU) on the one GPU: the
estimate is then made for a CUDA device and the fake group's backend, and its device figures are also compared
with ``torch.cuda``'s own counts (``cuda_ratios``: device held / ``memory_allocated`` after step 2, device peak /
``max_memory_allocated`` over it; goal ±10%, issue #43's), as ``bench_estimate.py --fake-worlds`` does.

Goal: every peak and every total held within ±5% of the measurement.

    python tools/bench/estimate/bench_architectures.py            # -> bench-out/cpu-<date>-estimate-architectures.*
    python tools/bench/estimate/bench_architectures.py --archs gpt2 llama-gqa --plugins torch_fsdp --worlds 2
    python tools/bench/estimate/bench_architectures.py --tiny --out /tmp/x   # seconds: 2 models, 2 plugins, 2 ranks
    python tools/bench/estimate/bench_architectures.py --merge a.json b.json --out d  # one result of several runs
    python tools/bench/estimate/bench_architectures.py --fake --device cuda --worlds 8 1024 --last-rank  # on a GPU
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
from bench.estimate import _architectures as arch
from bench.estimate import _measure as measure
from bench.estimate._goals import TOTAL_GOAL, cuda_judge, cuda_summary

__all__ = ["main", "run_world", "run_fake_world", "GOAL"]

#: what `nox -s bench_smoke` would run: seconds, every code path
SMOKE_ARGS = ("--tiny", "--no-plot", "--out", "{out}")
#: every ratio's goal
GOAL = 0.05
#: plugin label -> (registry name, plugin arguments, configuration measured: the issue's table's)
PLUGINS: dict[str, tuple[str, dict[str, Any], str]] = {
    "single": ("single", {}, "adamw-fp32"),
    "torch_ddp": ("torch_ddp", {}, "adamw-fp32"),
    "zero1": ("zero1", {}, "sgd-fp32"),
    "zero2": ("zero2", {}, "adamw-bf16"),
    "zero2-offload": ("zero2", {"cpu_offload": True}, "adamw-bf16"),
    "torch_fsdp": ("torch_fsdp", {}, "adamw-fp32"),
    "gemini": ("gemini", {}, "adamw-bf16"),
}
#: the plugins also measured with activation checkpointing
CHECKPOINTED = ("zero2", "torch_fsdp")


def cases_for(archs: list[str], plugins: list[str], world: int, checkpointing: bool) -> list[dict[str, Any]]:
    """The cases one world measures, in order."""
    out = []
    for name in archs:
        for label in plugins:
            if label == "single" and world > 1:
                continue
            plugin, kwargs, config = PLUGINS[label]
            for ckpt in (False, True) if checkpointing and label in CHECKPOINTED else (False,):
                out.append(
                    dict(arch=name, label=label, plugin=plugin, plugin_kwargs=kwargs, config=config,
                         accumulation=1, checkpointing=ckpt)
                )  # fmt: skip
    return out


def run_world(cases: list[dict[str, Any]], world: int) -> list[dict[str, Any]]:
    """Every case measured by one group of ``world`` gloo ranks: rank 0's results."""
    with tempfile.TemporaryDirectory(prefix="bench-architectures-") as out:
        mp.start_processes(
            measure.run_cases, args=(world, cases, free_port(), out), nprocs=world, start_method="spawn"
        )
        return torch.load(os.path.join(out, "rank0.pt"))


def run_fake_world(runs: list[tuple[int, dict[str, Any]]], world: int) -> list[dict[str, Any]]:
    """Every ``(rank, case)`` measured as that rank of ``world`` on torch's fake process group, in one fresh
    process: every buffer the plugin allocates is real, the collectives move nothing (``--fake``; not DDP, whose
    reducer cannot run there)."""
    from stepforge.testing.fake_world import run_isolated

    return run_isolated(measure.run_fake_ranks, [(rank, world, case) for rank, case in runs], timeout=3600)


def judge(est: dict[str, Any], meas: dict[str, Any]) -> dict[str, Any]:
    """Ratios estimate / measured and whether each is within :data:`GOAL`."""
    ratios = dict(
        peak=est["peak"] / meas["peak"],
        held_total=est["held_total"] / meas["after_step"]["total"],
        after_boost=est["after_boost"] / meas["after_boost"]["total"],
        activations=est["activations"] / meas["activations"] if meas["activations"] else None,
    )
    return dict(ratios=ratios, within=all(abs(ratios[k] - 1) <= GOAL for k in ("peak", "held_total")))


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per architecture: the peak ratios' range, cases within the goal, the trace method; on CUDA also the
    device figures against ``torch.cuda``'s (``cuda``: held and peak, judged against ±10%)."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(r["arch"] for r in rows):
        mine = [r for r in rows if r["arch"] == name and "ratios" in r]
        if not mine:
            continue
        peaks = [r["ratios"]["peak"] for r in mine]
        held = [r["ratios"]["held_total"] for r in mine]
        out[name] = dict(
            cases=len(mine),
            within=sum(r["within"] for r in mine),
            peak_min=min(peaks),
            peak_max=max(peaks),
            held_min=min(held),
            held_max=max(held),
            trace=sorted({r["estimate"]["trace"] for r in mine}),
            parameters=mine[0]["estimate"]["parameters"],
        )
        if cuda := cuda_summary(mine):
            out[name]["cuda"] = cuda
    return out


def plot(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    """Peak ratio per case, one row per architecture, one marker per plugin (checkpointed: hollow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    archs = list(dict.fromkeys(r["arch"] for r in rows))
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(archs) + 2))
    markers = dict(zip(PLUGINS, "os^vDPX", strict=True))
    offsets = {1: -0.2, 2: 0.0, 4: 0.2}
    seen = set()
    for r in rows:
        if "ratios" not in r:
            continue
        y = archs.index(r["arch"]) + offsets.get(r["world"], 0)
        label = r["plugin"] if r["plugin"] not in seen else None
        seen.add(r["plugin"])
        color = f"C{list(PLUGINS).index(r['plugin'])}"
        face = "none" if r["checkpointing"] else color
        ax.scatter(r["ratios"]["peak"], y, marker=markers[r["plugin"]], facecolors=face, edgecolors=color,
                   label=label, s=30)  # fmt: skip
    ax.axvspan(1 - GOAL, 1 + GOAL, color="tab:green", alpha=0.12)
    ax.set_yticks(range(len(archs)), archs)
    ax.invert_yaxis()
    ax.set_xlabel("estimated peak / measured peak (band ±5%; per row 1, 2, 4 ranks top to bottom; hollow: "
                  "activation checkpointing)")  # fmt: skip
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(
    args: argparse.Namespace, machine: dict[str, Any], rows: list[dict[str, Any]], wall_s: float
) -> dict[str, Any]:
    """The result file: the configurations, every row, the summary (with ``torch.cuda``'s where measured)."""
    judged = [r for r in rows if "ratios" in r]
    summary = dict(
        cases=len(rows),
        judged=len(judged),
        within=sum(r["within"] for r in judged),
        errors=sum(1 for r in rows if "error" in r),
        architectures=summarise(rows),
    )
    if cuda := cuda_summary(judged):
        summary["cuda"] = cuda
    return dict(
        benchmark="estimate across architectures",
        machine=machine,
        device=args.device,
        wall_s=wall_s,
        goal=GOAL,
        cuda_goal=TOTAL_GOAL,
        models={name: dict(micro_batch=arch.BATCH, seq_len=arch.SEQ) for name in args.archs},
        configs={
            label: dict(plugin=p, plugin_kwargs=k, config=c, **measure.CONFIGS[c])
            for label, (p, k, c) in PLUGINS.items()
            if label in args.plugins
        },
        cases=rows,
        summary=summary,
    )


def _load(path: str) -> dict[str, Any]:
    import json

    with open(path) as f:
        loaded: dict[str, Any] = json.load(f)
    return loaded


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-out")
    p.add_argument("--archs", nargs="+", default=list(arch.ARCHITECTURES), choices=list(arch.ARCHITECTURES))
    p.add_argument("--plugins", nargs="+", default=list(PLUGINS), choices=list(PLUGINS))
    p.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--no-checkpointing", action="store_true", help="leave out the checkpointed cases")
    p.add_argument("--tiny", action="store_true", help=f"{', '.join(arch.TINY_ARCHITECTURES)}; zero2, "
                   "torch_fsdp; 2 ranks")  # fmt: skip
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--fake", action="store_true", help="measure on the fake process group in one process")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="--fake only: where the models train (default: cuda when torch sees a GPU); on cuda "
                   "torch.cuda's counts are compared with the estimate's device figures too")  # fmt: skip
    p.add_argument("--last-rank", action="store_true", help="--fake only: rank N-1 of each world too")
    p.add_argument("--stem", default=None, help="the output's file name without suffix")
    p.add_argument("--merge", nargs="+", default=None, help="combine these result files into one (no runs)")
    p.add_argument("--reestimate", action="store_true", help="with --merge: make the estimates again")
    args = p.parse_args(argv)
    for given, option in ((args.device is not None, "--device"), (args.last_rank, "--last-rank")):
        if given and not args.fake:
            p.error(
                f"{option} needs --fake (gloo ranks train where the plugins place them, and rank 0 is compared)"
            )
    if args.fake:
        try:
            args.device = measure.fake_device(args.device)
        except ValueError as exc:
            p.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.tiny:
        args.archs, args.plugins, args.worlds = list(arch.TINY_ARCHITECTURES), ["zero2", "torch_fsdp"], [2]
    machine = _machine.machine_info(threads=1)
    start = time.perf_counter()
    rows = []
    if args.merge:
        parts = [_load(p) for p in args.merge]
        rows = [dict({"group": "gloo"}, **row) for part in parts for row in part["cases"]]
        if args.reestimate:  # the measurements kept, the estimates made again by this revision
            for row in rows:
                if "error" not in row:
                    plugin, kwargs, config = PLUGINS[row["plugin"]]
                    case = dict(arch=row["arch"], plugin=plugin, plugin_kwargs=kwargs, config=config,
                                checkpointing=row["checkpointing"])  # fmt: skip
                    row["estimate"] = measure.estimate_of(case, row["world"], rank=row.get("rank", 0),
                                                          backend=row["group"], device=row.get("device", "cpu"))  # fmt: skip
                    row.update(
                        judge(row["estimate"], row["measured"]),
                        **cuda_judge(row["estimate"], row["measured"]),
                    )
        args.archs = list(dict.fromkeys(r["arch"] for r in rows))
        args.plugins = list(dict.fromkeys(r["plugin"] for r in rows))
        machine = parts[0]["machine"]
        args.worlds = []
    merged_wall = sum(_load(p)["wall_s"] for p in args.merge) if args.merge else 0.0
    stem = args.stem or f"{args.device or 'cpu'}-{machine['date_utc'][:10]}-estimate-architectures" + (
        "-tiny" if args.tiny else ""
    )
    path = Path(args.out) / f"{stem}.json"
    for world in args.worlds:
        cases = cases_for(args.archs, args.plugins, world, not args.no_checkpointing and world == 2)
        runs = [
            (rank, case)
            for case in cases
            for rank in dict.fromkeys((0, world - 1) if args.last_rank else (0,))
        ]
        t0 = time.perf_counter()
        measured = run_fake_world(runs, world) if args.fake else run_world(cases, world)
        print(f"N={world}: {len(runs)} cases measured in {time.perf_counter() - t0:.0f} s", flush=True)
        for (rank, case), meas in zip(runs, measured, strict=True):
            row = dict(arch=case["arch"], plugin=case["label"], config=case["config"], world=world, rank=rank,
                       checkpointing=case["checkpointing"], measured=meas, group="fake" if args.fake else "gloo",
                       device=args.device or "cpu")  # fmt: skip
            if "error" in meas:
                row["error"] = meas["error"]
            else:
                row["estimate"] = measure.estimate_of(case, world, rank=rank, backend=row["group"],
                                                      device=row["device"])  # fmt: skip
                row.update(judge(row["estimate"], meas), **cuda_judge(row["estimate"], meas))
            rows.append(row)
            r, cuda = row.get("ratios"), row.get("cuda_ratios")
            text = (
                f"peak {r['peak']:.3f} held {r['held_total']:.3f} trace {row['estimate']['trace']}"
                if r
                else f"ERROR {row['error'][:100]}"
            )
            if cuda:
                text += f"  cuda held {cuda['held'] or 0:.3f} peak {cuda['peak'] or 0:.3f}"
            print(f"  {case['arch']:12s} {case['label']:14s} N={world}{f' r{rank}' if rank else ''} "
                  f"ckpt={int(case['checkpointing'])} {text}", flush=True)  # fmt: skip
        # after every world: a run stopped at its time limit keeps the worlds it finished
        _report.save_json(path, report(args, machine, rows, round(time.perf_counter() - start, 1)))
    payload = report(args, machine, rows, merged_wall or round(time.perf_counter() - start, 1))
    path = _report.save_json(path, payload)
    if not args.no_plot:
        plot(path.with_suffix(".png"), rows,
             f"estimated / measured peak per rank (gloo or fake-group ranks) on {machine['device']}")  # fmt: skip
    s = payload["summary"]
    print(f"{s['within']}/{s['judged']} within ±{GOAL:.0%} ({s['errors']} errors) -> {path}")
    for name, line in s["architectures"].items():
        cuda = line.get("cuda", {})
        on_device = "".join(
            f"  cuda {key} {c['min']:.3f}-{c['max']:.3f} within ±{c['goal']:.0%} {c['within']}/{c['cases']}"
            for key, c in cuda.items()
        )
        print(f"  {name:12s} peak {line['peak_min']:.3f}-{line['peak_max']:.3f} held {line['held_min']:.3f}-"
              f"{line['held_max']:.3f} within {line['within']}/{line['cases']} trace {line['trace']}{on_device}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
