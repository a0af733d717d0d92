#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite (ctest; GPU tests skip
# cleanly without a device). This is what CI runs (.ci/run).
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."  # through a symlink too
CEMLM_SETUP_TESTS=1 scripts/setup.sh
# OpenMP workers yield instead of spinning: with ctest -j2 on 2 cores, spinning threads of one
# test would starve the other (results do not depend on it).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
# Tests write their files under a directory of this run's, which must be empty again when they
# all pass: what a test leaves behind fails the run, by name. A failed run keeps it to look at.
scratch=$(mktemp -d -t cemlm-tests.XXXXXX)
if ! TMPDIR=$scratch TEST_TMPDIR=$scratch ctest --test-dir build --output-on-failure -j2 \
    --timeout 600; then
  echo "the failed tests' files are kept in $scratch" >&2
  exit 1
fi
left=$(ls -A "$scratch")
if [ -n "$left" ]; then
  echo "the tests passed but left these in their temporary directory $scratch:" >&2
  echo "$left" >&2
  exit 1
fi
rmdir "$scratch"
