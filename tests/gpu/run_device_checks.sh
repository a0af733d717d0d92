#!/usr/bin/env bash
# The one device-machine call for the CUDA backend: get the GPU programs (unpack the carried
# build-cuda/gpu_bundle.tgz from make_device_bundle.sh, or else configure and build here), run
# the `gpu` tests (a missing device fails them: CEMLM_REQUIRE_GPU, and the first program that sees
# none stops the run), then bench/engine_gpu's table, then, with the time left, compute-sanitizer
# (memcheck over the op and sampling tests and one runner decode, racecheck and synccheck over
# the attention and sampling kernels) where it works. Every phase runs under `timeout` inside one
# 8-minute budget; logs go to $OUT (or ./device_out) as they are written, at most 6 files.
# Device call: run(command="bash tests/gpu/run_device_checks.sh", carry=["build-cuda/gpu_bundle.tgz"],
# timeout_s=540), from the checkout the session started in (the tool sends that one), with the
# bundle built there. The image has CUDA but not our Debian dependencies (abseil, OpenBLAS,
# GoogleTest, gRPC…): the bundle brings their shared libraries; building here works only where
# they exist.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-$root/device_out}
mkdir -p "$out"
start=$SECONDS
budget=${CEMLM_DEVICE_BUDGET_S:-470}
left() { echo $((budget - (SECONDS - start))); }
# Seconds for a phase: its cap, but never more than what is left minus `reserve` for later phases.
phase_s() { local cap=$1 reserve=$2 l; l=$(( $(left) - reserve )); echo $(( l < cap ? (l > 5 ? l : 5) : cap )); }
# A program that ignores SIGTERM (stuck in a driver call) is killed 10 s later.
run_for() { timeout -k 10 "$@"; }
say() { echo "== [$((SECONDS - start))s] $*"; }
status=0

say "device"
export PATH=$PATH:/usr/local/cuda/bin  # nvcc and compute-sanitizer, where the image leaves them off
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
nvcc --version 2>/dev/null | tail -1 || true
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# A device the tests cannot see fails them instead of skipping them (a skip would read as a pass).
export CEMLM_REQUIRE_GPU=1
no_device_msg="CEMLM_REQUIRE_GPU=1 but no CUDA device is visible"

bundle=$root/build-cuda/gpu_bundle.tgz
if [ -f "$bundle" ]; then
  say "unpacking the carried build $bundle"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  tar xzf "$bundle" -C "$work" || { echo "cannot unpack $bundle"; exit 1; }
  cat "$work/gpu_bundle/BUILT_FROM" 2>/dev/null
  bin=$work/gpu_bundle/bin
  export LD_LIBRARY_PATH=$work/gpu_bundle/lib:$LD_LIBRARY_PATH
  # cuBLAS comes from the image; where it is not in /usr/local/cuda/lib64, take the first copy
  # found (a pip nvidia-cublas under a Python environment, say).
  # (ldd's output is read whole: under pipefail, `ldd | grep -q` fails when grep stops early.)
  if [[ $(ldd "$bin/engine_gpu") =~ libcublas[^$'\n']*"not found" ]]; then
    lt=$(find /usr/local /opt /usr/lib -name 'libcublasLt.so.13' 2>/dev/null | head -1)
    if [ -n "$lt" ]; then
      echo "cuBLAS from ${lt%/*}"; export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:${lt%/*}
    fi
  fi
  for exe in "$bin"/*; do
    missing=$(ldd "$exe" | grep "not found")
    [ -n "$missing" ] && { echo "missing libraries for $(basename "$exe"):"; echo "$missing"; status=1; }
  done
  say "gpu tests (the programs ctest -L gpu runs)"
  for t in "$bin"/gpu_*_test; do
    log=$out/$(basename "$t").log
    # The summary, each failed test once (with its time) and up to 8 lines of each failure.
    run_for "$(phase_s 150 180)" "$t" --gtest_color=no 2>&1 | tee "$log" |
      awk '/: Failure$/ { n = 8 } /^\[ / { n = 0 }
           n > 0 || /^\[  (SKIPPED|PASSED) |^\[  FAILED  \] .*\([0-9]+ ms\)$|^\[==========\]|check failed|CUDA error|cuBLAS error/ {
             print; fflush() }
           n > 0 { n-- }'
    rc=${PIPESTATUS[0]}
    case $rc in
      0) ;;
      124 | 137) echo "$(basename "$t") TIMED OUT (killed after its share of the budget)"; status=1 ;;
      *) echo "$(basename "$t") exited with $rc"; status=1 ;;
    esac
    if grep -q "$no_device_msg" "$log"; then
      echo "STOPPED: $(basename "$t") sees no CUDA device (driver or runtime mismatch?); nothing else can run"
      exit 1
    fi
  done
else
  say "no carried build: configuring and building here (needs our Debian dependencies)"
  build=/tmp/cemlm-build
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  if ! run_for "$(phase_s 60 300)" cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DCEMLM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCEMLM_BUILD_TESTS=ON \
      >"$out/configure.log" 2>&1; then
    tail -20 "$out/configure.log"
    echo "configure failed: carry build-cuda/gpu_bundle.tgz (tests/gpu/make_device_bundle.sh) instead"
    exit 1
  fi
  run_for "$(phase_s 240 200)" cmake --build "$build" -j16 --target gpu_ops_test gpu_sampling_test \
    gpu_runner_test bench_engine_gpu >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
  say "ctest -L gpu"
  run_for "$(phase_s 240 150)" ctest --test-dir "$build" -L gpu --output-on-failure --timeout 120 \
    >"$out/ctest.log" 2>&1 || status=1
  grep -E "tests passed|Failed|\*\*\*" "$out/ctest.log" | tail -40
  grep -q "$no_device_msg" "$out/ctest.log" && { echo "STOPPED: the tests see no CUDA device"; exit 1; }
  bin=$build/tests/gpu
  cp "$build/bench/engine_gpu" "$bin/" 2>/dev/null || true
fi

say "bench/engine_gpu"
run_for "$(phase_s 200 5)" "$bin/engine_gpu" 2>&1 | tee "$out/bench.txt" || status=1

# compute-sanitizer refuses the device on some runtimes (gVisor: "Device not supported"): one
# short probe decides whether the sanitizer phases are worth their time. All of them write to one
# log, sanitizers.log ($OUT brings back at most 8 files).
san=$out/sanitizers.log
# sanitize TOOL CAP PROGRAM FILTER: one compute-sanitizer run, its summary shown, an error found
# failing the run.
sanitize() {
  local tool=$1 cap=$2 prog=$3 filter=$4 rc
  if [ "$(left)" -lt 30 ]; then
    say "$(left)s left: $tool $prog skipped"
    return
  fi
  echo "=== $tool $prog $filter" >>"$san"
  run_for "$(phase_s "$cap" 5)" compute-sanitizer --tool "$tool" --error-exitcode 9 "$bin/$prog" \
    --gtest_color=no --gtest_filter="$filter" >>"$san" 2>&1
  rc=$?
  echo "$tool $prog: exit $rc"
  tail -n 200 "$san" | grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Invalid|out of bounds|hazard|Barrier" | tail -3
  [ "$rc" -eq 9 ] && status=1
}
if ! command -v compute-sanitizer >/dev/null; then
  say "no compute-sanitizer: sanitizers skipped"
elif [ "$(left)" -lt 90 ]; then
  say "$(left)s left: sanitizers skipped"
elif ! run_for 30 compute-sanitizer --tool memcheck --error-exitcode 9 "$bin/gpu_sampling_test" \
    --gtest_color=no --gtest_filter='SamplingTest.NonFiniteRowGivesNoToken' >"$san" 2>&1; then
  say "sanitizer probe failed (a refused device, or an error it found): sanitizers skipped"
  tail -8 "$san"
  grep -q "ERROR SUMMARY: [1-9]" "$san" && status=1
else
  say "compute-sanitizer: memcheck over the op and sampling tests, one runner decode; racecheck and synccheck over the kernels with shared memory and barriers"
  sanitize memcheck 60 gpu_ops_test '*'
  sanitize memcheck 60 gpu_sampling_test '*'
  # The runner's workspace, strides and graphs: a mixed-depth decode of two variants.
  sanitize memcheck 60 gpu_runner_test '*MixedDepth*/full_cem_lev:*MixedDepth*/cem_perhead'
  # memcheck sees no shared-memory race or misplaced barrier: the attention tiles and the
  # sampler's block scans are what racecheck and synccheck are for.
  sanitize racecheck 60 gpu_ops_test '*AttentionTest*'
  sanitize racecheck 40 gpu_sampling_test '*'
  sanitize synccheck 40 gpu_ops_test '*AttentionTest*'
  sanitize synccheck 30 gpu_sampling_test '*'
fi
say "done, status $status (logs in $out)"
exit $status
