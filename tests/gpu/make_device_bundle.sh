#!/usr/bin/env bash
# Packs the GPU test programs and the CUDA benchmark, with the shared libraries they need that a
# bare CUDA image lacks (abseil, OpenBLAS, gfortran, gomp; not glibc, libstdc++ or CUDA's own),
# into <build>/gpu_bundle.tgz, which run_device_checks.sh unpacks on the device machine.
# Usage: tests/gpu/make_device_bundle.sh [build dir, default build-cuda]; then carry that file.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build-cuda}
targets=(gpu_ops_test gpu_sampling_test gpu_runner_test bench_engine_gpu)
# The device host's CPU is unknown: a portable instruction level, not this machine's.
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCEMLM_CUDA=ON -DCEMLM_CPU_ARCH=x86-64-v3 \
  -DCEMLM_BUILD_TESTS=ON >/dev/null
cmake --build "$build" -j"$(nproc)" --target "${targets[@]}"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/gpu_bundle/bin" "$stage/gpu_bundle/lib"
cp "$build"/tests/gpu/gpu_*_test "$build/bench/engine_gpu" "$stage/gpu_bundle/bin/"
# The device image brings glibc, libstdc++/libgcc_s (newer than ours) and the CUDA libraries.
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|libstdc\+\+|libgcc_s|libcuda|libcublas|libcudart)'
for exe in "$stage"/gpu_bundle/bin/*; do
  ldd "$exe" | awk '$3 ~ /^\// {print $1, $3}' | while read -r name path; do
    if ! [[ $name =~ $skip ]]; then cp -L "$path" "$stage/gpu_bundle/lib/$name"; fi
  done
done
# Which sources the programs are: the device prints it, so a stale bundle shows in the results.
echo "bundle built from $(git -C "$root" describe --always --dirty) on $(date -u +%F)" \
  >"$stage/gpu_bundle/BUILT_FROM"
tar czf "$build/gpu_bundle.tgz" -C "$stage" gpu_bundle
echo "wrote $build/gpu_bundle.tgz ($(du -h "$build/gpu_bundle.tgz" | cut -f1)):"
ls "$stage/gpu_bundle/bin" "$stage/gpu_bundle/lib" | tr '\n' ' '
echo
