#!/usr/bin/env bash
# Runs `cleave tokenize --suite` on one llama.cpp tokenizer suite and compares the output with the
# expected .out file byte for byte. The files are llama.cpp's own: when SUITE_DIR/README.md gives
# the vocab file's sha256, the file must have it.
# Usage: tokenizer_suite.sh CLEAVE_BINARY SUITE_DIR NAME
# Exit 0: identical; 1: different or error; 77: suite files absent (ctest SKIP).
set -u
cleave="$1"
dir="$2"
name="$3"
base="$dir/ggml-vocab-$name.gguf"
if [ ! -f "$base" ] || [ ! -f "$base.inp" ] || [ ! -f "$base.out" ]; then
  echo "SKIP: tokenizer suite '$name' not found under $dir"
  exit 77
fi
want="$(grep -F "\`ggml-vocab-$name.gguf\`" "$dir/README.md" 2>/dev/null | grep -o '[0-9a-f]\{64\}')"
if [ -n "$want" ]; then
  got="$(sha256sum "$base" | cut -d' ' -f1)"
  if [ "$got" != "$want" ]; then
    echo "FAIL: $base has sha256 $got; $dir/README.md gives $want"
    exit 1
  fi
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if ! "$cleave" tokenize --model "$base" --suite "$base.inp" >"$work/actual" 2>"$work/err"; then
  echo "FAIL: cleave tokenize exited with an error for $base:"
  cat "$work/err"
  exit 1
fi
if cmp -s "$work/actual" "$base.out"; then
  echo "OK: $name: $(wc -l <"$base.out") cases match"
  exit 0
fi
echo "FAIL: $name: output differs from $base.out (< expected, > cleave):"
diff "$base.out" "$work/actual" | head -40
exit 1
