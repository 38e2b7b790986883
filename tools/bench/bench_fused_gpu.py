# SPDX-License-Identifier: Apache-2.0
"""GPU benchmark of stepforge-fused's CUDA kernels against torch's best optimizers, side by side in one run.

    python tools/bench/bench_fused_gpu.py                    # full run (one H100/H200: a few minutes)
    python tools/bench/bench_fused_gpu.py --quick            # small sizes, smoke run
    python tools/bench/bench_fused_gpu.py --cases adam,sgd --big-numel 250000000 --out bench-out

Needs a CUDA device, a CUDA build of torch and stepforge-fused built with ``STEPFORGE_CUDA=ON``; without them it
exits at once (status 2) saying which is missing.

Cases (every contender gets the same initial values and gradients; only ``step()`` is timed):

- shapes: ``big`` = one 1G-element tensor; ``gpt2m`` = the GPT-2-medium parameter list (24 layers, d=1024,
  vocab 50257: 292 tensors, 355M elements); ``small`` = 20 000 tensors of 1 000 elements;
- ``adam``: AdamW, fp32: stepforge ``FusedAdam`` (and the raw ``_cuda.adam`` kernel with cached pointer arrays)
  vs ``torch.optim.AdamW(fused=True)`` and ``AdamW(foreach=True)``;
- ``mixed``: bf16 params and grads with fp32 masters, stepforge's one-pass master-weight kernel vs the best torch
  composition (bf16 grads copied into fp32 master grads, fused AdamW on the masters, masters copied back);
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
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

__all__ = ["main"]

CASES = ("adam", "mixed", "sgd", "lamb")
BYTES = {"adam": 28, "mixed": 28, "sgd": 20, "lamb": 44}
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
DEVICE = "cuda"  # the torch-only contenders also run on "cpu" (a dry run of this script's own logic)
LAMB_HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, max_grad_norm=1.0)


# ---- environment --------------------------------------------------------------------------------------------
def _why_no_gpu() -> str | None:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False (no driver or no visible device)"
    try:
        from stepforge.fused import _backend as _cuda_runtime
    except ImportError as exc:
        return f"stepforge-fused is not installed ({exc})"
    if not _cuda_runtime.cuda_available():
        return _cuda_runtime.cuda_status()
    return None


def gpt2_medium_shapes(layers: int = 24, d: int = 1024, vocab: int = 50257, ctx: int = 1024) -> list[tuple]:
    """Parameter shapes of GPT-2 medium (HF layout: c_attn / c_proj / c_fc Conv1D weights)."""
    shapes: list[tuple] = [(vocab, d), (ctx, d)]
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


def shape_sets(args: argparse.Namespace) -> dict[str, list[tuple]]:
    if args.quick:
        return {
            "big": [(args.big_numel // 16,)],
            "gpt2m": gpt2_medium_shapes(layers=4),
            "small": [(1000,)] * 2000,
        }
    return {"big": [(args.big_numel,)], "gpt2m": gpt2_medium_shapes(), "small": [(1000,)] * 20_000}


def hbm_bandwidth(numel: int = 1 << 29) -> dict[str, Any]:
    """Device-to-device copy of ``numel`` fp32 elements, read + write counted (GB/s), best of 10."""
    src = torch.randn(numel, device="cuda")
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    del src, dst
    torch.cuda.empty_cache()
    return {"copy_gb_per_s": 2 * numel * 4 / (best * 1e-3) / 1e9, "bytes": 2 * numel * 4}


# ---- timing -------------------------------------------------------------------------------------------------
def time_gpu(fns: dict[str, Callable[[], Any]], *, warmup: int, repeats: int, inner: int) -> dict[str, dict]:
    """Median milliseconds per step of each callable: CUDA events around ``inner`` steps, interleaved."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    for _ in range(repeats):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / inner)
    return {
        k: {"median_ms": statistics.median(v), "min_ms": min(v), "samples_ms": v} for k, v in samples.items()
    }


# ---- contenders ---------------------------------------------------------------------------------------------
class Bundle:
    """Params with grads attached, in ``dtype``, built from one seed so every contender starts the same."""

    def __init__(self, shapes: list[tuple], dtype: torch.dtype, seed: int = 0) -> None:
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.params = [
            torch.randn(s, device=DEVICE, generator=gen, dtype=torch.float32).to(dtype) for s in shapes
        ]
        for p in self.params:
            p.requires_grad_(True)
            p.grad = (torch.randn(p.shape, device=DEVICE, generator=gen) * 1e-2).to(dtype)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def _ptrs(ts: list[torch.Tensor]) -> list[int]:
    return [t.data_ptr() for t in ts]


def kernel_adam(b: Bundle, *, masters: bool) -> Callable[[], None]:
    """Raw ``_cuda.adam`` with pointer arrays built once (what an arena-backed optimizer does every step)."""
    from stepforge.fused import _backend as _cuda_runtime
    from stepforge.testing.fused_cuda import stream_handle

    mod = _cuda_runtime.cuda_module()
    ps = [p.detach() for p in b.params]
    master = [p.float() for p in ps] if masters else None
    ref = master if masters else ps
    m = [torch.zeros_like(t, dtype=torch.float32) for t in ref]
    v = [torch.zeros_like(t, dtype=torch.float32) for t in ref]
    code = _cuda_runtime.dtype_code(ps[0].dtype, what="bench tensors", owner="bench")
    args = (
        _ptrs(ps),
        _ptrs([p.grad for p in b.params]),
        _ptrs(m),
        _ptrs(v),
        None if master is None else _ptrs(master),
        [t.numel() for t in ps],
    )
    state = {"step": 0}
    keep = (m, v, master)

    def step() -> None:
        state["step"] += 1
        mod.adam(
            *args,
            [state["step"]] * len(ps),
            code,
            code,
            HP["lr"],
            0.9,
            0.999,
            HP["eps"],
            HP["weight_decay"],
            True,
            True,
            1.0,
            0,
            False,
            stream_handle(),
        )
        _ = keep

    return step


def kernel_sgd(b: Bundle) -> Callable[[], None]:
    from stepforge.fused import _backend as _cuda_runtime
    from stepforge.testing.fused_cuda import stream_handle

    mod = _cuda_runtime.cuda_module()
    ps = [p.detach() for p in b.params]
    bufs = [torch.zeros_like(p) for p in ps]
    args = (_ptrs(ps), _ptrs([p.grad for p in b.params]), _ptrs(bufs), None, [t.numel() for t in ps])
    first = {"flags": [1] * len(ps)}

    def step() -> None:
        mod.sgd(
            *args,
            first["flags"],
            0,
            0,
            HP["lr"],
            0.9,
            0.0,
            0.0,
            False,
            False,
            1.0,
            0,
            False,
            stream_handle(),
        )
        first["flags"] = [0] * len(ps)
        _ = bufs

    return step


def kernel_lamb(b: Bundle) -> Callable[[], None]:
    """``_cuda.l2norm`` (global grad norm on the device) + the clip factor + ``_cuda.lamb``, no host sync."""
    from stepforge.fused import _backend as _cuda_runtime
    from stepforge.testing.fused_cuda import stream_handle

    mod = _cuda_runtime.cuda_module()
    ps = [p.detach() for p in b.params]
    grads = [p.grad for p in b.params]
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    sizes = [t.numel() for t in ps]
    sumsq = torch.zeros(1, device="cuda")
    div = torch.ones(1, device="cuda")
    state = {"step": 0}
    gp = _ptrs(grads)
    args = (_ptrs(ps), gp, _ptrs(m), _ptrs(v), None, sizes)

    def step() -> None:
        state["step"] += 1
        ctx = stream_handle()
        sumsq.zero_()
        mod.l2norm(gp, sizes, 0, 0, ctx, sumsq_out_ptr=sumsq.data_ptr())
        torch.clamp(sumsq.sqrt() / LAMB_HP["max_grad_norm"], min=1.0, out=div)
        mod.lamb(
            *args,
            [state["step"]] * len(ps),
            0,
            0,
            LAMB_HP["lr"],
            0.9,
            0.999,
            LAMB_HP["eps"],
            LAMB_HP["weight_decay"],
            True,
            True,
            True,
            False,
            0.0,
            math.inf,
            1.0,
            0,
            False,
            ctx,
            grad_divisor_ptr=div.data_ptr(),
        )
        _ = (m, v)

    return step


def torch_mixed(b: Bundle) -> Callable[[], None]:
    """Best torch composition for bf16 params with fp32 masters: copy grads up, fused AdamW, copy params down."""
    ps = [p.detach() for p in b.params]
    masters = [p.float().requires_grad_() for p in ps]
    for mp in masters:
        mp.grad = torch.empty_like(mp)
    opt = torch.optim.AdamW(masters, fused=True, **HP)
    low_grads = [p.grad for p in b.params]
    master_grads = [mp.grad for mp in masters]
    md = [mp.detach() for mp in masters]

    def step() -> None:
        torch._foreach_copy_(master_grads, low_grads)
        opt.step()
        torch._foreach_copy_(ps, md)

    return step


def foreach_lamb(b: Bundle) -> Callable[[], None]:
    """LAMB with torch._foreach_* ops (apex FusedLAMB math), everything on the device."""
    ps = [p.detach() for p in b.params]
    gs = [p.grad for p in b.params]
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    b1, b2 = LAMB_HP["betas"]
    eps, wd, lr = LAMB_HP["eps"], LAMB_HP["weight_decay"], LAMB_HP["lr"]
    state = {"step": 0}

    def step() -> None:
        state["step"] += 1
        t = state["step"]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs)))
        clip = torch.clamp(norm / LAMB_HP["max_grad_norm"], min=1.0)
        g = torch._foreach_div(gs, clip)
        torch._foreach_lerp_(m, g, 1 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, g, g, 1 - b2)
        denom = torch._foreach_div(v, 1 - b2**t)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
        u = torch._foreach_div(m, 1 - b1**t)
        torch._foreach_div_(u, denom)
        torch._foreach_add_(u, ps, alpha=wd)
        pn = torch.stack(torch._foreach_norm(ps))
        un = torch.stack(torch._foreach_norm(u))
        ratio = torch.where((pn > 0) & (un > 0), pn / un, torch.ones_like(pn)) * -lr
        torch._foreach_mul_(u, list(ratio.unbind(0)))
        torch._foreach_add_(ps, u)

    return step


def _stepforge_class(kind: str, b: Bundle) -> Callable[[], None] | None:
    try:
        import stepforge.fused as fused

        if kind == "adam":
            opt = fused.FusedAdam(b.params, bias_correction=True, **HP)
        elif kind == "mixed":
            opt = fused.FusedAdam(b.params, bias_correction=True, master_weights=True, **HP)
        elif kind == "sgd":
            opt = fused.FusedSGD(b.params, lr=HP["lr"], momentum=0.9)
        else:
            opt = fused.FusedLAMB(b.params, **LAMB_HP)
        opt.step()
        return opt.step
    except Exception as exc:  # the class may not route CUDA tensors in this build: report, do not abort
        print(f"  [skip] stepforge class for {kind}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def contenders(kind: str, shapes: list[tuple]) -> tuple[dict[str, Callable[[], None]], list, str]:
    dtype = torch.bfloat16 if kind == "mixed" else torch.float32
    bundles: list[Bundle] = []

    def fresh() -> Bundle:
        bundles.append(Bundle(shapes, dtype))
        return bundles[-1]

    fns: dict[str, Callable[[], None]] = {}
    if kind == "adam":
        fns["torch AdamW fused"] = torch.optim.AdamW(fresh().params, fused=True, **HP).step
        fns["torch AdamW foreach"] = torch.optim.AdamW(fresh().params, foreach=True, **HP).step
        fns["stepforge _cuda.adam"] = kernel_adam(fresh(), masters=False)
        baseline = "torch AdamW fused"
    elif kind == "mixed":
        fns["torch bf16->fp32 + AdamW fused"] = torch_mixed(fresh())
        fns["stepforge _cuda.adam (masters)"] = kernel_adam(fresh(), masters=True)
        baseline = "torch bf16->fp32 + AdamW fused"
    elif kind == "sgd":
        fns["torch SGD fused"] = torch.optim.SGD(fresh().params, lr=HP["lr"], momentum=0.9, fused=True).step
        fns["torch SGD foreach"] = torch.optim.SGD(
            fresh().params, lr=HP["lr"], momentum=0.9, foreach=True
        ).step
        fns["stepforge _cuda.sgd"] = kernel_sgd(fresh())
        baseline = "torch SGD fused"
    else:
        fns["torch foreach LAMB"] = foreach_lamb(fresh())
        fns["stepforge _cuda.lamb"] = kernel_lamb(fresh())
        baseline = "torch foreach LAMB"
    cls = _stepforge_class(kind, fresh())
    if cls is not None:
        fns[f"stepforge {'FusedAdam' if kind in ('adam', 'mixed') else 'Fused' + kind.upper()}"] = cls
    return fns, bundles, baseline


# ---- main ---------------------------------------------------------------------------------------------------
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
    why = _why_no_gpu()
    if why is not None:
        print(f"bench_fused_gpu: cannot run here: {why}", file=sys.stderr)
        return 2
    if args.quick:
        args.repeats, args.inner = 3, 2
    torch.backends.cuda.matmul.allow_tf32 = False
    from stepforge.fused import _backend as _cuda_runtime

    info = _common.machine_info()
    info["gpu"] = torch.cuda.get_device_name()
    info["device"] = f"{info['gpu']} (host: {info['device']})"
    info["cuda_status"] = _cuda_runtime.cuda_status()
    bw = hbm_bandwidth(1 << 26 if args.quick else 1 << 29)
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
    print(
        _common.format_table(
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
    payload = {"machine": info, "hbm": bw, "args": vars(args), "rows": rows, "samples": raw}
    json_path = _common.save_json(out / "bench_fused_gpu.json", payload)
    plot_rows = [r for r in rows if not r["is_baseline"]]
    png = _common.save_ratio_plot(
        out / "bench_fused_gpu.png",
        plot_rows,
        title=f"stepforge-fused CUDA vs torch on {info['gpu']}",
        ceiling_gb_per_s=bw["copy_gb_per_s"],
    )
    print(f"wrote {json_path} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
