#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs dependencies, builds, runs every ctest
# (labels unit, integration, e2e; gpu tests skip themselves without a device), then the
# sanitizer job (ASan+UBSan build, the parsers' libFuzzer targets for a bounded time).
#   CLEAVE_FUZZ_SECONDS  seconds per fuzz target (default 60; 0 skips fuzzing)
#   CLEAVE_SKIP_SANITIZE=1  skips the sanitizer job
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
jobs=$(nproc)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build -j "$jobs"
ctest --test-dir build --output-on-failure -j "$jobs" --timeout 900
if [ "${CLEAVE_SKIP_SANITIZE:-0}" != "1" ]; then
  scripts/sanitize.sh
fi
