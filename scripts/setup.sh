#!/usr/bin/env bash
# Installs nibble's build dependencies from Debian packages; downloads nothing else.
# The CUDA toolkit (nvcc, cuBLASLt, cuDNN, NCCL) is optional: without nvcc nibble builds its CPU backend only.
set -euo pipefail
pkgs=(cmake ninja-build g++ libgtest-dev libcli11-dev nlohmann-json3-dev libpcre2-dev libtomlplusplus-dev zlib1g-dev libgloo-dev
      libprotobuf-dev protobuf-compiler libboost-dev)
# --fuzz: also clang and libFuzzer (scripts/fuzz.sh).
[ "${1:-}" = "--fuzz" ] && pkgs+=(clang-14 libfuzzer-14-dev libclang-rt-14-dev)
# --lint: clang-format and clang-tidy, pinned to 14 (scripts/format.sh, scripts/tidy.sh).
[ "${1:-}" = "--lint" ] && pkgs+=(clang-format-14 clang-tidy-14)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi
