#!/usr/bin/env bash
# Builds cleave and serves the OpenAI API on http://127.0.0.1:8000/ with `cleave serve`: one
# prefill and one decode worker on this machine (KV over shared memory) behind the router, on
# the embedded default model (generated once into the cache) unless --model names one. Extra
# arguments go to `cleave serve` (e.g. --model PATH --port 8080 --config cleave.yaml).
# Ctrl-C stops the router and every worker.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build -j "$(nproc)" --target cleave
exec build/bin/cleave serve "$@"
