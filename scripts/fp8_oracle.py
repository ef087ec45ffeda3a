#!/usr/bin/env python3
"""PyTorch oracle for nibble's FP8 scalar codecs.

Writes a safetensors file with FP32 inputs and the codes PyTorch produces for them:
  input  F32 [N]  every BF16 bit pattern (as FP32), random FP32 values over many binades, and
                  boundaries: every E4M3/E5M2 value, the midpoints between neighbours, one FP32 ulp
                  either side of each, saturation values, Inf and NaN
  e4m3   U8  [N]  x.clamp(-448, 448).to(torch.float8_e4m3fn)
  e5m2   U8  [N]  x.clamp(-57344, 57344).to(torch.float8_e5m2)
PyTorch's casts do not saturate (out-of-range values become NaN/Inf), while nibble's encoders are
"satfinite"; clamping to +-max first gives the saturating behaviour. NaN stays NaN under clamp, so
for NaN inputs only "is a NaN code" is compared (PyTorch may pick a different NaN payload).

Usage (on a machine with PyTorch and the safetensors package):
  python3 scripts/fp8_oracle.py OUT.safetensors [--check BUILD_DIR]
--check runs BUILD_DIR/tests/test_formats --gtest_filter='Fp8Oracle.*' with NIBBLE_FP8_ORACLE=OUT.
"""
import argparse
import os
import subprocess
import sys

import torch
from safetensors.torch import save_file


def codec_values(dtype):
    codes = torch.arange(256, dtype=torch.uint8)
    vals = codes.view(dtype).float()
    return vals[torch.isfinite(vals)]


def boundaries():
    out = []
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        v = torch.unique(codec_values(dtype))
        mids = (v[1:] + v[:-1]) / 2  # exact in FP32
        for t in (v, mids):
            out += [t, torch.nextafter(t, torch.full_like(t, float("inf"))),
                    torch.nextafter(t, torch.full_like(t, -float("inf")))]
    sat = torch.tensor([448.0, 449.0, 464.0, 480.0, 57344.0, 61440.0, 65536.0, 1e30, 3.4e38,
                        float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e-40, -1e-45])
    out.append(sat)
    return torch.cat(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--check", metavar="BUILD_DIR")
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()

    g = torch.Generator().manual_seed(a.seed)
    all_bf16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    rand = torch.randn(1 << 18, generator=g) * torch.pow(2.0, torch.randint(-30, 30, (1 << 18,), generator=g).float())
    x = torch.cat([all_bf16, rand, boundaries()]).contiguous()

    e4m3 = x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    e5m2 = x.clamp(-57344.0, 57344.0).to(torch.float8_e5m2).view(torch.uint8)
    save_file({"input": x, "e4m3": e4m3.contiguous(), "e5m2": e5m2.contiguous()}, a.out,
              metadata={"torch": torch.__version__})
    print(f"wrote {a.out}: {x.numel()} inputs, torch {torch.__version__}")

    if a.check:
        exe = os.path.join(a.check, "tests", "test_formats")
        env = dict(os.environ, NIBBLE_FP8_ORACLE=os.path.abspath(a.out))
        return subprocess.call([exe, "--gtest_filter=Fp8Oracle.*"], env=env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
