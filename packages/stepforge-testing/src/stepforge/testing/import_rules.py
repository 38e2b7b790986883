# SPDX-License-Identifier: Apache-2.0
"""Static import rules of the monorepo, read from the ``ast`` of every module under ``packages/*/src``.

Four rules (design §1), each reported as plain-text violations that name the file and line:

- **No import circle inside a package.** Module-level, function-level and ``TYPE_CHECKING`` imports all count:
  a circle broken only by deferring an import is still two modules that need each other. Importing
  ``a.b.c`` also imports the package ``a.b`` (its ``__init__``) unless the importer already lives in it, so
  that edge counts too.
- **No private module of another stepforge package.** ``stepforge.zero`` may not import
  ``stepforge.strategy._env`` nor ``from stepforge.strategy import _env``; any name with a leading underscore
  (dunders excepted) below another package is private.
- **torch private APIs only in** :data:`TORCH_COMPAT_MODULE` (the package and its modules): an import of
  ``torch.x._y`` or of a ``_name`` from a torch module, an attribute ``._name`` reached from a name bound to
  torch (``torch``, ``dist``, ``nn``, an imported torch class...), and the torch-internal attribute names of
  :data:`TORCH_PRIVATE_ATTRIBUTES` on any object (also as strings in ``getattr``/``hasattr``/``setattr``).
  ``torch._foreach_*`` is allowed: it is torch's documented multi-tensor API (torch docs, "Foreach
  Operations"), used by ``torch.optim`` itself.
- **Only declared siblings** (:func:`undeclared_imports`): a package imports another stepforge package only
  when its ``pyproject.toml`` lists it in ``[project].dependencies``.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
import tomllib
from collections.abc import Iterable, Iterator

__all__ = [
    "TORCH_COMPAT_MODULE",
    "TORCH_PRIVATE_ATTRIBUTES",
    "ImportEdge",
    "Module",
    "collect_modules",
    "import_cycles",
    "import_edges",
    "private_cross_imports",
    "torch_private_uses",
    "violations",
]

#: The one package allowed to use torch private APIs (its modules included: one per area of torch).
TORCH_COMPAT_MODULE = "stepforge.core.torch_compat"

#: torch-internal attributes reached on objects whose type the ``ast`` cannot see (DTensor, FSDP2 state and
#: parameters, tensor views). Any ``obj.<name>`` or ``getattr(obj, "<name>")`` outside the compat module is a
#: violation, whatever ``obj`` is (``self``/``cls`` excepted: a class may define its own ``_base``).
TORCH_PRIVATE_ATTRIBUTES = frozenset(
    {
        "_local_tensor",
        "_spec",
        "_get_fsdp_state",
        "_fsdp_param_group",
        "_fsdp_params",
        "_unsharded_param",
        "_sharded_param_data",
        "_orig_size",
        "_base",
        "_composable",
        "_NormBase",
        "_nested_dict",
    }
)

_PROBES = {"getattr", "hasattr", "setattr", "delattr"}


@dataclasses.dataclass(frozen=True)
class Module:
    """One source module: dotted ``name`` (``stepforge.zero.low_level``), its ``path`` and ``is_package``."""

    name: str
    path: pathlib.Path
    is_package: bool

    @property
    def package(self) -> str:
        """The distribution's import package, ``stepforge.<x>``."""
        return ".".join(self.name.split(".")[:2])


@dataclasses.dataclass(frozen=True)
class ImportEdge:
    """``source`` imports ``target`` at ``line``; ``deferred`` when the import sits inside a function."""

    source: str
    target: str
    path: pathlib.Path
    line: int
    deferred: bool

    def describe(self, root: pathlib.Path | None = None) -> str:
        where = self.path.relative_to(root) if root is not None else self.path
        kind = "function-level" if self.deferred else "module-level"
        return f"{self.source} -> {self.target} ({where}:{self.line}, {kind})"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def collect_modules(root: pathlib.Path) -> dict[str, Module]:
    """Every ``*.py`` below ``root/packages/*/src/stepforge/``, by dotted name."""
    modules: dict[str, Module] = {}
    for path in sorted(root.glob("packages/*/src/stepforge/**/*.py")):
        src = next(p for p in path.parents if p.name == "src")
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        modules[".".join(parts)] = Module(".".join(parts), path, is_package)
    if not modules:
        raise FileNotFoundError(
            f"no module under {root}/packages/*/src/stepforge: is root the repository root?"
        )
    return modules


def _parse(module: Module) -> ast.Module:
    return ast.parse(module.path.read_text(encoding="utf-8"), filename=str(module.path))


def _line(node: ast.AST) -> int:
    """The line of an import statement or an expression (the only nodes reported here)."""
    assert isinstance(node, ast.stmt | ast.expr), node
    return node.lineno


def _walk(tree: ast.AST, deferred: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    """Every node with whether it sits inside a function body."""
    for child in ast.iter_child_nodes(tree):
        yield child, deferred
        inner = deferred or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield from _walk(child, inner)


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imported_names(module: Module, node: ast.AST) -> list[str]:
    """The dotted names an import statement binds or loads (a module, or ``module.attribute``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = _absolute(module, node)
        return [f"{base}.{alias.name}" if alias.name != "*" else base for alias in node.names]
    return []


def import_edges(modules: dict[str, Module]) -> list[ImportEdge]:
    """Edges between the stepforge modules of ``modules`` (imports of anything else are left out)."""
    edges: list[ImportEdge] = []
    for module in modules.values():
        own_packages = {module.name} | {
            ".".join(module.name.split(".")[:i]) for i in range(1, module.name.count(".") + 1)
        }
        for node, deferred in _walk(_parse(module)):
            for dotted in _imported_names(module, node):
                if not dotted.startswith("stepforge."):
                    continue
                parts = dotted.split(".")
                targets = {".".join(parts[:i]) for i in range(2, len(parts) + 1)}
                for target in sorted(t for t in targets if t in modules and t not in own_packages):
                    edges.append(ImportEdge(module.name, target, module.path, _line(node), deferred))
    # ``from .a import x, y`` names the module once per name: one edge per statement
    return list(dict.fromkeys(edges))


def _strongly_connected(nodes: Iterable[str], succ: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(succ.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(succ.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def import_cycles(modules: dict[str, Module], edges: list[ImportEdge]) -> list[list[ImportEdge]]:
    """Per import circle inside one package: the edges between its modules."""
    inside = [e for e in edges if modules[e.source].package == modules[e.target].package]
    succ: dict[str, set[str]] = {}
    for edge in inside:
        succ.setdefault(edge.source, set()).add(edge.target)
    cycles = []
    for component in _strongly_connected(modules, succ):
        members = set(component)
        cycles.append([e for e in inside if e.source in members and e.target in members])
    return cycles


def private_cross_imports(modules: dict[str, Module]) -> list[ImportEdge]:
    """Imports of a private name (module or attribute) below another stepforge package."""
    found = []
    for module in modules.values():
        for node, deferred in _walk(_parse(module)):
            for dotted in _imported_names(module, node):
                parts = dotted.split(".")
                if parts[0] != "stepforge" or len(parts) < 3 or ".".join(parts[:2]) == module.package:
                    continue
                private = [i for i, p in enumerate(parts) if i >= 2 and _is_private(p)]
                if private:  # named up to its first private part: the module (or name) it must not touch
                    target = ".".join(parts[: private[0] + 1])
                    found.append(ImportEdge(module.name, target, module.path, _line(node), deferred))
    return found


def _torch_aliases(tree: ast.Module) -> set[str]:
    """Names bound anywhere in the module to torch or to something imported from a torch module."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch" or alias.name.startswith("torch."):
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "torch" or node.module.startswith("torch."):
                names.update(alias.asname or alias.name for alias in node.names)
    return names


def _attribute_chain(node: ast.Attribute) -> tuple[str | None, list[str]]:
    attrs = []
    cur: ast.AST = node
    while isinstance(cur, ast.Attribute):
        attrs.append(cur.attr)
        cur = cur.value
    return (cur.id if isinstance(cur, ast.Name) else None), attrs[::-1]


def _allowed_torch_private(root: str, attrs: list[str]) -> bool:
    # torch._foreach_*: documented (beta) multi-tensor API, see the module docstring
    return root == "torch" and len(attrs) >= 1 and attrs[0].startswith("_foreach_")


def torch_private_uses(modules: dict[str, Module]) -> list[str]:
    """Uses of torch private APIs outside :data:`TORCH_COMPAT_MODULE`, as ``"path:line: what"``."""
    found = []
    for module in modules.values():
        if module.name == TORCH_COMPAT_MODULE or module.name.startswith(TORCH_COMPAT_MODULE + "."):
            continue
        tree = _parse(module)
        aliases = _torch_aliases(tree)
        for node in ast.walk(tree):
            what = None
            if isinstance(node, ast.Import):
                bad = [a.name for a in node.names if a.name.split(".")[0] == "torch"]
                bad = [n for n in bad if any(_is_private(p) for p in n.split("."))]
                what = f"import {', '.join(bad)}" if bad else None
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] == "torch":
                    private_module = any(_is_private(p) for p in node.module.split("."))
                    names = [a.name for a in node.names if _is_private(a.name)]
                    if private_module or names:
                        what = f"from {node.module} import {', '.join(a.name for a in node.names)}"
            elif isinstance(node, ast.Attribute):
                root, attrs = _attribute_chain(node)
                if (
                    root in aliases
                    and isinstance(node.ctx, ast.Load | ast.Store | ast.Del)
                    and _is_private(node.attr)
                    and not _allowed_torch_private(root, attrs)
                ):
                    what = f"{root}.{'.'.join(attrs)}"
                elif node.attr in TORCH_PRIVATE_ATTRIBUTES and root not in {"self", "cls"}:
                    what = f"attribute .{node.attr}"
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _PROBES:
                if (
                    len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in TORCH_PRIVATE_ATTRIBUTES
                ):
                    what = f"{node.func.id}(..., {node.args[1].value!r})"
            if what is not None:
                found.append(f"{module.name} ({module.path}:{_line(node)}): {what}")
    # an Attribute chain a.b._c is visited at each level: report each line and use once
    return list(dict.fromkeys(found))


def violations(root: pathlib.Path) -> dict[str, list[str]]:
    """Every violation of the three rules below ``root`` (the repository root), by rule."""
    root = root.resolve()
    modules = collect_modules(root)
    edges = import_edges(modules)
    cycles = [
        "import circle: " + "; ".join(e.describe(root) for e in cycle)
        for cycle in import_cycles(modules, edges)
    ]
    private = [e.describe(root) for e in private_cross_imports(modules)]
    torch_private = [line.replace(str(root) + "/", "") for line in torch_private_uses(modules)]
    return {"cycles": cycles, "private_imports": private, "torch_privates": torch_private}


def declared_packages(root: pathlib.Path) -> dict[str, set[str]]:
    """``{"stepforge.strategy": {"stepforge.core", "stepforge.accum"}, ...}``: the stepforge packages each
    distribution's ``pyproject.toml`` lists in ``[project].dependencies`` (runtime; not test or optional groups)."""
    declared: dict[str, set[str]] = {}
    for pyproject in sorted(root.glob("packages/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
        own = "stepforge." + project["name"].removeprefix("stepforge-")
        names = (re.split(r"[\s<>=!~;\[]", dep, maxsplit=1)[0] for dep in project.get("dependencies", []))
        declared[own] = {
            "stepforge." + n.removeprefix("stepforge-") for n in names if n.startswith("stepforge-")
        }
    return declared


def undeclared_imports(root: pathlib.Path) -> list[str]:
    """Every import of a sibling stepforge package that the importer's ``pyproject.toml`` does not declare as a
    runtime dependency (``TYPE_CHECKING`` and function-level imports included: each is a dependency too)."""
    root = root.resolve()
    modules = collect_modules(root)
    declared = declared_packages(root)
    found = []
    for edge in import_edges(modules):
        source, target = modules[edge.source].package, modules[edge.target].package
        if source != target and target not in declared.get(source, set()):
            found.append(f"{edge.describe(root)}: {target} is not a dependency of {source}")
    return found
