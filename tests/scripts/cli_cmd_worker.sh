#!/usr/bin/env bash
# `cleave worker`'s flags (src/cli/cmd_worker.cpp): an unknown flag and a router-only flag are
# refused (exit 2, the message names the flag); a bad value of a worker flag is refused naming
# its setting; and a worker started with every worker flag serves and stops on SIGTERM (exit 0).
# Usage: cli_cmd_worker.sh CLEAVE_BINARY MODELS_DIR
# Exit 0: pass; 1: fail; 77: the refusals passed but MODELS_DIR has no stories260K.gguf (ctest SKIP).
set -u
cleave="$1"
model="$2/stories260K.gguf"
fail() { echo "FAIL: $*"; exit 1; }

# refused NEEDLE ARGS...: `cleave worker ARGS...` exits 2 and its stderr contains NEEDLE.
refused() {
  local needle="$1" err rc
  shift
  err="$("$cleave" worker "$@" 2>&1 >/dev/null)"
  rc=$?
  [ "$rc" -eq 2 ] || fail "cleave worker $* exited $rc, expected 2; stderr: $err"
  grep -qF -- "$needle" <<<"$err" || fail "cleave worker $*: stderr does not name '$needle': $err"
  echo "OK: cleave worker $* refused: $(head -1 <<<"$err")"
}
# (--listen nohost: a flag accepted by mistake fails at once, without naming the flag.)
refused --no-such-flag --listen nohost --no-such-flag 1
refused --no-such-flag --role unified --listen nohost --no-such-flag=1
for flag in --port --host --grpc-port --api-keys --max-queue --mode --served-model-name; do
  refused "$flag" --role unified --listen nohost "$flag" 1
done
refused worker.role --role bogus
refused "'nohost'" --listen nohost

if [ ! -f "$model" ]; then
  echo "SKIP: $model not found: the worker start was not checked"
  exit 77
fi
work="$(mktemp -d)"
pid=""
trap '[ -n "$pid" ] && kill -KILL "$pid" 2>/dev/null; rm -rf "$work"' EXIT
printf 'log:\n  level: warn\nrouter:\n  port: 1\n' >"$work/cleave.yaml"
"$cleave" worker --config "$work/cleave.yaml" --set worker.drain_seconds=0 --role unified \
  --id flags-test --model "$model" --listen 127.0.0.1:0 --metrics-port 0 --log-level warn \
  --threads 1 --max-context 256 --block-size 16 --kv-blocks 0 --kv-cache-bytes 16777216 \
  --kv-dtype f32 --max-tokens-per-step 64 --max-num-seqs 4 --transfer-provider auto \
  --transfer-rails 1 --instance-type test >"$work/out" 2>"$work/err" &
pid=$!
for _ in $(seq 300); do
  grep -q '^cleave worker unified flags-test listening on 127\.0\.0\.1:[0-9]*$' "$work/out" && break
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.1
done
grep -q 'listening on' "$work/out" || fail "the worker did not start; stdout: $(cat "$work/out"); stderr: $(cat "$work/err")"
echo "OK: $(cat "$work/out")"
kill -TERM "$pid"
wait "$pid"
rc=$?
pid=""
[ "$rc" -eq 0 ] || fail "the worker exited $rc after SIGTERM; stderr: $(cat "$work/err")"
echo "OK: the worker stopped on SIGTERM (exit 0)"
