#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite (ctest; GPU tests skip
# cleanly without a device). This is what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
ctest --test-dir build --output-on-failure -j2 --timeout 600
