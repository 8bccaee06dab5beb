#!/usr/bin/env bash
# Builds cleave and runs it on the embedded default model (generated once into the cache).
# Until the server (`cleave serve`) lands this runs a generation; extra arguments are passed on
# to `cleave generate` (e.g. --model PATH --prompt TEXT).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build -j "$(nproc)" --target cleave
if [ "$#" -eq 0 ]; then
  set -- --prompt "Once upon a time" --max-tokens 64 --temperature 0.8 --seed 1
fi
exec build/bin/cleave generate "$@"
