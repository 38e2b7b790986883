# SPDX-License-Identifier: Apache-2.0
"""Run by `nox -s wheel` inside a fresh venv that holds the repaired stepforge-fused wheel (no compiler on PATH).

Checks that the installed wheel (not the source tree) is what runs, that no compiler was reachable, that the
OpenMP kernels run on torch's OpenMP runtime (exactly one loaded), that a C++ exception still becomes a Python
error, and that one CPUAdam step matches torch.optim.AdamW. `--compilers-may-exist` (cibuildwheel's test step,
inside a build image) skips only the no-compiler check.
"""

from __future__ import annotations

import pathlib
import shutil
import sys
import sysconfig


def main(argv: list[str]) -> int:
    compilers = {name: shutil.which(name) for name in ("cc", "c++", "gcc", "g++", "nvcc")}
    found = {k: v for k, v in compilers.items() if v}
    if found and "--compilers-may-exist" not in argv:
        raise SystemExit(
            f"check_wheel: a compiler is on PATH {found}; the install must be proven without one"
        )

    import torch

    import stepforge.fused as sf
    from stepforge.fused import _cpu

    site = pathlib.Path(sysconfig.get_paths()["purelib"]).resolve()
    module_file = pathlib.Path(_cpu.__file__).resolve()
    if site not in module_file.parents:
        raise SystemExit(f"check_wheel: stepforge.fused._cpu comes from {module_file}, not the venv's {site}")

    features = sf.cpu_features()
    print(
        f"stepforge.fused {sf.__version__} from {module_file.name}: {features['isa']}, openmp={features['openmp']}"
    )
    if not features["openmp"]:
        raise SystemExit("check_wheel: the wheel's CPU module was built without OpenMP")

    # pybind11 translates C++ exceptions through std::exception_ptr (the compat shim in manylinux builds).
    try:
        _cpu.set_isa("no-such-isa")
    except ValueError as exc:
        print(f"C++ exception translated: ValueError({exc})")
    else:
        raise SystemExit("check_wheel: set_isa('no-such-isa') did not raise ValueError")

    torch.manual_seed(0)
    shapes = [(1000, 300), (4097,), (33, 17)]
    params = [torch.randn(s) for s in shapes]
    grads = [torch.randn(s) for s in shapes]
    ours = [p.clone().requires_grad_() for p in params]
    ref = [p.clone().requires_grad_() for p in params]
    for a, b, g in zip(ours, ref, grads, strict=True):
        a.grad, b.grad = g.clone(), g.clone()
    hyper = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    torch.set_num_threads(2)
    sf.CPUAdam(ours, **hyper).step()
    torch.optim.AdamW(ref, foreach=False, **hyper).step()

    worst = 0.0
    for a, b, p0 in zip(ours, ref, params, strict=True):
        moved = (b.detach() - p0).abs().mean().item()
        if moved < 0.5 * hyper["lr"]:  # Adam's first step moves every element by about lr
            raise SystemExit(f"check_wheel: reference step moved params by only {moved}")
        worst = max(worst, (a.detach() - b.detach()).abs().max().item())
    if worst > 1e-6:
        raise SystemExit(f"check_wheel: CPUAdam differs from torch AdamW by {worst} (> 1e-6)")
    print(f"CPUAdam step == torch AdamW (largest difference {worst:.3g})")

    maps = pathlib.Path("/proc/self/maps").read_text().splitlines()
    runtimes = sorted(
        {line.split()[-1] for line in maps if any(k in line for k in ("libgomp", "libomp", "libiomp"))}
    )
    print("OpenMP runtimes loaded:", runtimes)
    if len(runtimes) != 1:
        raise SystemExit(f"check_wheel: expected exactly one OpenMP runtime (torch's), found {runtimes}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
