#!/usr/bin/env bash
# The GPU check, in two steps, because the GPU machine has the CUDA toolkit, CMake and ninja but
# none of cleave's other dependencies and no network:
#   bench/gpu-check.sh pack [DIR]   on the build machine: builds the GPU tests and the GPU bench
#                                   (build/, CLEAVE_WITH_CUDA=ON) and gathers them with the shared
#                                   libraries they need into DIR (default build-gpu-pack/, kept
#                                   well under 64 MiB; checked here).
#   bench/gpu-check.sh run [DIR]    on the GPU machine: runs every GPU test binary and the bench
#                                   from DIR alone, then prints a short table last. Exits non-zero
#                                   when a test fails; 77 when there is no usable device.
# The whole run takes well under 8 minutes on an H200 (the tests a few seconds, the bench less
# than a minute).
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:-}
dir=${2:-build-gpu-pack}
tests=(gpu_cuda_kernels_test)
benches=(gpu_kernel_bench)

pack() {
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCLEAVE_WITH_CUDA=ON >/dev/null
  cmake --build build -j "$(nproc)" --target "${tests[@]}" "${benches[@]}"
  rm -rf "$dir" && mkdir -p "$dir/lib"
  for t in "${tests[@]}"; do cp "build/tests/$t" "$dir/"; done
  for b in "${benches[@]}"; do cp "build/bench/$b" "$dir/"; done
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
  strip --strip-debug "$dir"/gpu_* "$dir"/lib/* 2>/dev/null || true
  local kib
  kib=$(du -sk "$dir" | cut -f1)
  echo "gpu-check: packed $(ls "$dir" | grep -c gpu_) binaries and $(ls "$dir/lib" | wc -l) libraries into $dir (${kib} KiB)"
  if [ "$kib" -gt 60000 ]; then
    echo "gpu-check: $dir is over 60 MiB; the device tool carries 64 MiB at most" >&2
    exit 1
  fi
}

run() {
  [ -d "$dir" ] || { echo "gpu-check: no pack at $dir (run 'bench/gpu-check.sh pack' first)" >&2; exit 2; }
  export LD_LIBRARY_PATH="$dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
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
