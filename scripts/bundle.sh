#!/usr/bin/env bash
# Packs a build for a GPU machine that has the CUDA libraries but not Debian's -dev packages: the nibble
# binary, every test executable, and in lib/ the shared libraries they need that are not CUDA's or
# libc's (Gloo and its dependencies). Run there with LD_LIBRARY_PATH=<bundle>/lib.
# Usage: bash scripts/bundle.sh [build-dir] [bundle-dir]
set -euo pipefail
build=${1:-build}
out=${2:-build-bundle}
rm -rf "$out" && mkdir -p "$out/tests" "$out/lib"
cp "$build/nibble" "$out/"
for t in "$build"/tests/test_*; do [ -x "$t" ] && [ -f "$t" ] && cp "$t" "$out/tests/"; done
ldd "$build/nibble" | awk '/=> \// {print $3}' | grep -vE "cuda|libc\.so|libm\.so|libstdc|libgcc|ld-linux|libpthread|libdl|librt" |
  while read -r lib; do cp -L "$lib" "$out/lib/"; done
echo "bundle: $(du -sh "$out" | cut -f1) in $out ($(ls "$out/lib" | wc -l) libraries in lib/)"
