# SPDX-License-Identifier: Apache-2.0
"""The smoke runner (``tools/bench/smoke.py``): it finds every bench by its file name and refuses one that declares
no usable smoke run; a run passes only on exit 0 with a JSON written, or, for a CUDA-only bench without a device,
on its own refusal; scripts run from a scratch folder and a hung one is killed. Then the real tree: every bench
declares a smoke run, and every script imports its parts the same way."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import sys

import pytest

from bench import smoke

BENCH = pathlib.Path(smoke.__file__).resolve().parent
#: the line that puts tools/ on sys.path; every script that imports from the bench package starts with it
BOOTSTRAP = "sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the `bench` package"


def _tree(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


OK_DECL = 'SMOKE_ARGS = ("--tiny", "--out", "{out}")\n'


def test_discover_reads_the_declarations_without_importing_the_scripts(tmp_path):
    root = _tree(
        tmp_path,
        {
            # importing either would fail: the runner must only read them
            "zero/bench_zero.py": "import not_a_module\n" + OK_DECL,
            "gpu/bench_fused_gpu.py": 'raise SystemExit(3)\nSMOKE_ARGS = ("--out", "{out}")\nSMOKE_NEEDS_CUDA = True\n',
            "zero/_parts.py": "",  # a part, not a bench
        },
    )
    found = smoke.discover(root)
    assert [(s.name, s.args, s.needs_cuda) for s in found] == [
        ("gpu/bench_fused_gpu.py", ("--out", "{out}"), True),
        ("zero/bench_zero.py", ("--tiny", "--out", "{out}"), False),
    ]
    assert found[1].argv(pathlib.Path("/o")) == [
        sys.executable,
        str(root / "zero/bench_zero.py"),
        "--tiny",
        "--out",
        "/o",
    ]


def test_discover_names_every_bench_without_a_usable_smoke_run(tmp_path):
    root = _tree(
        tmp_path,
        {
            "fused/bench_ok.py": OK_DECL,
            "fused/bench_missing.py": "ARGS = ()\n",
            "fused/bench_not_literal.py": "SMOKE_ARGS = tuple(['--tiny'])\n",
            "fused/bench_list.py": 'SMOKE_ARGS = ["--out", "{out}"]\n',
            "fused/bench_no_out.py": 'SMOKE_ARGS = ("--tiny",)\n',
            "fused/bench_cuda_str.py": OK_DECL + 'SMOKE_NEEDS_CUDA = "yes"\n',
            "fused/bench_typo.py": OK_DECL + "SMOKE_NEED_CUDA = True\n",
            "bench_flat.py": OK_DECL,
            "zero/deeper/bench_deep.py": OK_DECL,
        },
    )
    with pytest.raises(smoke.SmokeDeclarationError) as caught:
        smoke.discover(root)
    lines = str(caught.value).splitlines()[1:]
    assert [line.strip().split(":")[0] for line in lines] == [
        "bench_flat.py",
        "fused/bench_cuda_str.py",
        "fused/bench_list.py",
        "fused/bench_missing.py",
        "fused/bench_no_out.py",
        "fused/bench_not_literal.py",
        "fused/bench_typo.py",
        "zero/deeper/bench_deep.py",
    ]
    text = str(caught.value)
    assert "no SMOKE_ARGS; add e.g." in text and "must send the output to '{out}'" in text
    assert "one folder deep" in text and "unknown declarations ['SMOKE_NEED_CUDA']" in text


def test_discover_refuses_a_folder_without_benches(tmp_path):
    with pytest.raises(smoke.SmokeDeclarationError, match="no bench_"):
        smoke.discover(_tree(tmp_path, {"zero/_parts.py": ""}))


def test_selected_picks_by_folder_path_or_stem_and_refuses_an_unknown_name(tmp_path):
    root = _tree(
        tmp_path,
        {"zero/bench_zero.py": OK_DECL, "zero/bench_gather.py": OK_DECL, "train/bench_t.py": OK_DECL},
    )
    smokes = smoke.discover(root)
    assert [s.name for s in smoke.selected(smokes, ["zero"])] == [
        "zero/bench_gather.py",
        "zero/bench_zero.py",
    ]
    assert [s.name for s in smoke.selected(smokes, ["train/bench_t.py", "bench_zero"])] == [
        "train/bench_t.py",
        "zero/bench_zero.py",
    ]
    assert len(smoke.selected(smokes, [])) == 3
    with pytest.raises(SystemExit, match="no bench matches"):
        smoke.selected(smokes, ["bench_gone"])


def _script(tmp_path: pathlib.Path, body: str, *, cuda: bool = False) -> smoke.Smoke:
    path = tmp_path / "topic" / "bench_x.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text("import json, os, pathlib, sys\nout = pathlib.Path(sys.argv[2])\n" + body)
    return smoke.Smoke(path, ("--out", "{out}"), needs_cuda=cuda)


def test_a_run_passes_on_exit_zero_with_a_json_from_a_scratch_folder(tmp_path):
    s = _script(tmp_path, '(out / "r.json").write_text(json.dumps({"cwd": os.getcwd()}))\n')
    assert smoke.run_one(s, tmp_path / "out", cuda=False, timeout=60) is None
    cwd = pathlib.Path(json.loads((tmp_path / "out" / "r.json").read_text())["cwd"])
    assert cwd != pathlib.Path.cwd() and not cwd.exists()  # a scratch folder, removed after the run


def test_a_relative_output_folder_means_the_callers_not_the_scratch_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = _script(tmp_path, '(out / "r.json").write_text("{}")\n')
    assert smoke.run_one(s, pathlib.Path("rel") / "out", cuda=False, timeout=60) is None
    assert (tmp_path / "rel" / "out" / "r.json").is_file()


def test_a_run_fails_on_a_nonzero_exit_or_without_a_json(tmp_path):
    assert (
        smoke.run_one(_script(tmp_path, "sys.exit(3)\n"), tmp_path / "a", cuda=False, timeout=60)
        == "exit status 3"
    )
    why = smoke.run_one(
        _script(tmp_path, '(out / "r.txt").write_text("x")\n'), tmp_path / "b", cuda=False, timeout=60
    )
    assert why is not None and why.startswith("exit 0 but no JSON written")
    # a JSON an earlier run left there does not count
    old = tmp_path / "c" / "old.json"
    old.parent.mkdir()
    old.write_text("{}")
    os.utime(old, (1.0e9, 1.0e9))
    why = smoke.run_one(_script(tmp_path, "pass\n"), tmp_path / "c", cuda=False, timeout=60)
    assert why is not None and why.startswith("exit 0 but no JSON written")


def test_a_cuda_bench_without_a_device_must_refuse_and_with_one_must_run(tmp_path):
    refusal = 'print("bench_x: cannot run here: no device", file=sys.stderr)\nsys.exit(2)\n'
    assert (
        smoke.run_one(_script(tmp_path, refusal, cuda=True), tmp_path / "a", cuda=False, timeout=60) is None
    )
    # exit 2 alone is what argparse gives for a bad option: not a refusal
    bad_option = 'print("usage: bench_x [-h]", file=sys.stderr)\nsys.exit(2)\n'
    why = smoke.run_one(_script(tmp_path, bad_option, cuda=True), tmp_path / "b", cuda=False, timeout=60)
    assert why is not None and "expected exit 2 and 'cannot run here'" in why
    ran = 'print("ran")\n'  # a run that succeeds where no refusal is due fails the refusal check
    why = smoke.run_one(_script(tmp_path, ran, cuda=True), tmp_path / "c", cuda=False, timeout=60)
    assert why is not None and "got exit 0" in why
    # with a device the refusal is a failure like any other exit status
    why = smoke.run_one(_script(tmp_path, refusal, cuda=True), tmp_path / "d", cuda=True, timeout=60)
    assert why == "exit status 2"


def test_a_hung_bench_is_killed_at_the_timeout(tmp_path):
    s = _script(tmp_path, "import time\ntime.sleep(120)\n")
    assert smoke.run_one(s, tmp_path / "out", cuda=False, timeout=1) == "still running after 1 s (killed)"


# ---- the real tree --------------------------------------------------------------------------------------------


def test_every_bench_in_the_tree_declares_a_smoke_run():
    scripts = sorted(p for p in BENCH.rglob("bench_*.py") if "tests" not in p.relative_to(BENCH).parts)
    assert len(scripts) >= 11, scripts  # the runner looks at the real folder
    found = smoke.discover(BENCH)
    assert [s.path for s in found] == [p.resolve() for p in scripts]
    assert [s.name for s in found if s.needs_cuda] == ["gpu/bench_fused_gpu.py"]


def _top_level_imports(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            names.append(node.module)
    return names


def test_every_script_imports_its_parts_through_the_bench_package():
    # a flat-era import (`import _machine`, `from _zero_parts import ...`) only works from the script's own folder
    modules = sorted(p for p in BENCH.rglob("*.py") if "tests" not in p.relative_to(BENCH).parts)
    flat = [
        (p.relative_to(BENCH).as_posix(), n)
        for p in modules
        for n in _top_level_imports(p)
        if n.startswith("_") and n != "__future__"
    ]
    assert flat == []
    needs_bootstrap = [
        p
        for p in modules
        if p.name.startswith("bench_")
        and any(n == "bench" or n.startswith("bench.") for n in _top_level_imports(p))
    ]
    assert len(needs_bootstrap) >= 9
    assert [p.relative_to(BENCH).as_posix() for p in needs_bootstrap if BOOTSTRAP not in p.read_text()] == []
