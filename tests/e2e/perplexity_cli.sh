#!/usr/bin/env bash
# Usage: perplexity_cli.sh CLEAVE_BINARY MODELS_DIR
# `cleave perplexity` on stories260K: the figure on stdout, progress on stderr, the same figure
# whatever --batch, and clear errors for a bad --ctx, a missing file and a text too short for one
# window. (The figure itself is checked against an independent computation in
# tests/unit/engine/perplexity_test.cpp.)
set -u
cleave="$1"
models="$2"
model="$models/stories260K.gguf"
text="$models/stories260K-empty.txt"
if [[ ! -f "$model" || ! -f "$text" ]]; then
  echo "SKIP: $model or $text is absent (../shared not checked out)" >&2
  exit 77
fi
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*" >&2; echo "--- stderr:" >&2; cat "$dir/err" >&2; exit 1; }

run() {  # run EXPECTED_RC ARGS...: stdout in $dir/out, stderr in $dir/err
  local want="$1"; shift
  "$cleave" perplexity --threads 2 "$@" >"$dir/out" 2>"$dir/err"
  local rc=$?
  [[ $rc -eq $want ]] || fail "cleave perplexity $* exited with $rc, expected $want"
}

run 0 --model "$model" --file "$text" --ctx 32
grep -Eq '^PPL = [0-9]+\.[0-9]{4} \+/- [0-9]+\.[0-9]+ \([0-9]+ tokens scored in [0-9]+ windows of 32\)$' "$dir/out" ||
  fail "unexpected stdout: $(cat "$dir/out")"
grep -q 'window 1/' "$dir/err" || fail "no progress line on stderr"
ppl="$(cut -d' ' -f3 "$dir/out")"
run 0 --model "$model" --file "$text" --ctx 32 --batch 5
[[ "$(cut -d' ' -f3 "$dir/out")" == "$ppl" ]] || fail "--batch 5 gives $(cat "$dir/out"), not PPL $ppl"

run 2 --model "$model" --file "$text" --ctx 2
grep -q -- '--ctx' "$dir/err" || fail "the --ctx 2 error does not name --ctx"
run 1 --model "$model" --file "$text" --ctx 4096
grep -q -- '--ctx 4096 exceeds' "$dir/err" || fail "the --ctx 4096 error does not say why"
run 1 --model "$model" --file "$dir/missing.txt"
grep -q "cannot open text file '$dir/missing.txt'" "$dir/err" || fail "no error naming the missing file"
run 1 --model "$model" --file "$text" --ctx 1024
grep -q 'fewer than one window of ctx = 1024' "$dir/err" || fail "no error for a text shorter than a window"
echo "OK: PPL $ppl on $(basename "$text") (ctx 32), errors as expected"
