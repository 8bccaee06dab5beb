#!/usr/bin/env bash
# Compares the README's generated settings table with `cleave config table`.
set -eu
cleave="$1"
readme="$2"
expected="$(mktemp)"; actual="$(mktemp)"
trap 'rm -f "$expected" "$actual"' EXIT
"$cleave" config table >"$expected"
sed -n '/<!-- settings-table/,/<!-- end settings-table/p' "$readme" | sed '1d;$d' >"$actual"
if ! diff -u "$actual" "$expected"; then
  echo "FAIL: README.md's settings table is stale; regenerate it with: cleave config table"
  exit 1
fi
echo "OK: README settings table lists all $(($(wc -l <"$expected") - 2)) settings"
