#!/usr/bin/env bash
# Usage: golden_stories260K.sh CLEAVE_BINARY MODELS_DIR
# Runs the golden generation and compares stdout byte for byte with the reference text.
set -u
cleave="$1"
models="$2"
model="$models/stories260K.gguf"
want="$models/stories260K-empty.txt"
if [[ ! -f "$model" || ! -f "$want" ]]; then
  echo "SKIP: $model or $want is absent (../shared not checked out)" >&2
  exit 77
fi
got="$(mktemp)"
trap 'rm -f "$got"' EXIT
if ! "$cleave" generate --model "$model" --prompt "" --max-tokens 200 --temperature 0 >"$got"; then
  echo "FAIL: cleave generate exited with an error" >&2
  exit 1
fi
if ! cmp -s "$got" "$want"; then
  echo "FAIL: output differs from $want" >&2
  echo "--- expected ($(wc -c <"$want") bytes)" >&2
  cat "$want" >&2
  echo >&2
  echo "--- got ($(wc -c <"$got") bytes)" >&2
  cat "$got" >&2
  echo >&2
  cmp "$got" "$want" >&2
  exit 1
fi
echo "OK: $(wc -c <"$got") bytes match $want"
