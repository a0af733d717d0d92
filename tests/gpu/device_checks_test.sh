#!/usr/bin/env bash
# run_device_checks.sh's own logic, on this machine, against a stand-in bundle of shell scripts
# (no GPU needed): a program that sees no device stops the run before anything else spends device
# time; otherwise each failure is shown with its message, every program and the bench run, and
# each leaves its log under $OUT.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
# check WHAT COMMAND...: COMMAND must succeed.
check() {
  local what=$1; shift
  "$@" || { echo "FAILED: $what"; fails=$((fails + 1)); }
}

# A stand-in checkout named $1 with a copy of the script; its programs are the remaining arguments,
# NAME=SHELL-LINES pairs, packed into build-cuda/gpu_bundle.tgz. Runs the script; its output goes
# to $tmp/$1.log and its $OUT is $tmp/$1.out.
run_checks() {
  local name=$1 repo=$tmp/$1 stage=$tmp/$1.stage; shift
  mkdir -p "$repo/tests/gpu" "$repo/build-cuda" "$stage/gpu_bundle/bin" "$stage/gpu_bundle/lib"
  cp "$here/run_device_checks.sh" "$repo/tests/gpu/"
  echo "bundle built from stand-in-$name" >"$stage/gpu_bundle/BUILT_FROM"
  for prog in "$@"; do
    printf '#!/bin/sh\n%s\n' "${prog#*=}" >"$stage/gpu_bundle/bin/${prog%%=*}"
    chmod +x "$stage/gpu_bundle/bin/${prog%%=*}"
  done
  tar czf "$repo/build-cuda/gpu_bundle.tgz" -C "$stage" gpu_bundle
  (cd "$repo" && OUT=$tmp/$name.out bash tests/gpu/run_device_checks.sh >"$tmp/$name.log" 2>&1)
}

# 1. No device visible: the first program's failure stops the run.
# shellcheck disable=SC2016 # $OUT is the stand-in programs' to expand
run_checks nodevice \
  'gpu_a_test=echo "x.h:1: Failure"; echo "CEMLM_REQUIRE_GPU=1 but no CUDA device is visible"; exit 1' \
  'gpu_b_test=touch "$OUT/b_ran"' 'engine_gpu=touch "$OUT/bench_ran"'
check "no device: a failure's exit status" test $? -ne 0
check "no device: a STOPPED line" grep -qF "STOPPED: gpu_a_test sees no CUDA device" "$tmp/nodevice.log"
check "no device: the next program not run" test ! -e "$tmp/nodevice.out/b_ran"
check "no device: the bench not run" test ! -e "$tmp/nodevice.out/bench_ran"
check "the bundle's origin shown" grep -qF "bundle built from stand-in-nodevice" "$tmp/nodevice.log"

# 2. A failing test, a passing program, the bench: all run, the failure's message is shown.
run_checks device \
  'gpu_a_test=echo "x.cc:7: Failure"; echo "actual: 0.5 vs 0.002"; echo "[  FAILED  ] A.Bad (3 ms)"; exit 1' \
  'gpu_b_test=echo "[  PASSED  ] 4 tests."' 'engine_gpu=echo "| decode | standard | 1 |"'
check "failing test: exit status 1" test $? -eq 1
check "failing test: its message shown" grep -qF "actual: 0.5 vs 0.002" "$tmp/device.log"
check "failing test: its exit status reported" grep -qF "gpu_a_test exited with 1" "$tmp/device.log"
check "failing test: the next program ran" grep -qF "[  PASSED  ] 4 tests." "$tmp/device.log"
for f in gpu_a_test.log gpu_b_test.log; do check "$f under \$OUT" test -s "$tmp/device.out/$f"; done
check "the bench table in bench.txt" grep -qF "| decode |" "$tmp/device.out/bench.txt"

if [ "$fails" -ne 0 ]; then
  for name in nodevice device; do echo "--- run_device_checks.sh output, $name:"; cat "$tmp/$name.log"; done
  exit 1
fi
echo "all device-script checks passed"
