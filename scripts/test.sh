#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite (ctest; GPU tests skip
# cleanly without a device). This is what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# OpenMP workers yield instead of spinning: with ctest -j2 on 2 cores, spinning threads of one
# test would starve the other (results do not depend on it).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
ctest --test-dir build --output-on-failure -j2 --timeout 600
