#!/usr/bin/env bash
# The sanitizer job: an ASan+UBSan build with clang of the libraries, their unit tests and the
# libFuzzer targets; runs the unit tests under the sanitizers, then each fuzz target for
# CLEAVE_FUZZ_SECONDS (default 60) from a seed corpus of valid files.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${CLEAVE_FUZZ_SECONDS:-60}
jobs=$(nproc)
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCLEAVE_SANITIZE=ON -DCLEAVE_FUZZ=ON -DCLEAVE_BUILD_BENCH=OFF -DCLEAVE_WITH_CUDA=OFF
cmake --build build-asan -j "$jobs"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ctest --test-dir build-asan --output-on-failure -j "$jobs" -L unit --timeout 900
if [ "$secs" -gt 0 ]; then
  for fuzzer in build-asan/fuzz/*_fuzz; do
    [ -x "$fuzzer" ] || continue
    name=$(basename "$fuzzer")
    corpus=build-asan/fuzz-corpus/$name
    mkdir -p "$corpus"
    if [ -x build-asan/fuzz/make_seeds ]; then build-asan/fuzz/make_seeds "$name" "$corpus"; fi
    echo "fuzz: $name for ${secs}s" >&2
    "$fuzzer" -max_total_time="$secs" -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 \
      "$corpus" 2>&1 | tail -n 15
  done
fi
