# SPDX-License-Identifier: Apache-2.0
"""Checks that the repository's Markdown names only files that exist, and that its two indexes are complete.

What counts as naming a file:

- a relative link or image (``[text](target)``), resolved against the page's folder; it must exist and stay inside
  the repository. The docs site serves ``benchmarks/results/`` as ``results/`` (``docs/hooks.py``), so a page under
  ``docs/`` may link ``results/<topic>/<plot>.png``;
- a word of an inline code span that starts with a top-level entry of the repository (``tools/bench/x.py``,
  ``benchmarks/results/``, ``noxfile.py``), resolved against the repository root; ``*`` globs must match something and ``{a,b}``
  alternatives are expanded; words with placeholders (``<x>``, ``$OUT``, ``…``) are skipped;
- a word of an inline code span that is the name of a committed result: a bare name
  (``cpu-2026-11-25-zero.json``) must be found somewhere under ``benchmarks/results/``, a path
  (``zero/cpu-2026-11-25-zero.json``) must exist below it (below the page's own folder on a page among the
  results);
- on pages that name files relative to themselves (``tools/bench/README.md`` its scripts,
  ``benchmarks/results/README.md`` its results), a word of an inline code span with one of the suffixes the caller
  gives, resolved against the page's folder.

Fenced code blocks are not read: they hold commands and examples, not references.
"""

from __future__ import annotations

import itertools
import pathlib
import re

__all__ = [
    "RESULTS",
    "BENCH",
    "code_words",
    "link_targets",
    "missing_references",
    "unlisted_bench_folders",
    "unlisted_bench_scripts",
    "unlisted_results",
]

#: the committed results and the benchmark scripts, relative to the repository root
RESULTS = pathlib.PurePosixPath("benchmarks/results")
BENCH = pathlib.PurePosixPath("tools/bench")
#: what the docs site serves under another name (docs/hooks.py): site path prefix -> repository folder
_DOCS_SERVED = {"results/": RESULTS}

_FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1", re.DOTALL | re.MULTILINE)
_CODE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_RESULT_NAME = re.compile(
    r"^(?:cpu|gpu|asan|sigabrt)-[\w.-]*\d{4}-\d{2}-\d{2}[\w.-]*\.(?:json|png|md|log|xml|txt)$"
)
_PLACEHOLDER = re.compile(r"[<>$\[\]…]")
_TRAILING = ".,;:)"


def _without_fences(text: str) -> str:
    return _FENCE.sub("", text)


def code_words(text: str) -> list[str]:
    """The whitespace-separated words of every inline code span outside fenced blocks, in order."""
    return [word for span in _CODE.findall(_without_fences(text)) for word in span.split()]


def link_targets(text: str) -> list[str]:
    """The targets of every Markdown link and image outside fenced blocks, without their ``#anchor``."""
    found = []
    for target in _LINK.findall(_without_fences(text)):
        path = target.split("#", 1)[0]
        if path:
            found.append(path)
    return found


def _expand_braces(word: str) -> list[str]:
    parts = re.split(r"\{([^{}]*)\}", word)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(combo) for combo in itertools.product(*choices)]


def _exists(base: pathlib.Path, word: str) -> bool:
    for candidate in _expand_braces(word.rstrip(_TRAILING)):
        if "*" in candidate or "?" in candidate:
            if not any(base.glob(candidate)):
                return False
        elif not (base / candidate).exists():
            return False
    return True


def _ignored_folders(root: pathlib.Path) -> set[str]:
    """Top-level folders ``.gitignore`` names (``build/``, ``/demo-out/``): build outputs, present or not."""
    ignore = root / ".gitignore"
    lines = ignore.read_text(encoding="utf-8").splitlines() if ignore.is_file() else []
    return {
        line.strip().strip("/")
        for line in lines
        if line.strip().endswith("/") and "/" not in line.strip().strip("/") and "*" not in line
    }


def _top_level(root: pathlib.Path) -> set[str]:
    """The repository's own top-level entries: a page naming ``build/...`` names a build output, not a file."""
    skip = {".git", ".nox"} | _ignored_folders(root)
    return {entry.name for entry in root.iterdir() if entry.name not in skip}


def missing_references(
    root: pathlib.Path, page: pathlib.Path, *, relative_suffixes: tuple[str, ...] = ()
) -> list[str]:
    """Everything ``page`` (a Markdown file under ``root``) names that does not exist, or links outside ``root``.

    ``relative_suffixes``: the page also names files with these suffixes by their path relative to its own folder
    (see the module docstring). Returns one readable line per problem, empty when there is none.
    """
    root = root.resolve()
    folder = page.resolve().parent
    rel_page = page.resolve().relative_to(root)
    text = page.read_text(encoding="utf-8")
    problems = []
    for target in link_targets(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        served = next((p for p in _DOCS_SERVED if target.startswith(p)), None)
        if served is not None and rel_page.parts[0] == "docs":
            resolved = (root / _DOCS_SERVED[served] / target[len(served) :]).resolve()
        else:
            resolved = (folder / target).resolve()
        if not resolved.is_relative_to(root):
            problems.append(f"{rel_page}: links {target!r}, which is outside the repository")
        elif not resolved.exists():
            problems.append(f"{rel_page}: links {target!r}, which does not exist")
    tops = _top_level(root)
    results = (
        {p.name for p in (root / RESULTS).rglob("*") if p.is_file()} if (root / RESULTS).is_dir() else set()
    )
    # a result's path is relative to the page's folder on a page among the results, else to the results folder
    in_results = rel_page.is_relative_to(RESULTS)
    results_base = folder if in_results else root / RESULTS
    for word in code_words(text):
        if _PLACEHOLDER.search(word) or "://" in word:
            continue
        # `file.py:function` (or a C++/CUDA `file.cpp:function`) names the file
        bare = re.sub(r"(\.(?:py|cpp|cu|h)):[\w.]+$", r"\1", word.rstrip(_TRAILING))
        if bare.split("/", 1)[0] in tops:
            if not _exists(root, bare):
                problems.append(f"{rel_page}: names `{bare}`, which does not exist")
        elif _RESULT_NAME.match(bare.rsplit("/", 1)[-1]):
            if "/" in bare and not _exists(results_base, bare):
                where = (results_base / bare).resolve().relative_to(root)
                problems.append(f"{rel_page}: names the result `{bare}`, which is not {where}")
            elif "/" not in bare and bare not in results:
                problems.append(f"{rel_page}: names the result `{bare}`, which is not under {RESULTS}/")
        elif relative_suffixes and bare.endswith(relative_suffixes):
            if not _exists(folder, bare):
                problems.append(f"{rel_page}: names `{bare}` (relative to its folder), which does not exist")
    return problems


def _named_in(page: pathlib.Path) -> set[str]:
    return {word.rstrip(_TRAILING) for word in code_words(page.read_text(encoding="utf-8"))}


def unlisted_bench_folders(root: pathlib.Path) -> list[str]:
    """The folders under ``tools/bench/`` that hold Python files and that its README does not name as ``folder/``.

    The benches live in topic folders (``zero/``, ``train/``, ...); each gets a line in the README's layout.
    """
    bench = root / BENCH
    named = _named_in(bench / "README.md")
    folders = sorted(
        {
            p.parent.relative_to(bench).as_posix() + "/"
            for p in bench.rglob("*.py")
            if p.parent != bench and "__pycache__" not in p.parts
        }
    )
    return [folder for folder in folders if folder not in named]


def unlisted_bench_scripts(root: pathlib.Path) -> list[str]:
    """The Python files under ``tools/bench/`` and its folders (their path relative to it) that its README does
    not name.

    Tests and ``__init__.py`` files are not scripts and need no line.
    """
    bench = root / BENCH
    named = _named_in(bench / "README.md")
    scripts = sorted(
        p.relative_to(bench).as_posix()
        for p in bench.rglob("*.py")
        if "tests" not in p.relative_to(bench).parts
        and p.name != "__init__.py"
        and p.name != "conftest.py"
        and not p.name.startswith("test_")
        and "__pycache__" not in p.parts
    )
    return [name for name in scripts if name not in named]


def unlisted_results(root: pathlib.Path) -> list[str]:
    """The files under ``benchmarks/results/`` (their path relative to it) that its ``README.md`` does not name."""
    results = root / RESULTS
    named = _named_in(results / "README.md")
    files = sorted(p.relative_to(results).as_posix() for p in results.rglob("*") if p.is_file())
    return [name for name in files if name != "README.md" and name not in named]
