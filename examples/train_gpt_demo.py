# SPDX-License-Identifier: Apache-2.0
"""The main job: a small GPT-style byte-level language model trained on 2 processes with stepforge.

    python examples/train_gpt_demo.py                    # what `nox -s demo` runs: 2 ranks, ~3 min on 2 cores
    python examples/train_gpt_demo.py --plugin torch_ddp --precision fp32 --nproc 2 --steps 40
    python examples/train_gpt_demo.py --smoke            # a few steps of a tiny model (the CI test)
    python examples/train_gpt_demo.py --device cuda --nproc 1   # on a GPU: NCCL, FusedAdam, tokens/s on cuda

The text is the Python standard library's own source (``*.py`` under ``sysconfig.get_paths()["stdlib"]``), read
as bytes: present on every machine with Python, no download. The model (``gpt_demo_model.py``) is a pre-norm
decoder-only transformer over the 256 byte values. Training goes through ``stepforge.strategy.Strategy``: plugin
``zero2`` (stepforge-zero's ZeRO-2) when installed, else ``torch_fsdp`` (the summary says which, and why), ``bf16``
mixed precision, ``CPUAdam`` from stepforge-fused, ``accumulative_counts=4``, a linear warm-up then cosine schedule.

Two launches, each in NEW processes started with ``torchrun``: on gloo with ``--device cpu`` (the default; the
workers see no GPU), on NCCL with ``--device cuda`` (one GPU per rank, the batches moved to it, ``FusedAdam`` unless
``--optimizer`` says otherwise, torch's deterministic algorithms on so the resume can be bitwise):

1. the uninterrupted run trains every step; at ``--save-at`` it writes a checkpoint (a crash-safe DCP directory)
   and goes on to the end without stopping;
2. the resumed run starts from nothing, resumes from ``work_dir/last_checkpoint`` (model, optimizer shards,
   schedulers, accumulation counters, every rank's RNG) and trains to the end.

Micro-batch ``i`` of rank ``r`` is drawn from a generator seeded by ``(seed, i, r)``, so the data position is the
iteration counter that the checkpoint restores. The report (``gpt_demo_report.py``) compares the two runs step by
step: for plugins with a documented bit-identical resume the largest difference must be 0.

Output: a progress bar (rank 0), ``<out>/gpt_demo_loss.png`` (both runs overlaid, in bits per byte),
``<out>/gpt_demo.json`` and a one-screen summary: plugin, precision, optimizer, world size, stepforge-fused's CPU
ISA path, the resume difference, bits per byte beside the unigram baseline and the uniform 8 bits, tokens/s,
optimizer-step time, memory per rank, CPU time and a sample of generated text. Exit status 1 when the resume
misses its bound.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpt_demo_model import BITS_PER_NAT, ByteGPT, generate, load_corpus, sample_batch, unigram_bits_per_byte
from gpt_demo_report import compare_runs, plot_losses, print_summary, write_summary
from torch import nn

#: --device -> the process-group backend of its workers
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
WORKER_ARGV_ENV = "STEPFORGE_DEMO_WORKER_ARGV"  # the demo options, as a JSON list, for the torchrun workers


# -- one run, on every rank ---------------------------------------------------------------------------------
def _local_bytes(tree: Any) -> int:
    """Bytes this rank holds for the tensors in ``tree`` (DTensor/ShardedTensor: the local shards only)."""
    if isinstance(tree, dict):
        return sum(_local_bytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(_local_bytes(v) for v in tree)
    if hasattr(tree, "local_shards"):
        return sum(_local_bytes(s.tensor) for s in tree.local_shards())
    if hasattr(tree, "to_local"):
        tree = tree.to_local()
    return tree.numel() * tree.element_size() if torch.is_tensor(tree) else 0


def _isa_path() -> str:
    """stepforge-fused's active CPU kernel path, from its public ``cpu_features()`` (in the worker: its threads)."""
    try:
        from stepforge.fused import cpu_features
    except ImportError:
        return "n/a (stepforge-fused not installed)"
    info = cpu_features()
    forced = f", forced by STEPFORGE_CPU_ISA={info['forced_by_env']}" if info.get("forced_by_env") else ""
    return (
        f"{info['isa']} (supported {'/'.join(info['supported'])}; {info['num_threads']} threads/rank{forced})"
    )


@torch.no_grad()
def _val_loss(
    model: nn.Module,
    val_data: torch.Tensor,
    args: argparse.Namespace,
    rank: int,
    world: int,
    device: torch.device,
) -> float:
    model.eval()
    val = []
    for i in range(args.val_batches):
        x, y = sample_batch(val_data, args.seq_len, args.micro_batch, args.seed + 1, i, rank)
        x, y = x.to(device), y.to(device)
        val.append(F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).item())
    v = torch.tensor(sum(val) / len(val), dtype=torch.float64, device=device)  # NCCL reduces device tensors
    dist.all_reduce(v)
    model.train()
    return v.item() / world


def worker(args: argparse.Namespace) -> None:
    import warnings

    from tqdm import tqdm

    # FSDP2 notes that a Linear on a 3-D input returns a view; nothing here modifies outputs in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")

    from stepforge.strategy import Strategy

    strategy = Strategy(
        plugin=args.plugin,
        mixed_precision=None if args.precision == "fp32" else args.precision,
        work_dir=str(Path(args.out) / "work"),
        experiment_name="gpt_demo",
        # deterministic on cuda (cuBLAS workspace, attention and embedding backward): the resume check is bitwise
        env_kwargs=dict(
            backend=BACKENDS[args.device],
            randomness=dict(seed=args.seed, deterministic=args.device == "cuda"),
        ),
        log_kwargs=dict(console=False),
    )
    rank, world = strategy.rank, strategy.world_size
    # cuda:LOCAL_RANK under --device cuda: the batches go there, and NCCL reduces only tensors there
    device = strategy.plugin.device
    if device.type != args.device:
        raise SystemExit(f"--device {args.device} but the plugin placed the model on {device}")
    corpus = load_corpus(args.corpus_bytes)
    split = int(corpus.numel() * 0.95)
    train_data, val_data = corpus[:split], corpus[split:]
    max_iters = args.steps * args.accum
    warm = max(1, max_iters // 10)
    model, wrapper, schedulers = strategy.prepare(
        # on the device first: Strategy broadcasts rank 0's weights, and NCCL broadcasts only device tensors
        ByteGPT(args.d_model, args.layers, args.heads, args.seq_len).to(device),
        optim_wrapper=dict(
            optimizer=dict(type=args.optimizer, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1),
            accumulative_counts=args.accum,
        ),
        param_scheduler=[
            dict(type="LinearLR", start_factor=0.1, begin=0, end=warm, by_epoch=False),
            dict(type="CosineAnnealingLR", eta_min=args.lr / 10, begin=warm, end=max_iters, by_epoch=False),
        ],
        dispatch_kwargs=dict(max_iters=max_iters, train_micro_batch_size_per_gpu=args.micro_batch),
    )
    start = 0
    if args.phase == "resumed":
        latest = strategy.find_latest_checkpoint()
        if latest is None:
            raise SystemExit(f"no checkpoint in {strategy.work_dir}: run the uninterrupted run first")
        start = strategy.resume(latest)["meta"]["iter"]
    save_iter = args.save_at * args.accum if args.phase == "reference" else -1
    history: list[dict[str, float]] = []
    window_losses: list[float] = []
    step_times: list[float] = []
    desc = "uninterrupted run" if args.phase == "reference" else "resumed run"
    bar = tqdm(total=(max_iters - start) // args.accum, desc=desc, disable=rank != 0, leave=True)
    t0 = time.perf_counter()
    for it in range(start, max_iters):
        x, y = sample_batch(train_data, args.seq_len, args.micro_batch, args.seed, it, rank)
        x, y = x.to(device), y.to(device)
        with wrapper.optim_context(model):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        wrapper.backward(wrapper.scale_loss(loss))
        window_losses.append(loss.item())
        if wrapper.should_update():
            ts = time.perf_counter()
            wrapper.step()
            wrapper.zero_grad()
            step_times.append(time.perf_counter() - ts)
            # float64 sums of the ranks' float losses: the same order on every run, so exact comparisons hold
            mean = torch.tensor(sum(window_losses) / len(window_losses), dtype=torch.float64, device=device)
            dist.all_reduce(mean)
            history.append(
                dict(step=(it + 1) // args.accum, loss=mean.item() / world, lr=wrapper.get_lr()["lr"][0])
            )
            window_losses.clear()
            bar.set_postfix(loss=f"{history[-1]['loss']:.3f}")
            bar.update(1)
        for s in schedulers:
            s.step()
        if it + 1 == save_iter:  # a save between two iterations; the run goes on
            strategy.save_checkpoint(f"step_{args.save_at}", max_keep_ckpts=2)
    wall = time.perf_counter() - t0
    bar.close()
    _, optim_sd = strategy.plugin.get_state_dict(model, wrapper.optimizer)  # the shards this rank holds
    mine = dict(
        cuda_peak_mb=torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        param_mb=_local_bytes(list(model.parameters())) / 2**20,
        optim_state_mb=_local_bytes(optim_sd) / 2**20,
    )
    memory = [None] * world
    dist.all_gather_object(memory, mine)
    result: dict[str, Any] = dict(
        phase=args.phase, plugin=strategy.plugin_name, world_size=world, history=history, wall_s=wall,
        tokens=(max_iters - start) * args.micro_batch * args.seq_len * world, memory=memory,
        step_ms=1000 * sum(step_times) / max(1, len(step_times)), start_iter=start, isa=_isa_path(),
        n_params=sum(p.numel() for p in ByteGPT(args.d_model, args.layers, args.heads, args.seq_len).parameters()),
        val_loss=_val_loss(model, val_data, args, rank, world, device), unigram_bpb=unigram_bits_per_byte(train_data),
        device=str(device), backend=dist.get_backend(), gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    )  # fmt: skip
    if args.phase == "resumed":
        result["sample"] = generate(
            model, b"def ", args.sample_bytes, args.seq_len, args.seed, device
        ).decode("utf-8", "replace")
    if rank == 0:
        Path(args.out, f"gpt_demo_{args.phase}.json").write_text(json.dumps(result))
    strategy.close()
    dist.barrier()
    dist.destroy_process_group()


# -- the driver: two torchrun launches, then the plot and the summary ---------------------------------------
def pick_plugin(requested: str) -> tuple[str, str]:
    if requested != "auto":
        return requested, "requested"
    from stepforge.core import PLUGINS

    try:
        PLUGINS.get("zero2")
        return "zero2", "stepforge-zero is installed"
    except Exception as exc:
        return (
            "torch_fsdp",
            f"FALLBACK: no zero2 plugin registered ({type(exc).__name__}; pip install stepforge-zero)",
        )


def worker_command(
    args: argparse.Namespace, argv: list[str], phase: str, plugin: str, port: int
) -> tuple[list[str], dict[str, str]]:
    """The torchrun command of one half and its environment.

    The demo's own options travel to the workers in ``WORKER_ARGV_ENV``, not after the script name: torchrun's
    parser classifies every argument, the script's too, and rejects one that abbreviates two of its own
    (``--nproc`` matches ``--nproc-per-node`` and ``--nproc_per_node`` in torch 2.11).
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", "--nnodes=1",
        "--master-addr=127.0.0.1", f"--master-port={port}", __file__, "--worker",
    ]  # fmt: skip
    forwarded = [a for a in argv if a != "--worker"] + ["--phase", phase, "--plugin", plugin]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // args.nproc)))
    env[WORKER_ARGV_ENV] = json.dumps(forwarded)
    return cmd, env


def launch(args: argparse.Namespace, phase: str, plugin: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd, env = worker_command(args, sys.argv[1:], phase, plugin, port)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU run stays on the CPU (and gloo) on a machine with a GPU too
    if subprocess.run(cmd, env=env, check=False).returncode != 0:
        raise SystemExit(f"the {phase} half failed (see the output above)")


def report(args: argparse.Namespace, plugin_note: str, wall_s: float) -> dict[str, Any]:
    """Compare the two runs, plot them, print and write the summary."""
    out = Path(args.out)
    reference = json.loads((out / "gpt_demo_reference.json").read_text())
    resumed = json.loads((out / "gpt_demo_resumed.json").read_text())
    title = (
        f"ByteGPT, {reference['world_size']} ranks, {reference['plugin']}, {args.precision}, {args.optimizer}: "
        f"resume at step {args.save_at}"
    )
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # torchrun waits for its workers: they count
    hist = reference["history"]
    check = compare_runs(reference, resumed, args.save_at)
    note = (
        f"after the resume: largest |loss difference| {check['resume_max_abs_diff']:.3g} over "
        f"{check['resume_steps_compared']} steps + validation "
        f"({'bit-identical' if check['resume_identical'] else 'not bit-identical'}; bound {check['resume_bound']:g})"
    )
    summary = dict(
        plugin=reference["plugin"], plugin_note=plugin_note, world_size=reference["world_size"],
        precision=args.precision, optimizer=args.optimizer, isa=resumed["isa"], n_params=reference["n_params"],
        accumulative_counts=args.accum, steps=len(hist), save_at=args.save_at, resumed_at_iter=resumed["start_iter"],
        **check,
        device=reference["device"], backend=reference["backend"], gpu=reference["gpu"],
        tokens=reference["tokens"], tokens_per_s=reference["tokens"] / reference["wall_s"],
        step_ms=reference["step_ms"], final_train_loss=resumed["history"][-1]["loss"], val_loss=resumed["val_loss"],
        final_train_bpb=resumed["history"][-1]["loss"] * BITS_PER_NAT, val_bpb=resumed["val_loss"] * BITS_PER_NAT,
        first_step_bpb=hist[0]["loss"] * BITS_PER_NAT, unigram_bpb=reference["unigram_bpb"], uniform_bpb=8.0,
        memory=resumed["memory"], sample=resumed["sample"], png=plot_losses(out, reference, resumed, args.save_at, title, note),
        wall_s=wall_s, cpu_s=children.ru_utime + children.ru_stime, load_average=list(os.getloadavg()),
    )  # fmt: skip
    write_summary(out, summary)
    print_summary(summary)
    return summary


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="demo-out", help="output folder (plot, JSON, work_dir)")
    p.add_argument(
        "--plugin",
        default="auto",
        help="auto (zero2 if installed, else torch_fsdp), torch_fsdp, torch_ddp, gemini, zero2...",
    )
    p.add_argument(
        "--optimizer",
        default=None,
        help="any registered optimizer name (default: CPUAdam on cpu, FusedAdam on cuda; AdamW...)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=sorted(BACKENDS),
        help="cpu (gloo) or cuda (NCCL, one GPU per rank)",
    )
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--nproc", type=int, default=2, help="world size (processes on this machine)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all")
    p.add_argument(
        "--save-at", type=int, default=None, help="optimizer step of the mid-run checkpoint (default: half)"
    )
    p.add_argument("--accum", type=int, default=4, help="accumulative_counts")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=96)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--sample-bytes", type=int, default=200)
    p.add_argument("--val-batches", type=int, default=8, help="validation micro-batches per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="a tiny model for a few steps (CI)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--phase", choices=["reference", "resumed"], help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["--worker"]:  # started by torchrun (worker_command): the options come in the environment
        argv = [*json.loads(os.environ[WORKER_ARGV_ENV]), "--worker"]
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.d_model, args.layers, args.seq_len, args.micro_batch = 4, 32, 1, 32, 2
        args.corpus_bytes, args.sample_bytes, args.val_batches = 200_000, 16, 2
    if args.save_at is None:
        args.save_at = args.steps // 2
    if not 0 < args.save_at < args.steps:
        p.error(f"--save-at must lie in (0, --steps={args.steps}), got {args.save_at}")
    if args.nproc < 1 or args.d_model % args.heads:
        p.error("--nproc must be >= 1 and --d-model divisible by --heads")
    if args.optimizer is None:
        args.optimizer = "FusedAdam" if args.device == "cuda" else "CPUAdam"
    if args.device == "cuda" and not args.worker:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            p.error(
                "--device cuda: no CUDA device visible (torch.cuda.is_available() is False); use --device cpu"
            )
        if args.nproc > gpus:  # NCCL refuses two ranks on one GPU
            p.error(
                f"--device cuda needs one GPU per rank: --nproc {args.nproc} but {gpus} visible; use --nproc {gpus}"
            )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    os.makedirs(args.out, exist_ok=True)
    plugin, note = pick_plugin(args.plugin)
    work = Path(args.out) / "work"
    if work.exists():
        import shutil

        shutil.rmtree(work)  # a fresh run: never resume a previous demo's checkpoint
    t0 = time.perf_counter()
    launch(args, "reference", plugin)
    launch(args, "resumed", plugin)
    summary = report(args, note, time.perf_counter() - t0)
    load = ", ".join(f"{x:.1f}" for x in summary["load_average"])
    print(f" total wall time {summary['wall_s']:.0f} s, CPU time {summary['cpu_s']:.0f} s (both runs, process "
          f"start-up included); load average {load} on {os.cpu_count()} cores")  # fmt: skip
    return 0 if summary["resume_within_bound"] else 1


if __name__ == "__main__":
    sys.exit(main())
