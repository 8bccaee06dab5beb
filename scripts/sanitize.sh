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
export LSAN_OPTIONS="suppressions=$(pwd)/scripts/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ctest --test-dir build-asan --output-on-failure -j "$jobs" -L unit --timeout 900
if [ "$secs" -gt 0 ]; then
  seeds=build-asan/fuzz-seeds
  rm -rf "$seeds" && build-asan/fuzz/make_fuzz_seeds "$seeds"
  for kind in gguf safetensors openai_request; do
    corpus=build-asan/fuzz-corpus/$kind
    mkdir -p "$corpus"
    echo "fuzz: ${kind}_fuzz for ${secs}s" >&2
    # -malloc_limit_mb: any single allocation over 1 GiB (a lying count) is a failure.
    (cd build-asan && ./fuzz/${kind}_fuzz -max_total_time="$secs" -rss_limit_mb=2048 \
        -malloc_limit_mb=1024 -print_final_stats=1 "fuzz-corpus/$kind" "fuzz-seeds/$kind") \
      > "build-asan/${kind}_fuzz.log" 2>&1 || { tail -n 60 "build-asan/${kind}_fuzz.log"; exit 1; }
    grep -E "^stat::number_of_executed_units|^Done" "build-asan/${kind}_fuzz.log" >&2 || true
  done
fi
