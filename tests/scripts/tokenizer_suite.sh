#!/usr/bin/env bash
# Runs `cleave tokenize --suite` on one llama.cpp tokenizer suite and compares the output with the
# expected .out file byte for byte.
# Usage: tokenizer_suite.sh CLEAVE_BINARY SUITE_DIR NAME
# Exit 0: identical; 1: different or error; 77: suite files absent (ctest SKIP).
#
# Damaged vocab files: the copies in ../shared/tokenizer-suite have been seen damaged by a lossy
# UTF-8 conversion (every byte that was not valid UTF-8 became EF BF BD). cleave's GGUF reader
# must refuse such a file (it does: the counts and lengths lie). The test then says so loudly
# and checks the tokenizer against a copy rebuilt by tokenizer_salvage_damaged_suite.py (tokens,
# token types and merges survive the damage; SentencePiece scores are approximated), so that the
# tokenizer is still held to every case until pristine files are back.
set -u
cleave="$1"
dir="$2"
name="$3"
here="$(cd "$(dirname "$0")" && pwd)"
base="$dir/ggml-vocab-$name.gguf"
if [ ! -f "$base" ] || [ ! -f "$base.inp" ] || [ ! -f "$base.out" ]; then
  echo "SKIP: tokenizer suite '$name' not found under $dir"
  exit 77
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
model="$base"
if ! "$cleave" tokenize --model "$base" --suite "$base.inp" >"$work/actual" 2>"$work/err"; then
  damaged="$(LC_ALL=C grep -obUaP '\xef\xbf\xbd' "$base" 2>/dev/null | wc -l)"
  if [ "$damaged" -eq 0 ]; then
    echo "FAIL: cleave tokenize exited with an error for $base:"
    cat "$work/err"
    exit 1
  fi
  echo "WARNING: $base is DAMAGED: it holds $damaged U+FFFD sequences (EF BF BD) from a lossy"
  echo "         UTF-8 conversion of its binary data, and cleave refuses it:"
  sed 's/^/           /' "$work/err"
  echo "         Checking against a salvaged copy instead; a pristine file is needed."
  if ! python3 "$here/tokenizer_salvage_damaged_suite.py" "$base" "$work/salvaged.gguf" >/dev/null; then
    echo "FAIL: the damaged file could not be salvaged"
    exit 1
  fi
  model="$work/salvaged.gguf"
  if ! "$cleave" tokenize --model "$model" --suite "$base.inp" >"$work/actual"; then
    echo "FAIL: cleave tokenize exited with an error for the salvaged copy of $base"
    exit 1
  fi
fi
if cmp -s "$work/actual" "$base.out"; then
  echo "OK: $name: $(wc -l <"$base.out") cases match$([ "$model" != "$base" ] && echo ' (salvaged copy)')"
  exit 0
fi
echo "FAIL: $name: output differs from $base.out (< expected, > cleave):"
diff "$base.out" "$work/actual" | head -40
exit 1
