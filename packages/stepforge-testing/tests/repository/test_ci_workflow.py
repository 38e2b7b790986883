# SPDX-License-Identifier: Apache-2.0
""".github/workflows/ci.yml runs what `nox -t ci` runs: its job matrix is the session list nox prints, the
sessions it leaves out of that matrix have jobs of their own, and the pure packages' tests run on every Python the
stepforge-fused wheels are built for."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import tomllib
from typing import Any

import yaml

ROOT = pathlib.Path(os.environ.get("STEPFORGE_SOURCE_ROOT") or pathlib.Path(__file__).resolve().parents[4])
WORKFLOW = ROOT / ".github" / "workflows" / "ci.yml"


def _jobs() -> dict[str, Any]:
    jobs = yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))["jobs"]
    assert isinstance(jobs, dict) and jobs, WORKFLOW
    return jobs


def _runs(job: dict[str, Any]) -> list[str]:
    return [step["run"] for step in job.get("steps", []) if "run" in step]


def _list_step(jobs: dict[str, Any]) -> str:
    (step,) = [run for run in _runs(jobs["sessions"]) if "nox -l" in run]
    return step


def test_the_matrix_is_what_nox_lists_for_the_ci_and_pythons_tags():
    jobs = _jobs()
    listing = _list_step(jobs)
    assert "nox -l -t ci --json" in listing
    assert "nox -l -t pythons --json" in listing
    assert '"matrix=' in listing and "$GITHUB_OUTPUT" in listing
    assert jobs["sessions"]["outputs"]["matrix"] == "${{ steps.list.outputs.matrix }}"

    runner = jobs["nox"]
    assert runner["needs"] == "sessions"
    assert runner["strategy"]["matrix"] == {"include": "${{ fromJSON(needs.sessions.outputs.matrix) }}"}
    (setup,) = [s for s in runner["steps"] if str(s.get("uses", "")).startswith("actions/setup-python")]
    assert setup["with"]["python-version"] == "${{ matrix.python }}"
    (run,) = [s for s in runner["steps"] if "nox -s" in s.get("run", "")]
    assert run["run"] == 'nox -s "$SESSION"' and run["env"] == {"SESSION": "${{ matrix.session }}"}


def test_every_session_left_out_of_the_matrix_has_a_job_of_its_own():
    jobs = _jobs()
    left_out = re.findall(r'\.session != "([^"]+)"', _list_step(jobs))
    assert left_out == ["build_cuda"]  # the one that needs the CUDA container
    for session in left_out:
        running = [
            name
            for name, job in jobs.items()
            if any(re.search(rf"nox -s {re.escape(session)}(\s|$)", run) for run in _runs(job))
        ]
        assert running, f"no job of {WORKFLOW.name} runs `nox -s {session}`"


def test_all_green_waits_for_every_other_job():
    jobs = _jobs()
    assert sorted(jobs["all-green"]["needs"]) == sorted(name for name in jobs if name != "all-green")


def _constant(path: pathlib.Path, name: str) -> Any:
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets) and node.value is not None:
                return ast.literal_eval(node.value)
    raise AssertionError(f"{path.name} assigns no {name}")


def test_pure_packages_are_tested_on_every_python_the_wheels_ship_for():
    build = tomllib.loads((ROOT / "packages" / "stepforge-fused" / "pyproject.toml").read_text())
    shipped = sorted(
        f"{m[1]}.{m[2]}"
        for m in (re.match(r"cp(\d)(\d+)-", s) for s in build["tool"]["cibuildwheel"]["build"])
        if m
    )
    assert shipped, build["tool"]["cibuildwheel"]["build"]
    tested = [
        _constant(ROOT / "tools" / "nox_support.py", "PYTHON"),
        *_constant(ROOT / "noxfile.py", "NEWER_PYTHONS"),
    ]
    assert sorted(tested) == shipped
