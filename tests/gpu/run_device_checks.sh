#!/usr/bin/env bash
# The one device-machine call for the CUDA backend: get the GPU programs (unpack the carried
# build-cuda/gpu_bundle.tgz from make_device_bundle.sh, or else configure and build here), run
# the `gpu` tests (a missing device fails them: CEMLM_REQUIRE_GPU), a memcheck pass over the op
# tests where compute-sanitizer works, then bench/engine_gpu's table. Every
# phase runs under `timeout` inside one 8-minute budget; logs go to $OUT (or ./device_out).
# Device call: run(command="bash tests/gpu/run_device_checks.sh", carry=["build-cuda/gpu_bundle.tgz"],
# timeout_s=540). The image has CUDA but not our Debian dependencies (abseil, OpenBLAS, GoogleTest,
# gRPC…): the bundle brings their shared libraries; building here works only where they exist.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-$root/device_out}
mkdir -p "$out"
start=$SECONDS
budget=${CEMLM_DEVICE_BUDGET_S:-470}
left() { echo $((budget - (SECONDS - start))); }
# Seconds for a phase: its cap, but never more than what is left minus `reserve` for later phases.
phase_s() { local cap=$1 reserve=$2 l; l=$(( $(left) - reserve )); echo $(( l < cap ? (l > 5 ? l : 5) : cap )); }
say() { echo "== [$((SECONDS - start))s] $*"; }
status=0

say "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
nvcc --version 2>/dev/null | tail -1 || true
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# A device the tests cannot see fails them instead of skipping them (a skip would read as a pass).
export CEMLM_REQUIRE_GPU=1

bundle=$root/build-cuda/gpu_bundle.tgz
if [ -f "$bundle" ]; then
  say "unpacking the carried build $bundle"
  work=$(mktemp -d)
  tar xzf "$bundle" -C "$work"
  bin=$work/gpu_bundle/bin
  export LD_LIBRARY_PATH=$work/gpu_bundle/lib:$LD_LIBRARY_PATH
  for exe in "$bin"/*; do
    if ldd "$exe" | grep -q "not found"; then
      echo "missing libraries for $(basename "$exe"):"; ldd "$exe" | grep "not found"; status=1
    fi
  done
  say "gpu tests (the programs ctest -L gpu runs)"
  for t in "$bin"/gpu_*_test; do
    timeout "$(phase_s 150 200)" "$t" --gtest_color=no 2>&1 | tee "$out/$(basename "$t").log" |
      grep -E "^\[  (FAILED|SKIPPED|PASSED) |^\[==========\]|Failure|check failed|CUDA error|cuBLAS error" 
    rc=${PIPESTATUS[0]}
    [ "$rc" -ne 0 ] && { echo "$(basename "$t") exited with $rc"; status=1; }
  done
else
  say "no carried build: configuring and building here (needs our Debian dependencies)"
  build=/tmp/cemlm-build
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  if ! timeout "$(phase_s 60 300)" cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DCEMLM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 >"$out/configure.log" 2>&1; then
    tail -20 "$out/configure.log"
    echo "configure failed: carry build-cuda/gpu_bundle.tgz (tests/gpu/make_device_bundle.sh) instead"
    exit 1
  fi
  timeout "$(phase_s 240 200)" cmake --build "$build" -j16 --target gpu_ops_test gpu_sampling_test \
    gpu_runner_test bench_engine_gpu >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
  say "ctest -L gpu"
  timeout "$(phase_s 240 150)" ctest --test-dir "$build" -L gpu --output-on-failure --timeout 120 \
    >"$out/ctest.log" 2>&1 || status=1
  grep -E "tests passed|Failed|\*\*\*" "$out/ctest.log" | tail -40
  bin=$build/tests/gpu
  cp "$build/bench/engine_gpu" "$bin/" 2>/dev/null || true
fi

# compute-sanitizer refuses the device on some runtimes (gVisor: "Device not supported"): one
# short probe decides whether the memcheck phase is worth its time.
sanitizer_works() {
  timeout 30 compute-sanitizer --tool memcheck "$bin/gpu_sampling_test" --gtest_color=no \
    --gtest_filter='SamplingTest.NonFiniteRowGivesNoToken' >"$out/memcheck_probe.log" 2>&1
}
if command -v compute-sanitizer >/dev/null && [ "$(left)" -gt 260 ] && sanitizer_works; then
  say "compute-sanitizer memcheck over the op and sampling tests"
  for t in gpu_ops_test gpu_sampling_test; do
    timeout "$(phase_s 60 200)" compute-sanitizer --tool memcheck --error-exitcode 9 \
      "$bin/$t" --gtest_color=no >"$out/memcheck_$t.log" 2>&1
    rc=$?
    echo "memcheck $t: exit $rc"; grep -E "ERROR SUMMARY|Invalid|out of bounds" "$out/memcheck_$t.log" | head -5
    [ "$rc" -eq 9 ] && status=1
  done
fi

say "bench/engine_gpu"
timeout "$(phase_s 200 5)" "$bin/engine_gpu" 2>&1 | tee "$out/bench.txt" || status=1
say "done, status $status (logs in $out)"
exit $status
