#!/usr/bin/env bash
# The GPU check, in two steps, because the GPU machine has the CUDA toolkit, CMake and ninja but
# none of cleave's other dependencies and no network:
#   bench/gpu-check.sh pack [DIR]   on the build machine: builds the GPU tests, the GPU benches,
#                                   the cleave binary and the disaggregation test (build/,
#                                   CLEAVE_WITH_CUDA=ON) and packs them with the shared libraries
#                                   they need and stories260K into DIR/pack.tar.xz (default DIR
#                                   build-gpu-pack/; kept under 60 MiB, checked here).
#   bench/gpu-check.sh run [DIR]    on the GPU machine: unpacks DIR/pack.tar.xz and runs every GPU
#                                   test binary, the disaggregation test with every worker on the
#                                   GPU (CLEAVE_ENGINE_DEVICE=cuda: prefill and decode workers over
#                                   tcp and shm, KV through the host mirror those providers need,
#                                   tokens equal to unified and alone), and the benches, then
#                                   prints a short table last. Exits non-zero when a test fails;
#                                   77 when there is no usable device.
# CLEAVE_GPU_CHECK_SMOLLM2=PATH (run): SmolLM2-135M-Instruct.Q4_1.gguf, for its GPU test.
# The whole run takes well under 8 minutes on an H200 (the tests a few seconds, the bench less
# than a minute).
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:-}
dir=${2:-build-gpu-pack}
tests=(gpu_cuda_kernels_test gpu_cuda_backend_test)
benches=(gpu_kernel_bench gpu_engine_bench)
# Multi-process tests run with their workers on the GPU: binary and gtest filter.
integration=integration_worker_disaggregation
integration_filter='CheckPairing.*:Providers/DisaggregationTest.*'


pack() {
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCLEAVE_WITH_CUDA=ON >/dev/null
  cmake --build build -j "$(nproc)" --target "${tests[@]}" "${benches[@]}" cleave "$integration"
  local final=$dir
  dir=$(mktemp -d)
  mkdir -p "$dir/lib"
  for t in "${tests[@]}" "$integration"; do cp "build/tests/$t" "$dir/"; done
  for b in "${benches[@]}"; do cp "build/bench/$b" "$dir/"; done
  cp build/bin/cleave "$dir/"
  # Every shared library they load, except the C library and the loader (the GPU machine has
  # its own) and the CUDA driver (which must match the machine's kernel module).
  for f in "$dir"/*; do
    [ -f "$f" ] || continue
    ldd "$f" | awk '/=> \// {print $3}'
  done | sort -u | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libcuda.so*) ;;
      *) cp -L "$lib" "$dir/lib/" ;;
    esac
  done
  strip --strip-debug "$dir"/gpu_* "$dir"/cleave "$dir/$integration" "$dir"/lib/* 2>/dev/null || true
  # The real model the GPU tests compare against its reference text (shared/ does not travel).
  if [ -f ../shared/models/stories260K.gguf ]; then
    mkdir -p "$dir/models"
    cp ../shared/models/stories260K.gguf ../shared/models/stories260K-empty.txt "$dir/models/"
  fi
  rm -rf "$final" && mkdir -p "$final"
  tar -C "$dir" -cf - . | xz -T0 -6 > "$final/pack.tar.xz"
  local kib
  kib=$(du -sk "$final" | cut -f1)
  echo "gpu-check: packed $(ls "$dir" | grep -c -e gpu_ -e cleave -e integration) binaries and $(ls "$dir/lib" | wc -l) libraries into $final/pack.tar.xz (${kib} KiB)"
  rm -rf "$dir"
  if [ "$kib" -gt 60000 ]; then
    echo "gpu-check: $final is over 60 MiB; the device tool carries 64 MiB at most" >&2
    exit 1
  fi
}

run() {
  [ -f "$dir/pack.tar.xz" ] || { echo "gpu-check: no pack at $dir (run 'bench/gpu-check.sh pack' first)" >&2; exit 2; }
  local unpacked
  unpacked=$(mktemp -d)
  tar -C "$unpacked" -xJf "$dir/pack.tar.xz"
  dir=$unpacked
  export LD_LIBRARY_PATH="$dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  [ -d "$dir/models" ] && export CLEAVE_GPU_TEST_MODELS="$dir/models"
  # SmolLM2 (98 MB) is over what the device tool carries with the pack: where it was brought
  # some other way, CLEAVE_GPU_CHECK_SMOLLM2 names it and the GPU tests compare it too.
  if [ -n "${CLEAVE_GPU_CHECK_SMOLLM2:-}" ] && [ -f "$CLEAVE_GPU_CHECK_SMOLLM2" ]; then
    mkdir -p "$dir/models"
    ln -sf "$(realpath "$CLEAVE_GPU_CHECK_SMOLLM2")" "$dir/models/SmolLM2-135M-Instruct.Q4_1.gguf"
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
  local summary="" failed=0 skipped=0
  for t in "${tests[@]}"; do
    local rc=0 t0 t1
    t0=$(date +%s)
    timeout 300 "$dir/$t" --gtest_brief=1 || rc=$?
    t1=$(date +%s)
    case $rc in
      0) summary+=$(printf '%-28s %-8s %4ss\n' "$t" passed $((t1 - t0)))$'\n' ;;
      77) skipped=1; summary+=$(printf '%-28s %-8s\n' "$t" skipped)$'\n' ;;
      *) failed=1; summary+=$(printf '%-28s %-8s rc=%s\n' "$t" FAILED "$rc")$'\n' ;;
    esac
  done
  local rc=0 t0 t1
  t0=$(date +%s)
  CLEAVE_ENGINE_DEVICE=cuda CLEAVE_TEST_CLEAVE_BINARY="$dir/cleave" CLEAVE_TEST_MODELS="$dir/models" \
    timeout 300 "$dir/$integration" --gtest_brief=1 --gtest_filter="$integration_filter" || rc=$?
  t1=$(date +%s)
  case $rc in
    0) summary+=$(printf '%-28s %-8s %4ss\n' "$integration (cuda)" passed $((t1 - t0)))$'\n' ;;
    *) failed=1; summary+=$(printf '%-28s %-8s rc=%s\n' "$integration (cuda)" FAILED "$rc")$'\n' ;;
  esac
  local bench_out=""
  for b in "${benches[@]}"; do
    bench_out+=$(timeout 240 "$dir/$b" 2>&1 || true)$'\n'
  done
  echo "==== gpu-check summary ===="
  printf '%s' "$summary"
  printf '%s' "$bench_out"
  [ $failed -eq 0 ] || exit 1
  [ $skipped -eq 0 ] || exit 77
}

case "$cmd" in
  pack) pack ;;
  run) run ;;
  *) echo "usage: bench/gpu-check.sh pack|run [DIR]" >&2; exit 2 ;;
esac
