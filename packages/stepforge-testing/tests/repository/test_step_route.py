# SPDX-License-Identifier: Apache-2.0
"""The step routes of docs/design.md ("The step route"): every ``file:function`` exists, a route has at most 10
files and enters none twice, and its accum, strategy and zero part has at most 6. First the parser and the checks
on made-up routes (they must find what they claim to), then the document's."""

from __future__ import annotations

import ast
import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(os.environ.get("STEPFORGE_SOURCE_ROOT") or pathlib.Path(__file__).resolve().parents[4])

MAX_FILES = 10
MAX_ACCUM_STRATEGY_ZERO = 6
_BLOCK = re.compile(r"<!-- route: (?P<name>[\w-]+) -->\n(?P<body>.*?)<!-- /route -->", re.S)
_ITEM = re.compile(r"^\d+\. `(?P<path>[^`:]+):(?P<function>[\w.:]+)`", re.M)


def routes(text: str) -> dict[str, list[tuple[str, str]]]:
    """``{name: [(file, qualified function), ...]}`` of every ``<!-- route: name -->`` block, in order."""
    return {
        m["name"]: [(i["path"], i["function"]) for i in _ITEM.finditer(m["body"])]
        for m in _BLOCK.finditer(text)
    }


def defines(source: str, qualname: str, *, python: bool = True) -> bool:
    """Whether ``source`` defines ``qualname`` (``func`` or ``Class.method``, classes nested as deep as named); in
    C++ (``python=False``) whether the last part is a function defined there (a type, ``name(...)``, then its
    body; a call is not a definition)."""
    if not python:
        name = re.escape(qualname.split(".")[-1].split("::")[-1])
        definition = rf"\w[*&>]?\s+{name}\s*\([^;{{}}]*\)\s*(const\s*)?(noexcept\s*)?\{{"
        return re.search(definition, source) is not None
    scope: list[ast.stmt] = ast.parse(source).body
    for part in qualname.split("."):
        found = [n for n in scope if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name == part]
        if not found:
            return False
        scope = found[0].body if isinstance(found[0], ast.ClassDef) else []
    return True


def route_problems(route: list[tuple[str, str]], root: pathlib.Path) -> list[str]:
    """What is wrong with one route: missing files or functions, a file entered twice, too many files."""
    problems = []
    files = [path for path, _ in route]
    for path, function in route:
        file = root / path
        if not file.is_file():
            problems.append(f"{path}: no such file")
        elif not defines(file.read_text(encoding="utf-8"), function, python=file.suffix == ".py"):
            problems.append(f"{path}: defines no {function}")
    twice = sorted({f for f in files if files.count(f) > 1})
    if twice:
        problems.append(f"entered twice: {twice}")
    if len(set(files)) > MAX_FILES:
        problems.append(f"{len(set(files))} files, more than {MAX_FILES}")
    inner = {f for f in files if re.match(r"packages/stepforge-(accum|strategy|zero)/", f)}
    if len(inner) > MAX_ACCUM_STRATEGY_ZERO:
        problems.append(f"{len(inner)} accum/strategy/zero files, more than {MAX_ACCUM_STRATEGY_ZERO}")
    return problems


def _made_up(tmp_path: pathlib.Path) -> pathlib.Path:
    (tmp_path / "a.py").write_text("class A:\n    def step(self): ...\n\ndef helper(): ...\n")
    return tmp_path


def test_parser_reads_every_block_in_order():
    text = "x\n<!-- route: one -->\n1. `a.py:A.step`: text\n2. `b.py:f` → kernel\n<!-- /route -->\n"
    text += "<!-- route: two -->\n1. `c.py:g`\n<!-- /route -->\n"
    assert routes(text) == {"one": [("a.py", "A.step"), ("b.py", "f")], "two": [("c.py", "g")]}


@pytest.mark.parametrize(
    ("route", "expected"),
    [
        ([("a.py", "A.step"), ("a.py", "helper")], "entered twice: ['a.py']"),
        ([("a.py", "A.zero_grad")], "a.py: defines no A.zero_grad"),
        ([("a.py", "step")], "a.py: defines no step"),
        ([("gone.py", "f")], "gone.py: no such file"),
    ],
)
def test_checks_find_what_they_claim(tmp_path, route, expected):
    assert expected in route_problems(route, _made_up(tmp_path))


def test_a_cpp_entry_is_found_by_its_definition_not_a_call(tmp_path):
    (tmp_path / "k.cpp").write_text("static void adam_step(float* p, int n) {\n  helper(p);\n}\n")
    assert route_problems([("k.cpp", "adam_step")], tmp_path) == []
    assert route_problems([("k.cpp", "helper")], tmp_path) == ["k.cpp: defines no helper"]


def test_checks_count_files(tmp_path):
    root = _made_up(tmp_path)
    many = []
    for i in range(11):
        (root / f"m{i}.py").write_text("def f(): ...\n")
        many.append((f"m{i}.py", "f"))
    assert "11 files, more than 10" in route_problems(many, root)
    inner = []
    for i in range(7):
        path = root / f"packages/stepforge-zero/z{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("def f(): ...\n")
        inner.append((f"packages/stepforge-zero/z{i}.py", "f"))
    assert "7 accum/strategy/zero files, more than 6" in route_problems(inner, root)
    assert route_problems([("a.py", "A.step"), ("a.py", "helper")][:1], root) == []


def test_the_design_document_routes_hold():
    found = routes((ROOT / "docs" / "design.md").read_text(encoding="utf-8"))
    assert set(found) == {"strategy-zero2-cpuadam", "booster-ddp-fusedadam"}
    for name, route in found.items():
        assert route, f"route {name} lists nothing"
        assert route_problems(route, ROOT) == [], name
