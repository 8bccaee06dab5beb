#!/usr/bin/env bash
# Installs everything cleave needs to build and test, by package name from Debian and PyPI.
# Idempotent: packages already present are left alone; apt's lists are refreshed only when
# something is missing. Run as root (or with sudo available).
set -euo pipefail

APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config git python3 python3-pip
  clang libclang-rt-14-dev          # sanitizer and libFuzzer builds
  libgtest-dev libgmock-dev libbenchmark-dev
  libspdlog-dev libfmt-dev libyaml-cpp-dev nlohmann-json3-dev libcli11-dev
  libicu-dev                        # Unicode categories for the BPE pre-tokenizers
  libfabric-dev                     # transfer engine (tcp, shm, verbs, efa providers)
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc  # control plane, gRPC API
  libboost1.81-dev                  # Boost.Beast/Asio: the router's HTTP frontend
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
  python3 -m pip show "${spec%%==*}" 2>/dev/null | grep -qx "Version: ${spec##*==}" ||
    pinned_missing+=("$spec")
done
if [ "${#pinned_missing[@]}" -gt 0 ]; then
  echo "install-deps: pip installing ${pinned_missing[*]}" >&2
  python3 -m pip install -q "${pinned_missing[@]}" 2>/dev/null ||
    python3 -m pip install -q --break-system-packages "${pinned_missing[@]}"
fi
