# SPDX-License-Identifier: Apache-2.0
"""GPU benchmark of stepforge-fused's CUDA kernels against torch's best optimizers, side by side in one run.

    python tools/bench/gpu/bench_fused_gpu.py                    # full run (one H100/H200: a few minutes)
    python tools/bench/gpu/bench_fused_gpu.py --quick            # small sizes, smoke run
    python tools/bench/gpu/bench_fused_gpu.py --cases adam,sgd --big-numel 250000000 --out bench-out

Needs a CUDA device, a CUDA build of torch and stepforge-fused built with ``STEPFORGE_CUDA=ON``; without them it
exits at once (status 2) saying which is missing.

Cases (every contender gets the same initial values and gradients; only ``step()`` is timed):

- shapes: ``big`` = one 1G-element tensor; ``gpt2m`` = the GPT-2-medium parameter list (24 layers, d=1024,
  vocab 50257: 292 tensors, 355M elements); ``small`` = 20 000 tensors of 1 000 elements;
- ``adam``: AdamW, fp32: stepforge ``FusedAdam`` (and the raw ``_cuda.adam`` kernel with cached pointer arrays)
  vs ``torch.optim.AdamW(fused=True)`` and ``AdamW(foreach=True)``;
- ``mixed``: bf16 params and grads with fp32 masters, stepforge's one-pass master-weight kernel vs the best torch
  composition (bf16 grads copied into fp32 master grads, fused AdamW on the masters, masters copied back);
  ``FusedAdam`` runs twice, with its default overflow pre-check and with ``skip_nonfinite=False``;
- ``sgd``: momentum 0.9: ``FusedSGD`` / ``_cuda.sgd`` vs ``torch.optim.SGD(fused=True)`` and ``foreach=True``;
- ``lamb``: ``FusedLAMB`` / ``_cuda.lamb`` vs a ``torch._foreach_*`` LAMB with the same math (global grad-norm
  clip, per-tensor trust ratios, all on the device, no host synchronisation).

Timing: CUDA events around ``--inner`` consecutive steps, contenders interleaved round-robin, median of
``--repeats``. Effective GB/s = minimum bytes an ideal kernel moves per element (Adam fp32 28 B, mixed 28 B,
SGD 20 B, LAMB 44 B) x elements / time, compared with the device bandwidth measured by a large device-to-device
copy (read + write counted). Results: a table on stdout, ``<out>/bench_fused_gpu.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the `bench` package
from bench.common import _machine, _report
from bench.gpu._cases import BYTES, CASES, shape_sets
from bench.gpu._contenders import contenders
from bench.gpu._device import hbm_bandwidth, nvidia_driver_version, time_gpu, why_no_gpu

__all__ = ["main"]

#: what `nox -s bench_smoke` runs (tools/bench/smoke.py): seconds, every code path, no timing judged
SMOKE_ARGS = ("--quick", "--shapes", "small", "--out", "{out}")
#: no CUDA device: the smoke run expects this bench's refusal (exit 2, `cannot run here`) instead
SMOKE_NEEDS_CUDA = True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {CASES}")
    ap.add_argument("--shapes", default="big,gpt2m,small", help="comma list of big, gpt2m, small")
    ap.add_argument("--big-numel", type=int, default=1 << 30, help="elements of the single big tensor")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--inner", type=int, default=5, help="steps per timed sample")
    ap.add_argument("--quick", action="store_true", help="small sizes, 3 repeats")
    ap.add_argument("--out", default="bench-out", help="folder for the JSON and PNG")
    args = ap.parse_args(argv)
    why = why_no_gpu()
    if why is not None:
        print(f"bench_fused_gpu: cannot run here: {why}", file=sys.stderr)
        return 2
    if args.quick:
        args.repeats, args.inner = 3, 2
    torch.backends.cuda.matmul.allow_tf32 = False
    from stepforge.fused import _backend as _cuda_runtime

    info = _machine.machine_info()
    info["gpu"] = torch.cuda.get_device_name()
    info["device"] = f"{info['gpu']} (host: {info['device']})"
    info["torch_cuda"] = torch.version.cuda
    info["driver"] = nvidia_driver_version()
    bw = hbm_bandwidth(1 << 26 if args.quick else 1 << 29)
    info["cuda_status"] = _cuda_runtime.cuda_status()
    print(f"# {info['gpu']}: device copy {bw['copy_gb_per_s']:.0f} GB/s (read+write)")
    sets = shape_sets(args)
    rows: list[dict[str, Any]] = []
    raw: dict[str, Any] = {}
    for kind in [c for c in args.cases.split(",") if c]:
        for shape_name in [s for s in args.shapes.split(",") if s]:
            shapes = sets[shape_name]
            fns, bundles, baseline = contenders(kind, shapes)
            numel = bundles[0].numel
            res = time_gpu(fns, warmup=args.warmup, repeats=args.repeats, inner=args.inner)
            raw[f"{kind}/{shape_name}"] = res
            base_ms = res[baseline]["median_ms"]
            for name, r in res.items():
                gbs = BYTES[kind] * numel / (r["median_ms"] * 1e-3) / 1e9
                rows.append(
                    {
                        "case": f"{kind} {shape_name}: {name}",
                        "kind": kind,
                        "shape": shape_name,
                        "tensors": len(shapes),
                        "numel": numel,
                        "contender": name,
                        "median_ms": r["median_ms"],
                        "ratio": base_ms / r["median_ms"],
                        "gb_per_s": gbs,
                        "baseline_gb_per_s": BYTES[kind] * numel / (base_ms * 1e-3) / 1e9,
                        "fraction_of_copy_bw": gbs / bw["copy_gb_per_s"],
                        "is_baseline": name == baseline,
                    }
                )
            del fns, bundles
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            # Saved after every case: a run stopped at a time limit keeps what it measured.
            _report.save_json(Path(args.out) / "bench_fused_gpu.json", _payload(info, bw, args, rows, raw))
            print(
                f"# {kind} {shape_name}: "
                + ", ".join(
                    f"{r['contender']} {r['median_ms']:.3f} ms"
                    for r in rows
                    if r["case"].startswith(f"{kind} {shape_name}:")
                )
            )
    print(
        _report.format_table(
            rows,
            [
                ("case", "case", "s"),
                ("median_ms", "ms/step", ".3f"),
                ("ratio", "speed-up", ".2f"),
                ("gb_per_s", "GB/s", ".0f"),
                ("fraction_of_copy_bw", "of copy BW", ".0%"),
            ],
        )
    )
    out = Path(args.out)
    json_path = _report.save_json(out / "bench_fused_gpu.json", _payload(info, bw, args, rows, raw))
    plot_rows = [r for r in rows if not r["is_baseline"]]
    png = _report.save_ratio_plot(
        out / "bench_fused_gpu.png",
        plot_rows,
        title=f"stepforge-fused CUDA vs torch on {info['gpu']}",
        ceiling_gb_per_s=bw["copy_gb_per_s"],
    )
    print(f"wrote {json_path} and {png}")
    return 0


def _payload(info: dict, bw: dict, args: argparse.Namespace, rows: list, raw: dict) -> dict[str, Any]:
    return {"machine": info, "hbm": bw, "args": vars(args), "rows": rows, "samples": raw}


if __name__ == "__main__":
    raise SystemExit(main())
