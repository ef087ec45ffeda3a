#!/usr/bin/env bash
# Builds nibble and runs its main job. For now: `nibble info` and a quantization demo
# (NVFP4 with 2D blocks, RHT and stochastic rounding on a heavy-tailed random tensor).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake --preset default >/dev/null
cmake --build --preset default -j "$(nproc)"
./build/nibble info
mkdir -p runs
./build/nibble quant --random 1024,1024 --dist outliers --format nvfp4 --rht --sr --seed 1234 --out runs/demo_nvfp4.safetensors
