#!/usr/bin/env bash
# Installs the Debian packages cemlm needs (only those missing) and builds it into ./build.
# Usage: [CEMLM_SETUP_TESTS=1] [CEMLM_SETUP_TARGET=T] scripts/setup.sh [extra cmake args]. Needs
# root (or sudo) for apt-get on a fresh machine. CEMLM_SETUP_TESTS=1 (scripts/test.sh) adds what
# only the tests use and configures the build with them (CEMLM_BUILD_TESTS=ON); without it the
# tests build only where GoogleTest is already installed. CEMLM_SETUP_TARGET builds that target
# alone (the quickstart's: cemlm).
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."  # through a symlink too

# The program, the default model's corpus, and curl (the quickstart reads /metrics).
PACKAGES=(
  build-essential cmake pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  libspdlog-dev libfmt-dev prometheus-cpp-dev nlohmann-json3-dev
  libsentencepiece-dev libopenblas-openmp-dev
  fortunes fortunes-min curl
)
# The tests': GoogleTest; the Python their scripts run on (python3-h2: the raw HTTP/2 client of
# tests/server/body_flood.py); the linter of the scripts. promtool, for the deploy checks of the
# alert rules: the prometheus package's. Its install also starts and enables a Prometheus server
# on :9090, which is stopped and disabled again below. openssl: the certificates of the TLS tests
# (a minimal Debian 12 has no openssl command).
TEST_PACKAGES=(
  libgtest-dev libgmock-dev
  python3 python3-yaml python3-grpcio python3-protobuf python3-h2 shellcheck prometheus openssl
)
tests=OFF
[ "${CEMLM_SETUP_TESTS:-0}" = 1 ] && PACKAGES+=("${TEST_PACKAGES[@]}") && tests=ON

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo > /dev/null || {
      echo "setup: installing packages needs root: run this as root (a fresh Debian has no sudo)" >&2
      exit 1
    }
    SUDO=(sudo)
  fi
  # Debian starts a package's service as it installs (prometheus: a server on :9090). With
  # systemd it is stopped again below; without (a container, WSL), a policy-rc.d that forbids
  # starts (Docker's images ship one) is put in place for the install, unless one is there.
  if [[ " ${missing[*]} " == *" prometheus "* ]] && [ ! -d /run/systemd/system ] &&
    [ ! -e /usr/sbin/policy-rc.d ]; then
    trap '"${SUDO[@]}" rm -f /usr/sbin/policy-rc.d' EXIT
    printf '#!/bin/sh\n# scripts/setup.sh, while it installs packages: no service starts\nexit 101\n' |
      "${SUDO[@]}" tee /usr/sbin/policy-rc.d > /dev/null
    "${SUDO[@]}" chmod 755 /usr/sbin/policy-rc.d
  fi
  "${SUDO[@]}" apt-get update -qq
  # Through env: sudo resets the environment, and apt's prompts (tzdata) would wait for a user.
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
  if [[ " ${missing[*]} " == *" prometheus "* ]] && [ -d /run/systemd/system ]; then
    "${SUDO[@]}" systemctl disable --now prometheus > /dev/null 2>&1 || true
  fi
  if [ -n "$(trap -p EXIT)" ]; then
    "${SUDO[@]}" rm -f /usr/sbin/policy-rc.d
    trap - EXIT
  fi
fi

target=()
[ -n "${CEMLM_SETUP_TARGET:-}" ] && target=(--target "$CEMLM_SETUP_TARGET")
echo "setup: building ./build${target[*]:+ (${target[*]})}: minutes on 2 cores the first time;" \
  "the log is build.log"
# With CEMLM_SETUP_TESTS the tests must build (ON fails without GoogleTest); without it the
# build keeps what it was configured with (AUTO at first).
test_flag=()
[ "$tests" = ON ] && test_flag=(-DCEMLM_BUILD_TESTS=ON)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "${test_flag[@]}" "$@" > build.log 2>&1 ||
  { cat build.log; exit 1; }
cmake --build build -j"$(nproc)" "${target[@]}" >> build.log 2>&1 || { tail -50 build.log; exit 1; }
echo "setup: built ./build/cli/cemlm"
