#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU proof in one command, on the GPU machine, from the repo root:
#     tools/gpu/run_all.sh
# Stages, each logged; a failed stage is recorded and the next one still runs; the exit status is non-zero
# when any stage failed:
#   env      nvidia-smi, python, torch, nvcc (information)
#   wheels   the wheels in .whl/ (tools/gpu/fetch_wheels.sh, carried), installed --no-deps --no-index
#   pure     the pure packages installed --no-deps --no-build-isolation (the image's torch is used, never replaced)
#   fused    stepforge-fused built with its CUDA module (STEPFORGE_CUDA=ON, archs $STEPFORGE_CUDA_ARCHS, default 90)
#   tests-*  `pytest -m gpu` of every package with GPU tests under STEPFORGE_REQUIRE_CUDA=1 (a skip fails), the
#            packages in parallel, each tests/gpu file in its own process
#   bench    tools/bench/gpu/bench_fused_gpu.py ($BENCH_ARGS, default the full sizes)
#   demo     examples/train_gpt_demo.py --device cuda --nproc 1 ($DEMO_ARGS, default the full demo)
# Training on one GPU (tools/bench/gpu_train/, tools/bench/fused/, tools/bench/train/; not in the default STAGES),
# each under its own time limit (<STAGE>_TIMEOUT_S, seconds) and with its options in <STAGE>_ARGS:
#   capacity  bench_capacity.py: the deepest GPT (d=4096) that trains with FusedAdam / zero2 offload / gemini
#   speed     bench_speed.py: GPT-2 124 M and 1.3 B through Booster/Strategy against the plain loop, MFU
#   offload   bench_offload.py: zero2 + cpu_offload step split into phases at 1.3 B (and at the largest size both
#             capacity contenders trained, when capacity.json is there)
#   estimate  bench_estimate.py --fake-worlds: rank 0 and N-1 of 8 and 1024 fake ranks trained on the one GPU,
#             torch.cuda.max_memory_allocated and the tracker's totals against the estimate
#   architectures  bench_architectures.py --fake: the same for GPT-2, Llama, BERT, T5, Mixtral, ViT and the GPT
#   cpuadam   bench_cpuadam_scale.py: CPUAdam against torch AdamW foreach/fused on the host cores, 1 B fp32
#   cpu_zero  bench_train_interleaved.py at 2 and 4 gloo ranks, each rank pinned to its cores, with and without
#             spare cores for communication (one tarball: cpu_zero.tar.gz)
# STAGES="env wheels pure fused tests bench demo" (the default) picks stages; one call of the device tool may run
# 10 minutes; on an H200 the whole run took 4.5 (setup 1, tests 1.4, demo 0.7, bench 1.4 at full size).
# tools/gpu/README.md has the plan of the calls for the training stages.
# Output in $OUT (the device tool's folder) or else benchmarks/results/gpu-runs/gpu-<UTC time>/: run_all.log,
# summary.json, and per stage: junit-gpu.xml (every package's suite), bench_fused_gpu.json/.png,
# gpt_demo_cuda.json/.png, capacity.json/.png, speed.json/.png, offload.json/.png, estimate.json/.png,
# estimate-architectures.json, cpuadam.json/.png, cpu_zero.tar.gz (at most 8 files per call come back: pick the
# stages accordingly).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-$ROOT/benchmarks/results/gpu-runs/gpu-$(date -u +%Y%m%dT%H%M%SZ)}
WORK=$(mktemp -d /tmp/stepforge-gpu.XXXXXX)
mkdir -p "$OUT_DIR"
exec > >(tee -a "$OUT_DIR/run_all.log") 2>&1
export PYTHONUNBUFFERED=1 STEPFORGE_SOURCE_ROOT=$ROOT
# GPU_PACKAGES="stepforge-fused" (space-separated) narrows the tests stage, e.g. to rerun one package's suite.
read -r -a GPU_PACKAGES <<<"${GPU_PACKAGES:-stepforge-fused stepforge-optim stepforge-zero stepforge-strategy stepforge-mmengine}"
PURE_PACKAGES=(stepforge-core stepforge-testing stepforge-optim stepforge-accum stepforge-zero stepforge-strategy
    stepforge-mmengine)
RESULTS=()
FAILED=0

stage() {  # stage NAME COMMAND...: run it, record "NAME ok|FAILED (rc) seconds"
    local name=$1 start rc
    shift
    echo
    echo "=== [$name] $(date -u +%H:%M:%S) $*"
    start=$(date +%s)
    "$@"
    rc=$?
    if [ "$rc" -eq 0 ]; then
        RESULTS+=("$name ok $(( $(date +%s) - start ))s")
    else
        RESULTS+=("$name FAILED(rc=$rc) $(( $(date +%s) - start ))s")
        FAILED=1
    fi
    echo "=== [$name] rc=$rc"
}

show_env() {
    nvidia-smi || true
    "$PY" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
    command -v nvcc && nvcc --version | tail -2
    "$PY" -m pip --version
}

install_wheels() {
    shopt -s nullglob
    local wheels=(.whl/*.whl)
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "no .whl/*.whl: run tools/gpu/fetch_wheels.sh where there is network and carry .whl (mmengine and"
        echo "hatchling are not in the GPU image; stepforge-mmengine's tests and the pure installs need them)"
        return 1
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile "${wheels[@]}"
}

build_fused() {
    local nvcc=${CUDACXX:-$(command -v nvcc || ls -d /usr/local/cuda*/bin/nvcc 2>/dev/null | sort -r | head -1)}
    if [ -z "$nvcc" ]; then
        echo "no nvcc (PATH, CUDACXX or /usr/local/cuda*/bin): stepforge-fused's CUDA module cannot be built"
        return 1
    fi
    STEPFORGE_CUDA=ON STEPFORGE_CUDA_ARCHS=${STEPFORGE_CUDA_ARCHS:-90} CUDACXX=$nvcc CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        "$PY" -m pip install --no-deps --no-build-isolation --no-index -C build-dir=build/cuda-gpu-run \
        packages/stepforge-fused || return 1
    (cd "$WORK" && "$PY" -c "from stepforge.fused import _backend as b; print('cuda:', b.cuda_status()); \
assert b.cuda_available(), 'stepforge-fused has no usable CUDA module'")
}

install_pure() {
    local paths=()
    for p in "${PURE_PACKAGES[@]}"; do paths+=("packages/$p"); done
    "$PY" -m pip install -q --no-deps --no-build-isolation --no-index "${paths[@]}" || return 1
    (cd "$WORK" && "$PY" -c "from stepforge.core import PLUGINS; import stepforge.mmengine; \
print('plugins:', sorted(PLUGINS.names())); PLUGINS.get('zero2'); PLUGINS.get('gemini')")
}

gpu_tests() {  # gpu_tests PACKAGE: each tests/gpu file in its own process (else the package's tests at once)
    # One process per file: a CUDA failure that poisons the process (a broken graph capture leaves the RNG in
    # capture mode) then fails only its own file's tests, and the log shows the root cause, not a cascade.
    local targets=("packages/$1"/tests/gpu/test_*.py) rc=0 status target name
    [ -e "${targets[0]}" ] || targets=("packages/$1/tests")
    for target in "${targets[@]}"; do
        name=$1-$(basename "$target" .py)
        STEPFORGE_REQUIRE_CUDA=1 STEPFORGE_EXPECT_CUDA_BUILD=1 "$PY" -m pytest "$target" -m gpu -c pyproject.toml \
            --rootdir . -p no:cacheprovider -rA --junitxml="$WORK/junit-$name.xml" -o junit_suite_name="$name"
        status=$?
        [ "$status" -eq 0 ] || [ "$status" -eq 5 ] || rc=1  # 5: a file with no gpu test (test_cuda_build.py)
    done
    return $rc
}

package_tests() {  # package_tests PACKAGE: in the background, its output in its own log, its status in a file
    local start
    start=$(date +%s)
    gpu_tests "$1" >"$WORK/tests-$1.log" 2>&1
    echo "$? $(($(date +%s) - start))" >"$WORK/tests-$1.rc"
}

all_gpu_tests() {  # every package's suite at once (one GPU holds them all), then each log in turn
    local package rc secs pids=()
    echo
    echo "=== [tests] $(date -u +%H:%M:%S) ${GPU_PACKAGES[*]} in parallel"
    for package in "${GPU_PACKAGES[@]}"; do
        package_tests "$package" &
        pids+=($!)
    done
    wait "${pids[@]}"  # by pid: a bare wait would also wait for the log's tee, which never ends
    for package in "${GPU_PACKAGES[@]}"; do
        echo
        echo "=== [tests-${package#stepforge-}]"
        cat "$WORK/tests-$package.log"
        read -r rc secs <"$WORK/tests-$package.rc"
        echo "=== [tests-${package#stepforge-}] rc=$rc"
        if [ "$rc" -eq 0 ]; then
            RESULTS+=("tests-${package#stepforge-} ok ${secs}s")
        else
            RESULTS+=("tests-${package#stepforge-} FAILED(rc=$rc) ${secs}s")
            FAILED=1
        fi
    done
}

bench() {  # writes straight into the output folder: a run stopped at its time limit keeps the cases it finished
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
    "$PY" tools/bench/gpu/bench_fused_gpu.py --out "$OUT_DIR" ${BENCH_ARGS:-}
}

demo() {
    # shellcheck disable=SC2086  # DEMO_ARGS is a list of options
    "$PY" examples/train_gpt_demo.py --device cuda --nproc 1 --out "$WORK/demo" ${DEMO_ARGS:-} || return 1
    cp "$WORK/demo/gpt_demo.json" "$OUT_DIR/gpt_demo_cuda.json"
    cp "$WORK/demo/gpt_demo_loss.png" "$OUT_DIR/gpt_demo_cuda.png" 2>/dev/null || true
}

# -- training on one GPU ---------------------------------------------------------------------------------------
# Each runs under `timeout` (SIGTERM to the whole process group, so a capacity try in its own process goes too,
# then SIGKILL 15 s later); the benches save their JSON as they go, so a stage stopped at its limit keeps what it
# measured.
limited() {  # limited SECONDS COMMAND...
    timeout --kill-after=15 "$@"
}

capacity() {
    # shellcheck disable=SC2086  # CAPACITY_ARGS is a list of options
    limited "${CAPACITY_TIMEOUT_S:-270}" "$PY" tools/bench/gpu_train/bench_capacity.py --out "$OUT_DIR" \
        ${CAPACITY_ARGS:---start-depth fused=16,zero2_offload=24,gemini=24 --budget-s fused=50,zero2_offload=90,gemini=80}
}

speed() {
    # shellcheck disable=SC2086  # SPEED_ARGS is a list of options
    limited "${SPEED_TIMEOUT_S:-110}" "$PY" tools/bench/gpu_train/bench_speed.py --out "$OUT_DIR" \
        ${SPEED_ARGS:---steps 15 --warmup 3}
}

offload() {  # at the largest size too when this call's (or a carried) capacity.json has both contenders' largest
    local sizes=gpt-1.3b extra=()
    if [ -f "$OUT_DIR/capacity.json" ] && "$PY" - "$OUT_DIR/capacity.json" <<'PYEOF'
import json
import sys

found = json.load(open(sys.argv[1]))["contenders"]
sys.exit(0 if all((found.get(n) or {}).get("largest") for n in ("fused", "zero2_offload")) else 1)
PYEOF
    then
        sizes=gpt-1.3b,largest
        extra=(--capacity-json "$OUT_DIR/capacity.json")
    fi
    # the capacity tries ran with expandable segments; the largest size sits at their edge
    # shellcheck disable=SC2086  # OFFLOAD_ARGS is a list of options
    PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
        limited "${OFFLOAD_TIMEOUT_S:-140}" "$PY" tools/bench/gpu_train/bench_offload.py --sizes "$sizes" ${extra[@]+"${extra[@]}"} \
        --out "$OUT_DIR" ${OFFLOAD_ARGS:---steps 4 --warmup 1}
}

estimate() {
    # shellcheck disable=SC2086  # ESTIMATE_ARGS is a list of options
    limited "${ESTIMATE_TIMEOUT_S:-150}" "$PY" tools/bench/estimate/bench_estimate.py --stem estimate --out "$OUT_DIR" \
        ${ESTIMATE_ARGS:---fake-worlds 8 1024 --plugins zero2 zero2-offload torch_fsdp gemini --device cuda}
}

architectures() {  # one JSON (saved after every world), no plot: a call's files stay at most 8
    # shellcheck disable=SC2086  # ARCHITECTURES_ARGS is a list of options
    limited "${ARCHITECTURES_TIMEOUT_S:-180}" "$PY" tools/bench/estimate/bench_architectures.py \
        --stem estimate-architectures --no-plot --out "$OUT_DIR" \
        ${ARCHITECTURES_ARGS:---fake --device cuda --worlds 8 --last-rank --plugins zero2 zero2-offload torch_fsdp gemini}
}

cpuadam() {
    # shellcheck disable=SC2086  # CPUADAM_ARGS is a list of options
    limited "${CPUADAM_TIMEOUT_S:-120}" "$PY" tools/bench/fused/bench_cpuadam_scale.py --stem cpuadam --out "$OUT_DIR" \
        ${CPUADAM_ARGS:-}
}

cpu_zero() {  # 2 and 4 ranks, each pinned to its share of the cores; compute threads = all of them, then fewer
    local cores world per threads rc=0 dir="$WORK/cpu_zero"
    cores=$(nproc)
    mkdir -p "$dir"
    for world in 2 4; do
        per=$((cores / world))
        for threads in "$per" $((per > 4 ? per - 2 : per - 1)); do
            [ "$threads" -ge 1 ] || continue
            echo "--- cpu_zero: $world ranks x $threads compute threads, $per cores each"
            # no GPU visible: the plugins would otherwise place the ranks on cuda:LOCAL_RANK
            # shellcheck disable=SC2086  # CPU_ZERO_ARGS is a list of options
            CUDA_VISIBLE_DEVICES="" limited "${CPU_ZERO_RUN_TIMEOUT_S:-70}" "$PY" tools/bench/train/bench_train_interleaved.py \
                --world "$world" --cores-per-rank "$per" --threads "$threads" --out "$dir" \
                --name "train-interleaved-w${world}-t${threads}of${per}" \
                ${CPU_ZERO_ARGS:---d-model 512 --layers 12 --heads 8 --seq-len 64 --micro-batch 1 --blocks 6 --block-steps 4} \
                || rc=1
        done
    done
    tar -czf "$OUT_DIR/cpu_zero.tar.gz" -C "$WORK" cpu_zero
    return $rc
}

merge_junit() {  # every package's suite in one file (the device tool brings back at most 8 files)
    "$PY" - "$OUT_DIR/junit-gpu.xml" "$WORK"/junit-*.xml <<'PYEOF'
import sys
import xml.etree.ElementTree as ET

merged = ET.Element("testsuites")
for path in sys.argv[2:]:
    root = ET.parse(path).getroot()
    merged.extend(root.findall("testsuite") if root.tag == "testsuites" else [root])
totals = {k: sum(int(s.get(k, 0)) for s in merged) for k in ("tests", "failures", "errors", "skipped")}
merged.attrib.update({k: str(v) for k, v in totals.items()})
ET.ElementTree(merged).write(sys.argv[1], encoding="utf-8", xml_declaration=True)
print("junit:", totals, "->", sys.argv[1])
PYEOF
}

STAGES=" ${STAGES:-env wheels pure fused tests bench demo} "
wanted() { [[ "$STAGES" == *" $1 "* ]]; }
wanted env && stage env show_env
wanted wheels && stage wheels install_wheels
wanted pure && stage pure install_pure  # first: stepforge.fused imports stepforge.core
wanted fused && stage fused build_fused
if wanted tests; then
    all_gpu_tests
    merge_junit || FAILED=1
fi
wanted bench && stage bench bench
wanted demo && stage demo demo
for name in capacity speed offload estimate architectures cpuadam cpu_zero; do
    wanted "$name" && stage "$name" "$name"
done

echo
echo "=== summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), output in $OUT_DIR)"
printf '  %s\n' "${RESULTS[@]}"
"$PY" - "$OUT_DIR/summary.json" "$FAILED" "${RESULTS[@]}" <<'PYEOF'
import json
import sys

import torch

out, failed, stages = sys.argv[1], sys.argv[2] == "1", sys.argv[3:]
cuda = torch.cuda.is_available()
json.dump(
    dict(
        failed=failed,
        stages=stages,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        device=torch.cuda.get_device_name(0) if cuda else None,
    ),
    open(out, "w"),
    indent=1,
)
PYEOF
rm -rf "$WORK"
exit "$FAILED"
