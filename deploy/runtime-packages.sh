#!/usr/bin/env bash
# deploy/runtime-packages.sh — prints the Debian/Ubuntu packages that hold the shared libraries the
# given binaries and plugins link (one name a line), so the runtime image installs exactly those
# and no -dev package.
# Run it in the build stage; the runtime stage must be the same distribution release.
# The GPU driver library (libcuda, libnvidia-*) is skipped: the container runtime injects it.
set -eu

if [ $# -lt 1 ]; then
  echo "usage: runtime-packages.sh FILE... (dynamically linked executables or shared objects)" >&2
  exit 2
fi
for f in "$@"; do
  [ -f "$f" ] || { echo "runtime-packages.sh: no such file: $f (usage: FILE...)" >&2; exit 2; }
done

# dpkg records a library under the path its package installed, which may differ from what ldd
# prints (merged /usr, alternatives symlinks, /usr/local/cuda -> cuda-X.Y): try each spelling.
owner() {
  local path="$1" real found
  real="$(readlink -f "$path")"
  # One query for all spellings (dpkg-query is slow to start); it fails when any is unknown.
  found="$(dpkg-query -S "$path" "$real" "${path#/usr}" "/usr$path" "${real#/usr}" "/usr$real" \
           2>/dev/null || true)"
  [ -n "$found" ] || return 1
  found="${found%%$'\n'*}"  # "pkg:arch: /path" or "pkg: /path"
  echo "${found%%:*}"
}

libs=""
for f in "$@"; do
  libs+="$(ldd "$f")"$'\n' || { echo "runtime-packages.sh: ldd failed on $f" >&2; exit 1; }
done
packages=""
status=0
while read -r soname arrow path _; do
  case "$soname" in libcuda.so* | libnvidia-*) continue ;; esac
  [ "$arrow" = "=>" ] || continue  # the vdso and the dynamic loader itself
  if [ "$path" = "not" ]; then
    echo "runtime-packages.sh: $soname is not found; install its package in the build stage" >&2
    status=1
  elif pkg="$(owner "$path")"; then
    packages+="$pkg"$'\n'
  else
    echo "runtime-packages.sh: $soname ($path) belongs to no package;" \
         "the image cannot install it" >&2
    status=1
  fi
done <<<"$libs"
[ "$status" -eq 0 ] || exit "$status"
printf '%s' "$packages" | sort -u
