# SPDX-License-Identifier: Apache-2.0
"""The main job: a small GPT-style byte-level language model trained on 2 processes with stepforge.

    python examples/train_gpt_demo.py                    # what `nox -s demo` runs: 2 ranks, ~2-4 min on 2 cores
    python examples/train_gpt_demo.py --plugin torch_ddp --precision fp32 --nproc 2 --steps 40
    python examples/train_gpt_demo.py --smoke            # a few steps of a tiny model (the CI test)

The text is the Python standard library's own source (``*.py`` under ``sysconfig.get_paths()["stdlib"]``), read
as bytes: present on every machine with Python, no download. The model is a pre-norm decoder-only transformer
over the 256 byte values. Training goes through ``stepforge.strategy.Strategy``: plugin ``zero2``
(stepforge-zero's ZeRO-2) when installed, else ``torch_fsdp`` (the summary says which, and why), ``bf16`` mixed
precision, ``CPUAdam`` from stepforge-fused, ``accumulative_counts=4``, a linear warm-up then cosine schedule.

The run has two halves, each in NEW processes started with ``torchrun`` on gloo: the first trains to the middle
and saves a checkpoint (a crash-safe DCP directory); the second starts from nothing, resumes from
``work_dir/last_checkpoint`` (model, optimizer shards, schedulers, accumulation counters, every rank's RNG) and
trains to the end. Micro-batch ``i`` of rank ``r`` is drawn from a generator seeded by ``(seed, i, r)``, so the
data position is the iteration counter that the checkpoint restores.

Output: a progress bar (rank 0), ``<out>/gpt_demo_loss.png`` (the loss curve, both halves), ``<out>/gpt_demo.json``
and a one-screen summary: tokens/s, optimizer-step time, memory per rank, final train/validation loss and a
sample of generated text.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


# -- data and model ----------------------------------------------------------------------------------------
def load_corpus(max_bytes: int) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the stdlib's ``.py`` files (sorted paths), as uint8."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).clone()


def sample_batch(
    corpus: torch.Tensor, seq_len: int, batch: int, seed: int, it: int, rank: int
) -> tuple[Any, Any]:
    """Micro-batch ``it`` of ``rank``: random windows of the corpus; inputs and next-byte targets."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + it * 1_009 + rank)
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (batch,), generator=g)
    rows = torch.stack([corpus[s : s + seq_len + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class ByteGPT(nn.Module):
    """Decoder-only transformer over bytes (no weight tying: every block shards on its own)."""

    def __init__(self, d: int, layers: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.ctx = ctx
        self.tok, self.pos = nn.Embedding(256, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, 256, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


@torch.no_grad()
def generate(model: nn.Module, prompt: bytes, n: int, ctx: int, seed: int) -> bytes:
    """Top-k sampling; every rank runs it in lockstep (sharded models gather in forward)."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor([list(prompt)], dtype=torch.long)
    for _ in range(n):
        logits = model(idx[:, -ctx:])[0, -1].float()
        top = torch.topk(logits, 20)
        probs = torch.softmax(top.values / 0.8, dim=-1)
        nxt = top.indices[torch.multinomial(probs, 1, generator=g)]
        idx = torch.cat([idx, nxt.view(1, 1)], dim=1)
    model.train()
    return bytes(idx[0].tolist())


# -- one half of the run, on every rank --------------------------------------------------------------------
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
        env_kwargs=dict(randomness=dict(seed=args.seed)),
        log_kwargs=dict(console=False),
    )
    rank, world = strategy.rank, strategy.world_size
    corpus = load_corpus(args.corpus_bytes)
    split = int(corpus.numel() * 0.95)
    train_data, val_data = corpus[:split], corpus[split:]
    max_iters = args.steps * args.accum
    warm = max(1, max_iters // 10)
    model, wrapper, schedulers = strategy.prepare(
        ByteGPT(args.d_model, args.layers, args.heads, args.seq_len),
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
    if args.phase == "second":
        latest = strategy.find_latest_checkpoint()
        if latest is None:
            raise SystemExit(f"no checkpoint in {strategy.work_dir}: run the first half first")
        start = strategy.resume(latest)["meta"]["iter"]
    stop = args.save_at * args.accum if args.phase == "first" else max_iters
    history: list[dict[str, float]] = []
    window_losses: list[float] = []
    step_times: list[float] = []
    bar = tqdm(total=(stop - start) // args.accum, desc=f"{args.phase} half", disable=rank != 0, leave=True)
    t0 = time.perf_counter()
    for it in range(start, stop):
        x, y = sample_batch(train_data, args.seq_len, args.micro_batch, args.seed, it, rank)
        with wrapper.optim_context(model):
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        wrapper.backward(wrapper.scale_loss(loss))
        window_losses.append(loss.item())
        if wrapper.should_update():
            ts = time.perf_counter()
            wrapper.step()
            wrapper.zero_grad()
            step_times.append(time.perf_counter() - ts)
            mean = torch.tensor(sum(window_losses) / len(window_losses))
            dist.all_reduce(mean)
            history.append(
                dict(step=(it + 1) // args.accum, loss=mean.item() / world, lr=wrapper.get_lr()["lr"][0])
            )
            window_losses.clear()
            bar.set_postfix(loss=f"{history[-1]['loss']:.3f}")
            bar.update(1)
        for s in schedulers:
            s.step()
    wall = time.perf_counter() - t0
    bar.close()
    if args.phase == "first":
        strategy.save_checkpoint(f"step_{args.save_at}", max_keep_ckpts=2)
    _, optim_sd = strategy.plugin.get_state_dict(model, wrapper.optimizer)  # the shards this rank holds
    mine = dict(
        rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        param_mb=_local_bytes(list(model.parameters())) / 2**20,
        optim_state_mb=_local_bytes(optim_sd) / 2**20,
    )
    memory = [None] * world
    dist.all_gather_object(memory, mine)
    result: dict[str, Any] = dict(
        phase=args.phase, plugin=strategy.plugin_name, world_size=world, history=history, wall_s=wall,
        tokens=(stop - start) * args.micro_batch * args.seq_len * world, memory=memory,
        step_ms=1000 * sum(step_times) / max(1, len(step_times)), start_iter=start,
        n_params=sum(p.numel() for p in ByteGPT(args.d_model, args.layers, args.heads, args.seq_len).parameters()),
    )  # fmt: skip
    if args.phase == "second":
        with torch.no_grad():
            model.eval()
            val = []
            for i in range(4):
                x, y = sample_batch(val_data, args.seq_len, args.micro_batch, args.seed + 1, i, rank)
                val.append(F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).item())
            v = torch.tensor(sum(val) / len(val))
            dist.all_reduce(v)
            result["val_loss"] = v.item() / world
            model.train()
        result["sample"] = generate(model, b"def ", args.sample_bytes, args.seq_len, args.seed).decode(
            "utf-8", "replace"
        )
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


def launch(args: argparse.Namespace, phase: str, plugin: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [a for a in sys.argv[1:] if a not in ("--worker",)]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", "--nnodes=1",
        "--master-addr=127.0.0.1", f"--master-port={port}", __file__, *argv,
        "--worker", "--phase", phase, "--plugin", plugin,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // args.nproc)))
    if subprocess.run(cmd, env=env, check=False).returncode != 0:
        raise SystemExit(f"the {phase} half failed (see the output above)")


def report(args: argparse.Namespace, plugin_note: str) -> dict[str, Any]:
    first = json.loads(Path(args.out, "gpt_demo_first.json").read_text())
    second = json.loads(Path(args.out, "gpt_demo_second.json").read_text())
    hist = first["history"] + second["history"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(
            [h["step"] for h in first["history"]], [h["loss"] for h in first["history"]], label="first half"
        )
        ax.plot(
            [h["step"] for h in second["history"]],
            [h["loss"] for h in second["history"]],
            label="resumed (new processes)",
        )
        ax.axvline(args.save_at, color="grey", ls="--", lw=1, label=f"checkpoint @ step {args.save_at}")
        ax.set(
            xlabel="optimizer step",
            ylabel="train loss (nats/byte)",
            title=f"ByteGPT on {first['world_size']} ranks, {first['plugin']}",
        )
        ax.legend()
        fig.tight_layout()
        fig.savefig(Path(args.out, "gpt_demo_loss.png"), dpi=110)
        png = str(Path(args.out, "gpt_demo_loss.png"))
    except ImportError:
        png = "(matplotlib not installed: no plot)"
    tokens = first["tokens"] + second["tokens"]
    wall = first["wall_s"] + second["wall_s"]
    summary = dict(
        plugin=first["plugin"], plugin_note=plugin_note, world_size=first["world_size"], n_params=first["n_params"],
        optimizer=args.optimizer, precision=args.precision, accumulative_counts=args.accum, steps=len(hist),
        tokens_per_s=tokens / wall, step_ms=(first["step_ms"] + second["step_ms"]) / 2,
        loss_before_ckpt=first["history"][-1]["loss"], loss_after_resume=second["history"][0]["loss"],
        final_loss=hist[-1]["loss"], val_loss=second["val_loss"], memory=second["memory"], sample=second["sample"],
        resumed_at_iter=second["start_iter"], png=png,
    )  # fmt: skip
    Path(args.out, "gpt_demo.json").write_text(json.dumps(summary, indent=1))
    print("\n" + "=" * 78)
    print(
        f" ByteGPT demo: {summary['n_params'] / 1e6:.2f} M params, {summary['world_size']} ranks (torchrun, gloo)"
    )
    print(
        f" plugin {summary['plugin']} ({plugin_note}), {args.precision}, {args.optimizer}, accumulative_counts={args.accum}"
    )
    print(
        f" steps {summary['steps']}: checkpoint at step {args.save_at}, resumed in new processes at iter {summary['resumed_at_iter']}"
    )
    print(f" loss: start {hist[0]['loss']:.3f} -> at checkpoint {summary['loss_before_ckpt']:.3f} -> first resumed step "
          f"{summary['loss_after_resume']:.3f} -> final {summary['final_loss']:.3f} (validation {summary['val_loss']:.3f}; "
          f"uniform bytes = {math.log(256):.2f})")  # fmt: skip
    print(f" throughput {summary['tokens_per_s']:,.0f} tokens/s; optimizer step {summary['step_ms']:.1f} ms")
    for r, m in enumerate(summary["memory"]):
        print(
            f" rank {r}: peak RSS {m['rss_mb']:.0f} MB, params {m['param_mb']:.2f} MB, optimizer state {m['optim_state_mb']:.2f} MB"
        )
    print(f" loss curve: {png}")
    print(" sample:", repr(summary["sample"][:160]))
    print("=" * 78)
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
        "--optimizer", default="CPUAdam", help="any registered optimizer name (CPUAdam, FusedAdam, AdamW...)"
    )
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--nproc", type=int, default=2, help="world size (processes on this machine)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps in all")
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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="a tiny model for a few steps (CI)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--phase", choices=["first", "second"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.steps, args.d_model, args.layers, args.seq_len, args.micro_batch = 4, 32, 1, 32, 2
        args.corpus_bytes, args.sample_bytes = 200_000, 16
    if args.save_at is None:
        args.save_at = args.steps // 2
    if not 0 < args.save_at < args.steps:
        p.error(f"--save-at must lie in (0, --steps={args.steps}), got {args.save_at}")
    if args.nproc < 1 or args.d_model % args.heads:
        p.error("--nproc must be >= 1 and --d-model divisible by --heads")
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
    launch(args, "first", plugin)
    launch(args, "second", plugin)
    report(args, note)
    print(f" total wall time {time.perf_counter() - t0:.0f} s (both halves, process start-up included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
