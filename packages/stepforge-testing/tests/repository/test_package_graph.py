# SPDX-License-Identifier: Apache-2.0
"""The package graph: a package's source imports only the stepforge packages its pyproject.toml lists in
``[project].dependencies`` (docs/design.md, "Packages and how they depend on each other"). First the checker on
a small made-up tree (it must find what it claims to), then the real one."""

from __future__ import annotations

import os
import pathlib
import textwrap

from stepforge.testing import import_rules

ROOT = pathlib.Path(os.environ.get("STEPFORGE_SOURCE_ROOT") or pathlib.Path(__file__).resolve().parents[4])


def _package(root: pathlib.Path, name: str, deps: list[str], files: dict[str, str]) -> None:
    folder = root / "packages" / f"stepforge-{name}"
    folder.mkdir(parents=True)
    listed = ", ".join(f'"{d}"' for d in deps)
    extra = '[dependency-groups]\ntest = ["stepforge-gamma"]\n'  # test groups do not count for src/
    (folder / "pyproject.toml").write_text(
        f'[project]\nname = "stepforge-{name}"\ndependencies = [{listed}]\n{extra}'
    )
    for rel, source in files.items():
        path = folder / "src" / "stepforge" / name / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))


def test_undeclared_sibling_imports_are_found(tmp_path):
    _package(tmp_path, "core", [], {"__init__.py": ""})
    _package(tmp_path, "gamma", ["stepforge-core>=0.1"], {"__init__.py": ""})
    _package(
        tmp_path,
        "alpha",
        ["stepforge-core>=0.1,<0.2", "torch>=2.6"],
        {
            "__init__.py": "from stepforge.core import x\n",
            "a.py": "def f():\n    from stepforge.gamma import y\n",
            "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import stepforge.beta\n",
        },
    )
    _package(tmp_path, "beta", ["stepforge-alpha"], {"__init__.py": "from stepforge.alpha import a\n"})
    found = import_rules.undeclared_imports(tmp_path)
    assert len(found) == 2, found
    assert "stepforge.alpha.a -> stepforge.gamma" in found[0] and "function-level" in found[0]
    assert found[0].endswith("stepforge.gamma is not a dependency of stepforge.alpha")
    assert "stepforge.alpha.b -> stepforge.beta" in found[1]
    assert import_rules.declared_packages(tmp_path)["stepforge.alpha"] == {"stepforge.core"}


def test_the_repository_imports_only_declared_packages():
    declared = import_rules.declared_packages(ROOT)
    assert declared["stepforge.strategy"] >= {"stepforge.core", "stepforge.accum"}
    assert import_rules.undeclared_imports(ROOT) == []
