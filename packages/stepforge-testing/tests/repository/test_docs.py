# SPDX-License-Identifier: Apache-2.0
"""The repository's Markdown names only files that exist and links nothing outside the repository;
tools/bench/README.md lists every bench script and benchmarks/results/README.md every committed result. First
the checker on small made-up trees (it must find what it claims to), then the real tree."""

from __future__ import annotations

import os
import pathlib

import pytest

from stepforge.testing import repo_docs

ROOT = pathlib.Path(os.environ.get("STEPFORGE_SOURCE_ROOT") or pathlib.Path(__file__).resolve().parents[4])

#: the suffixes of files benchmarks/results/README.md names relative to its own folder
RESULT_SUFFIXES = (".json", ".png", ".md", ".txt", ".log", ".xml")


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_checker_finds_a_missing_code_path_and_a_missing_link(tmp_path):
    root = _tree(
        tmp_path,
        {
            "tools/run.py": "",
            "tools/k.cpp": "",
            "docs/guide.md": "",
            "README.md": (
                "Run `python tools/run.py --fast` and `tools/gone.py`; read [the guide](docs/guide.md) and "
                "[old notes](docs/old.md#top); `tools/run.py:main` and `tools/lost.py:Runner.go`; "
                "`tools/k.cpp:adam` and `tools/gone.cpp:adam`.\n"
            ),
        },
    )
    assert repo_docs.missing_references(root, root / "README.md") == [
        "README.md: links 'docs/old.md', which does not exist",
        "README.md: names `tools/gone.py`, which does not exist",
        "README.md: names `tools/lost.py`, which does not exist",
        "README.md: names `tools/gone.cpp`, which does not exist",
    ]


def test_checker_does_not_take_build_outputs_for_repository_files(tmp_path):
    # build/ is ignored: whether a build left build/x behind must not decide whether the page is right
    root = _tree(
        tmp_path,
        {
            ".gitignore": "__pycache__/\nbuild/\n/demo-out/\n",
            "build/fused-wheels/x.whl": "",
            "README.md": "Outputs land in `build/asan-*` and `demo-out/loss.png`; sources in `tools/gone.py`.\n",
            "tools/run.py": "",
        },
    )
    assert repo_docs.missing_references(root, root / "README.md") == [
        "README.md: names `tools/gone.py`, which does not exist"
    ]


def test_checker_refuses_a_link_outside_the_repository(tmp_path):
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "design.md").write_text("")
    root = _tree(tmp_path / "repo", {"README.md": "Contracts: [design](../shared/design.md).\n"})
    assert repo_docs.missing_references(root, root / "README.md") == [
        "README.md: links '../shared/design.md', which is outside the repository"
    ]


def test_checker_skips_fences_placeholders_and_urls_and_expands_globs_and_braces(tmp_path):
    root = _tree(
        tmp_path,
        {
            "benchmarks/results/zero/cpu-2026-01-02-zero.json": "{}",
            "benchmarks/results/zero/cpu-2026-01-02-gather.json": "{}",
            "README.md": (
                "```bash\npython tools/missing.py\n```\n"
                "`packages/<x>/src`, `$OUT/run.log`, [site](https://example.org/a.md), "
                "`benchmarks/results/zero/cpu-2026-01-02-{zero,gather}.json`, `benchmarks/results/zero/*.json`, "
                "`cpu-2026-01-02-zero.json`.\n"
            ),
        },
    )
    assert repo_docs.missing_references(root, root / "README.md") == []
    (root / "README.md").write_text(
        "`benchmarks/results/zero/*.png`, `cpu-2026-01-03-zero.json`, `zero/cpu-2026-01-02-zero.json`, "
        "`train/cpu-2026-01-02-zero.json`\n"
    )
    assert repo_docs.missing_references(root, root / "README.md") == [
        "README.md: names `benchmarks/results/zero/*.png`, which does not exist",
        "README.md: names the result `cpu-2026-01-03-zero.json`, which is not under benchmarks/results/",
        "README.md: names the result `train/cpu-2026-01-02-zero.json`, which is not "
        "benchmarks/results/train/cpu-2026-01-02-zero.json",
    ]


def test_checker_resolves_the_docs_sites_results_folder_and_relative_names(tmp_path):
    root = _tree(
        tmp_path,
        {
            "benchmarks/results/zero/plot.png": "",
            "docs/perf.md": "![plot](results/zero/plot.png) ![gone](results/zero/gone.png)\n",
            "tools/bench/bench_a.py": "",
            "tools/bench/README.md": "`bench_a.py`, `bench_b.py`, `COMMIT.json`\n",
        },
    )
    assert repo_docs.missing_references(root, root / "docs" / "perf.md") == [
        "docs/perf.md: links 'results/zero/gone.png', which does not exist"
    ]
    assert repo_docs.missing_references(root, root / "tools/bench/README.md", relative_suffixes=(".py",)) == [
        "tools/bench/README.md: names `bench_b.py` (relative to its folder), which does not exist"
    ]


def test_a_page_among_the_results_names_results_relative_to_its_folder(tmp_path):
    root = _tree(
        tmp_path,
        {
            "benchmarks/results/gpu-runs/logs/gpu-2026-01-02-run.log": "",
            "benchmarks/results/demo/gpu-2026-01-02-demo.json": "{}",
            "benchmarks/results/gpu-runs/report.md": (
                "`logs/gpu-2026-01-02-run.log`, `../demo/gpu-2026-01-02-demo.json`, `gpu-runs/gpu-2026-01-02-run.log`\n"
            ),
        },
    )
    assert repo_docs.missing_references(root, root / "benchmarks/results/gpu-runs/report.md") == [
        "benchmarks/results/gpu-runs/report.md: names the result `gpu-runs/gpu-2026-01-02-run.log`, which is not "
        "benchmarks/results/gpu-runs/gpu-runs/gpu-2026-01-02-run.log"
    ]


def test_checker_finds_unlisted_bench_scripts_and_results(tmp_path):
    root = _tree(
        tmp_path,
        {
            "tools/bench/README.md": "| `bench_a.py` | a |\n| `zero/bench_z.py`, `_helper.py` | z |\n",
            "tools/bench/bench_a.py": "",
            "tools/bench/_helper.py": "",
            "tools/bench/zero/bench_z.py": "",
            "tools/bench/zero/_parts.py": "",
            "tools/bench/bench_new.py": "",
            "tools/bench/tests/test_bench_a.py": "",
            "benchmarks/results/README.md": "`zero/a.json`, `zero/logs/a.log`\n",
            "benchmarks/results/zero/a.json": "{}",
            "benchmarks/results/zero/logs/a.log": "",
            "benchmarks/results/zero/b.png": "",
        },
    )
    assert repo_docs.unlisted_bench_scripts(root) == ["bench_new.py", "zero/_parts.py"]
    assert repo_docs.unlisted_results(root) == ["zero/b.png"]


def test_checker_finds_bench_folders_the_readme_does_not_name(tmp_path):
    root = _tree(
        tmp_path,
        {
            "tools/bench/README.md": "| `zero/` | the schemes |\n| `zero/bench_z.py`, `train` | z |\n",
            "tools/bench/__init__.py": "",
            "tools/bench/smoke.py": "",
            "tools/bench/zero/bench_z.py": "",
            "tools/bench/train/bench_t.py": "",
            "tools/bench/train/parts/_p.py": "",
            "tools/bench/tests/test_t.py": "",
            "tools/bench/notes/README.md": "",
        },
    )
    # `train` without its slash is not a folder line; a folder with no Python file needs none
    assert repo_docs.unlisted_bench_folders(root) == ["tests/", "train/", "train/parts/"]


# ---- the real tree --------------------------------------------------------------------------------------------

PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "tools" / "gpu" / "README.md",
        *(ROOT / "docs").rglob("*.md"),
        *(ROOT / "packages").glob("*/README.md"),
        *(ROOT / "examples").rglob("README.md"),
        *(p for p in (ROOT / "benchmarks" / "results").rglob("*.md") if p.name != "README.md"),
    ],
)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_names_only_files_that_exist(page):
    assert repo_docs.missing_references(ROOT, page) == []


def test_bench_readme_names_only_files_that_exist():
    page = ROOT / "tools" / "bench" / "README.md"
    assert repo_docs.missing_references(ROOT, page, relative_suffixes=(".py",)) == []


def test_bench_readme_lists_every_bench_script_and_folder():
    scripts = sorted((ROOT / "tools" / "bench").rglob("bench_*.py"))
    assert len(scripts) >= 10, scripts  # the checker looks at the real folder
    assert len({p.parent for p in scripts}) >= 6, scripts  # ... and into its topic folders
    assert repo_docs.unlisted_bench_scripts(ROOT) == []
    assert repo_docs.unlisted_bench_folders(ROOT) == []


def test_results_index_names_only_files_that_exist():
    page = ROOT / "benchmarks" / "results" / "README.md"
    assert repo_docs.missing_references(ROOT, page, relative_suffixes=RESULT_SUFFIXES) == []


def test_results_index_lists_every_result():
    assert len(list((ROOT / "benchmarks" / "results").rglob("*.json"))) >= 30
    assert repo_docs.unlisted_results(ROOT) == []


def test_readme_links_into_the_repository_only():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [t for t in repo_docs.link_targets(text) if "://" not in t]
    assert targets, "the README links nothing: the checker reads the wrong file"
    outside = [t for t in targets if not (ROOT / t).resolve().is_relative_to(ROOT.resolve())]
    assert outside == []
