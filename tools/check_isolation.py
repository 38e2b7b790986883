# SPDX-License-Identifier: Apache-2.0
"""Run inside a fresh venv where only one stepforge package was installed (nox -s isolation).

Checks that no other stepforge distribution came in, that the package's own optimizers resolve through entry
points, and that a name from a package that is not installed fails with the install hint.
"""

from __future__ import annotations

import sys
from importlib.metadata import distributions

import torch

from stepforge.core import OPTIMIZERS, UnknownNameError, build_optimizer


def main(package: str) -> int:
    installed = sorted(
        {d.metadata["Name"] for d in distributions() if d.metadata["Name"].startswith("stepforge-")}
    )
    expected = sorted({"stepforge-core", package})
    print(f"stepforge distributions installed: {installed}")
    if installed != expected:
        print(f"FAIL: expected exactly {expected}")
        return 1
    own = {e.name: e for e in OPTIMIZERS.describe().values() if e.distribution == package}
    print(f"optimizers provided by {package}: {sorted(own)}")
    if package == "stepforge-optim" and not {"Lamb", "Lars"} <= set(own):
        print("FAIL: Lamb and Lars must come from stepforge-optim's entry points")
        return 1
    for name in own:
        OPTIMIZERS.get(name)  # importable with only core + this package installed
    try:
        build_optimizer(dict(type="FusedAdam"), [torch.zeros(1, requires_grad=True)])
    except UnknownNameError as exc:
        print(f"as expected: {exc}")
        if "pip install stepforge-fused" not in str(exc):
            print("FAIL: the error does not say which distribution to install")
            return 1
    else:
        print("FAIL: FusedAdam resolved although stepforge-fused is not installed")
        return 1
    print("isolation OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
