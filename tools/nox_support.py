# SPDX-License-Identifier: Apache-2.0
"""What the sessions in noxfile.py share: the package graph, the shared torch base venv, the cached stepforge-fused
wheel, pytest with the root config, the disk guard around CI sessions, and the wheel's build defines.

noxfile.py holds the sessions themselves and imports this module (it puts tools/ on ``sys.path``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import platform
import shutil
import tomllib
from collections.abc import Callable
from typing import Any

import nox

__all__ = [
    "COMPILERS",
    "CONSTRAINTS",
    "CPU_BUILD",
    "LOCAL_WHEEL_DEFINES",
    "PACKAGES",
    "PYTHON",
    "ROOT",
    "all_packages",
    "ci_session",
    "closure",
    "fused_wheel",
    "guarded_session",
    "install_fused_cuda",
    "install_packages",
    "is_pure",
    "package_modules",
    "package_paths",
    "run_pytest",
    "test_group",
    "use_torch_base",
]

ROOT = pathlib.Path(__file__).parent.parent
CONSTRAINTS = ("-c", str(ROOT / "constraints" / "cpu.txt"))
#: the Python of every session unless it says otherwise (the only one installed on the project's machine)
PYTHON = "3.11"
# Order matters only for readability: core first, the private test helpers last.
PACKAGES = (
    "stepforge-core",
    "stepforge-optim",
    "stepforge-fused",
    "stepforge-zero",
    "stepforge-accum",
    "stepforge-strategy",
    "stepforge-mmengine",
    "stepforge-testing",
)


# ---- the package graph -----------------------------------------------------------------------------------------


def _pyproject(package: str) -> dict[str, Any]:
    return tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())


def _local_requirements(package: str) -> list[str]:
    """The stepforge distributions ``package`` needs to run its tests: its dependencies and its test group."""
    meta = _pyproject(package)
    names = list(meta["project"].get("dependencies", []))
    names += [r for r in meta.get("dependency-groups", {}).get("test", []) if isinstance(r, str)]
    out = []
    for req in names:
        name = req.split(";")[0].split("[")[0]
        for sep in "<>=!~ ":
            name = name.split(sep)[0]
        if name.startswith("stepforge-") and name in PACKAGES:
            out.append(name)
    return out


def closure(package: str) -> list[str]:
    """``package`` and every local sibling it needs, transitively."""
    seen: list[str] = []
    todo = [package]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.append(name)
            todo.extend(_local_requirements(name))
    return seen


def test_group(package: str) -> list[str]:
    """The third-party requirements of ``package``'s ``test`` dependency group."""
    group = _pyproject(package).get("dependency-groups", {}).get("test", [])
    return [r for r in group if isinstance(r, str) and not r.startswith("stepforge-")]


def all_packages() -> list[str]:
    """Every distribution under packages/ (new ones included), in PACKAGES order first."""
    found = sorted(p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml"))
    return [p for p in PACKAGES if p in found] + [p for p in found if p not in PACKAGES]


def is_pure(package: str) -> bool:
    """Whether ``package`` builds a pure-Python wheel (every build backend but stepforge-fused's)."""
    return bool(_pyproject(package)["build-system"]["build-backend"] != "scikit_build_core.build")


def package_modules() -> dict[pathlib.Path, list[pathlib.Path]]:
    """Each package folder under packages/ -> the import packages in its ``src/stepforge/`` (namespace pkg)."""
    found = {}
    for folder in sorted(p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file()):
        src = folder / "src" / "stepforge"
        found[folder] = (
            sorted(d for d in src.iterdir() if (d / "__init__.py").is_file()) if src.is_dir() else []
        )
    return found


# ---- shared pieces of a CI run ---------------------------------------------------------------------------------
# Installing torch into a fresh venv costs 22-30 s on the 2-core machine and compiling stepforge-fused (16
# translation units) about 45 s; a CI run used to do both in nearly every session. Both are now done once per
# content: torch and numpy live in one base environment that the sessions see through a .pth file (pip finds them
# there, so each session still resolves its packages against the pinned torch), and the CPU wheel of
# stepforge-fused is built once per source tree and installed by every session that needs it.
FUSED = ROOT / "packages" / "stepforge-fused"
BASE_PACKAGES = ("torch", "numpy")

# The CPU test sessions build stepforge-fused without its CUDA module (build_cuda covers that): nvcc may be on
# PATH, and AUTO would spend a minute of a 2-core CI machine on it in every session that installs fused.
CPU_BUILD = {"STEPFORGE_CUDA": "OFF"}


def _python(session: nox.Session) -> str:
    """The session's Python version (``PYTHON`` for every session that names no other)."""
    return str(session.python or PYTHON)


def _digest(*paths: pathlib.Path, skip: tuple[str, ...] = ()) -> str:
    """sha256 (16 hex digits) over the relative names and bytes of every file under ``paths``."""
    h = hashlib.sha256()
    for root in paths:
        files = [root] if root.is_file() else sorted(f for f in root.rglob("*") if f.is_file())
        for f in files:
            rel = f.relative_to(ROOT)
            if any(part in skip for part in rel.parts):
                continue
            h.update(str(rel).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _purelib(session: nox.Session, python: str = "python") -> pathlib.Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return pathlib.Path(str(session.run(python, "-c", code, silent=True, external=True)).strip())


def _torch_base(session: nox.Session) -> pathlib.Path:
    """The site-packages of .nox/_base-<python>-<digest>: torch and numpy pinned by the constraints file (built
    once per Python)."""
    base = ROOT / ".nox" / f"_base-{_python(session)}-{_digest(pathlib.Path(CONSTRAINTS[1]))}"
    if not base.is_dir():
        # built aside and renamed: an interrupted build never looks complete (a venv finds its site-packages
        # relative to its pyvenv.cfg, and only `python -m pip` is used in it, so the rename is safe)
        tmp = base.with_name(f"{base.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        session.run("python", "-m", "venv", "--clear", str(tmp))
        session.run(str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", *CONSTRAINTS, *BASE_PACKAGES,
                    external=True)  # fmt: skip
        tmp.rename(base)
    return _purelib(session, str(base / "bin" / "python"))


def use_torch_base(session: nox.Session) -> None:
    """Let this session's venv see the shared torch base (after its own site-packages: its own installs win)."""
    site = _torch_base(session)
    (_purelib(session) / "_stepforge_torch_base.pth").write_text(f"{site}\n")


def fused_wheel(session: nox.Session) -> str:
    """The CPU-only (STEPFORGE_CUDA=OFF) stepforge-fused wheel of this source tree, built on first use.

    Keyed by the session's Python, the package's files (tests and build dirs aside) and the constraints file: a
    changed source builds a new wheel. Building it in each session compiled the same 16 translation units again
    every time (pip's isolated build env is new each time, so scikit-build-core drops the CMake cache and the
    objects with it).
    """
    key = _digest(FUSED, pathlib.Path(CONSTRAINTS[1]), skip=("build", "tests", "__pycache__"))
    out = ROOT / "build" / "fused-wheels" / f"cpu-{_python(session)}-{key}"
    if not list(out.glob("stepforge_fused-*.whl")):
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        session.run(
            "python", "-m", "pip", "wheel", "--no-deps", *CONSTRAINTS, "-w", str(tmp), str(FUSED), env=CPU_BUILD,
        )  # fmt: skip
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return str(next(out.glob("stepforge_fused-*.whl")))


def package_paths(session: nox.Session, names: list[str]) -> list[str]:
    """What pip installs for each local distribution: its folder, or for stepforge-fused the cached CPU wheel."""
    return [fused_wheel(session) if n == "stepforge-fused" else str(ROOT / "packages" / n) for n in names]


def install_packages(
    session: nox.Session, *packages: str, extra: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> None:
    """Install packages and their local siblings in one pip call, torch pinned by the constraints file and taken
    from the shared torch base; stepforge-fused comes as its CPU-only wheel.

    One call, so pip never looks for an unreleased sibling on the index.
    """
    use_torch_base(session)
    names: list[str] = []
    for package in packages:
        for name in closure(package):
            if name not in names:
                names.append(name)
    reqs = {r for p in packages for r in test_group(p)} | set(extra)
    session.install(*CONSTRAINTS, *sorted(reqs), *package_paths(session, names), env=env)
    if "stepforge-fused" in names:
        _refresh_fused(session)


def _refresh_fused(session: nox.Session) -> None:
    """Reinstall stepforge-fused when a reused venv holds another build of the same version.

    pip keeps an installed distribution whose version equals the wheel's, so after a source change a reused venv
    (``nox -r``) would go on testing the old build; a marker in the venv names the wheel last installed.
    """
    wheel = fused_wheel(session)
    marker = _purelib(session) / "_stepforge_fused_wheel.txt"
    if not marker.is_file() or marker.read_text() != wheel:
        session.install("--no-deps", "--force-reinstall", wheel)
        marker.write_text(wheel)


def run_pytest(session: nox.Session, tests: str, *args: str, env: dict[str, str] | None = None) -> None:
    """pytest on a folder or file below packages/, with the root config."""
    session.run(
        "python", "-m", "pytest", str(ROOT / "packages" / tests),
        "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT), "-p", "no:cacheprovider",
        *args, *session.posargs,
        env={"STEPFORGE_SOURCE_ROOT": str(ROOT), **(env or {})},
    )  # fmt: skip


# ---- the disk guard --------------------------------------------------------------------------------------------
# A CI run builds 16 environments; the ones that cannot use the shared torch base (isolation, wheel's clean venv)
# hold torch themselves (about 1 GB), and a machine with too little free space fails half-way with nox's
# unhelpful "ensurepip returned non-zero exit status".
NEEDED_FREE_BYTES = 4 * 1024**3
KEEP_VENVS_ABOVE_BYTES = 30 * 1024**3

SessionFunc = Callable[..., None]


def _free_bytes() -> int:
    return shutil.disk_usage(ROOT).free


def guarded_session(**kwargs: Any) -> Callable[[SessionFunc], SessionFunc]:
    """``nox.session(**kwargs)`` that checks free disk first and frees its venv afterwards.

    The venv is removed at the end when ``CI`` is set or when less than 30 GB would stay free, so a whole
    ``nox -t ci`` peaks at one environment instead of sixteen; locally, with room, venvs are reused as usual.
    """

    def decorate(func: SessionFunc) -> SessionFunc:
        @functools.wraps(func)
        def run(session: nox.Session, *args: Any, **kw: Any) -> None:
            free = _free_bytes()
            if free < NEEDED_FREE_BYTES:
                session.error(
                    f"only {free / 1024**3:.1f} GB free on the disk holding {ROOT}; a session needs about "
                    f"{NEEDED_FREE_BYTES / 1024**3:.0f} GB (torch plus a build): free disk space and re-run"
                )
            try:
                func(session, *args, **kw)
            finally:
                location = session.virtualenv.location
                if (os.environ.get("CI") or _free_bytes() < KEEP_VENVS_ABOVE_BYTES) and location:
                    session.log(f"removing {location} to keep the disk free (CI or < 30 GB free)")
                    shutil.rmtree(location, ignore_errors=True)

        return nox.session(**kwargs)(run)

    return decorate


def ci_session(**kwargs: Any) -> Callable[[SessionFunc], SessionFunc]:
    """:func:`guarded_session` on ``PYTHON`` with the ``ci`` tag: ``nox -t ci`` and CI run it."""
    return guarded_session(**{"python": PYTHON, "tags": ["ci"], **kwargs})


# ---- stepforge-fused with its CUDA module ----------------------------------------------------------------------


def _nvcc() -> str | None:
    """nvcc via CUDACXX, PATH, or /usr/local/cuda*/bin (CMake's check_language(CUDA) sees only the first two)."""
    found = os.environ.get("CUDACXX") or shutil.which("nvcc")
    if not found:
        candidates = sorted(pathlib.Path("/usr/local").glob("cuda*/bin/nvcc"), reverse=True)
        found = str(candidates[0]) if candidates else None
    return found


def install_fused_cuda(session: nox.Session) -> None:
    """Siblings and test deps first, then stepforge-fused built with STEPFORGE_CUDA=ON in its own build dir."""
    nvcc = _nvcc()
    if nvcc is None:
        session.error("needs nvcc for STEPFORGE_CUDA=ON: put it on PATH or set CUDACXX=/path/to/nvcc")
    siblings = [n for n in closure("stepforge-fused") if n != "stepforge-fused"]
    session.install(
        *CONSTRAINTS,
        *sorted(test_group("stepforge-fused")),
        *(str(ROOT / "packages" / n) for n in siblings),
    )
    env = {
        "STEPFORGE_CUDA": "ON",
        "STEPFORGE_CUDA_ARCHS": os.environ.get("STEPFORGE_CUDA_ARCHS", "80;90"),
        "CUDACXX": str(nvcc),
    }
    # A build dir of its own: the CPU-only sessions reuse build/{wheel_tag} with STEPFORGE_CUDA=OFF.
    session.install(
        *CONSTRAINTS, "--no-deps", "-C", "build-dir=build/cuda-{wheel_tag}",
        str(ROOT / "packages" / "stepforge-fused"), env=env,
    )  # fmt: skip


# ---- stepforge-fused wheels ------------------------------------------------------------------------------------
# The OpenMP runtime: torch ships libgomp and loads it with RTLD_GLOBAL; only one OpenMP runtime may live in a
# process (and torch.set_num_threads must govern our kernels). The wheel's module is compiled with -fopenmp but
# not linked against libgomp (STEPFORGE_OPENMP_RUNTIME=host): it has no DT_NEEDED entry that auditwheel would
# vendor as a second, renamed copy, and its GOMP symbols resolve to torch's runtime at import.
WHEEL_DEFINES = ("-C", "cmake.define.STEPFORGE_OPENMP_RUNTIME=host")
# A host glibc newer than manylinux_2_28 allows (this machine: 2.36, x86_64): csrc/compat/glibc_2_28.cpp maps
# the five newer symbol references to older equivalents, so the local wheel gets the tag cibuildwheel gives.
_GLIBC = tuple(int(x) for x in (platform.libc_ver()[1] or "0.0").split(".")[:2])
LOCAL_WHEEL_DEFINES = WHEEL_DEFINES
if platform.machine() == "x86_64" and _GLIBC > (2, 28):
    LOCAL_WHEEL_DEFINES = (*WHEEL_DEFINES, "-C", "cmake.define.STEPFORGE_MANYLINUX_2_28=ON")
COMPILERS = ("cc", "c++", "gcc", "g++", "clang", "clang++", "nvcc")
