#!/usr/bin/env python3
"""`nibble quant --format nvfp4 --4over6` against TransformerEngine's own 4over6 reference quantizer, byte for byte
(GPU machine or any host with torch; not run in CI).

    python3 scripts/parity/te_4over6_parity.py NIBBLE_BINARY WORK_DIR [--device cpu|cuda]
                                               [--te-reference FILE] [--transcription]

The reference, in this order:
  1. TransformerEngine installed: transformer_engine.pytorch.custom_recipes.reference_nvfp4.NVFP4QuantizerRef with
     nvfp4_use_4over6=True, nvfp4_e4m3_max=256, nvfp4_4over6_err_mode MAE or MSE, with_rht=False, tiles (1, 16) or
     (16, 16): TE's own reference code. TE's reference is plain PyTorch, so it runs on the CPU.
  2. --te-reference FILE: the same file, reference_nvfp4.py, taken from a TransformerEngine source tree and loaded
     with small stand-ins for the three TE modules it imports (gemm, reference_utils, quantized_tensor; none of them
     takes part in quantization): still TE's own reference code, without a TE build.
  3. Neither: the script says that TransformerEngine is not importable and exits 2, unless --transcription is given;
     then it compares against its own PyTorch transcription of TE's reference (te_4over6_transcription below,
     written from TE's published semantics), and every line says so: that run is NOT a comparison with TE's code.
With TE's code available (1 or 2) the transcription is compared with it too, so a later run without TE rests on a
transcription that has been checked against TE.

Inputs (BF16, seeded): normal (randn), outlier-heavy (1% of the values x100), lognormal (exp(2 z), random signs)
at 256x512 and 304x304, and a normal 256x512 clamped to 4.25 with one -4.375 (issue 31's amax, where the two
block-scale expressions round differently). Each through nibble quant with both rules (--fp4-4over6-err-mode
mae|mse) and both tilings (1x16, --2d), RHT and SR off; checked: row and column codes, row and column E4M3 scales,
and both stored amaxes equal to TE's global_amax_row / global_amax_col (the true amax). One line per case,
PASS or FAIL; the exit code is 1 when any fails.
"""
import argparse
import enum
import importlib.util
import json
import os
import struct
import subprocess
import sys
import types

import torch

FLT_MAX = 3.4028234663852886e38
SHAPES = ((256, 512), (304, 304))


# ---- safetensors by hand (no dependency beyond torch) ----------------------------------------------------------
def write_bf16_safetensors(path, name, x):
    raw = bytes(x.contiguous().view(torch.uint8).reshape(-1).tolist())
    header = json.dumps({name: {"dtype": "BF16", "shape": list(x.shape), "data_offsets": [0, len(raw)]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + raw)


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    meta = header.pop("__metadata__", {})
    out = {k: blob[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]] for k, v in header.items()}
    return out, meta


# ---- the script's own transcription of TE's 4over6 reference (used by --transcription, checked against TE) -----
E4M3_VALUES = torch.tensor([(m * 2.0 ** -9) if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
                            for e in range(16) for m in range(8)][:127], dtype=torch.float64)
E2M1_VALUES = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float32)


def e4m3_rne(x):
    """Codes (int64) of non-negative FP32 values <= 448, rounded to nearest E4M3, ties to the even code."""
    x64 = x.double()
    hi = torch.searchsorted(E4M3_VALUES, x64).clamp(max=126)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = x64 - E4M3_VALUES[lo], E4M3_VALUES[hi] - x64
    return torch.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)


def e2m1_codes(y):
    """TE's cast_to_fp4x2 thresholds on values clamped to [-6, 6] (round to nearest even on the E2M1 grid)."""
    a = y.abs()
    mag = torch.zeros_like(a, dtype=torch.int64)
    for bound, code, inclusive in ((0.25, 1, False), (0.75, 2, True), (1.25, 3, False), (1.75, 4, True),
                                   (2.5, 5, False), (3.5, 6, True), (5.0, 7, False)):
        mag = torch.where((a >= bound) if inclusive else (a > bound), torch.full_like(mag, code), mag)
    return torch.where(y < 0, mag | 8, mag)


def te_4over6_transcription(x, tile_rows, mse):
    """One copy of x [m, n] (BF16) as TE's _quantize_blockwise_4over6_reference: (packed codes uint8 [m, n/2],
    E4M3 scale bytes uint8 [m, n/16], amax). FP32 throughout, one operation at a time (no fused multiply-add)."""
    m, n = x.shape
    xf = x.float()
    amax = xf.abs().max()
    # torch.div, not `number / tensor`: PyTorch computes the latter as reciprocal() * number (two roundings).
    one = torch.tensor(1.0)
    s_enc = torch.clamp(torch.div(torch.tensor(256.0 * 6.0), amax), max=FLT_MAX)
    s_enc = torch.where(s_enc == 0, torch.ones_like(s_enc), s_enc)
    s_dec = torch.div(one, s_enc)
    xb = xf.view(m, n // 16, 16)
    if tile_rows == 16:
        vec_max = xf.view(m // 16, 16, n // 16, 16).abs().amax(dim=(1, 3)).repeat_interleave(16, dim=0)
    else:
        vec_max = xb.abs().amax(dim=-1)
    base = (vec_max / 6.0) * s_enc
    codes, scales, errs = [], [], []
    for factor in (1.0, 1.5):  # map to 6, map to 4
        s_code = e4m3_rne(torch.clamp(base * factor, max=448.0))
        sf = E4M3_VALUES[s_code].float()
        enc = torch.clamp(torch.div(one, sf * s_dec), max=FLT_MAX)
        q = e2m1_codes(torch.clamp(xb * enc.unsqueeze(-1), -6.0, 6.0))
        err = torch.zeros_like(vec_max)
        for i in range(16):
            val = E2M1_VALUES[q[:, :, i]] * sf
            val = val * amax
            val = val / 1536.0
            d = val - xb[:, :, i]
            err = err + (d * d if mse else d.abs())
        codes.append(q)
        scales.append(s_code)
        errs.append(err)
    err6, err4 = errs
    if tile_rows == 16:  # per-row errors summed pairwise over each tile's 16 rows (TE's warp reduction order)
        def tree(e):
            r = e.view(m // 16, 16, n // 16)
            for half in (8, 4, 2, 1):
                r = r[:, :half] + r[:, half:2 * half]
            return r[:, 0].repeat_interleave(16, dim=0)
        err6, err4 = tree(err6), tree(err4)
    pick4 = err4 < err6
    q = torch.where(pick4.unsqueeze(-1), codes[1], codes[0]).view(m, n)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
    return packed, torch.where(pick4, scales[1], scales[0]).to(torch.uint8), amax


def transcription_copies(x, tile_rows, mse):
    row = te_4over6_transcription(x, tile_rows, mse)
    col = te_4over6_transcription(x.t().contiguous(), tile_rows, mse)
    return {"row_data": row[0], "row_scales": row[1], "row_amax": row[2],
            "col_data": col[0], "col_scales": col[1], "col_amax": col[2]}


# ---- TE's own reference -----------------------------------------------------------------------------------------
def load_te_reference(path):
    """NVFP4QuantizerRef and reference_utils: from the installed TE, or from FILE with stand-ins for its imports."""
    if path is None:
        from transformer_engine.pytorch.custom_recipes import reference_nvfp4, reference_utils
        return reference_nvfp4.NVFP4QuantizerRef, reference_utils.Fp4Formats.E2M1, "TransformerEngine (installed)"
    pkgs = ["transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.custom_recipes"]
    for name in pkgs:
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__path__ = []
    gemm = types.ModuleType(pkgs[2] + ".gemm")  # only annotations and a default argument of qgemm use it
    gemm.MMParams = type("MMParams", (), {})
    gemm.GEMMType = enum.Enum("GEMMType", "FPROP DGRAD WGRAD")
    utils = types.ModuleType(pkgs[2] + ".reference_utils")
    utils.Fp4Formats = enum.Enum("Fp4Formats", {"E2M1": "e2m1"})
    utils.HIGH_PRECISION_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
    utils.roundup_div = lambda a, b: (a + b - 1) // b
    qt = types.ModuleType("transformer_engine.pytorch.quantized_tensor")

    class Quantizer:  # what NVFP4QuantizerRef reads of TE's base class
        def __init__(self, *, rowwise, columnwise):
            self.rowwise_usage, self.columnwise_usage, self.internal = rowwise, columnwise, False

    qt.Quantizer, qt.QuantizedTensorStorage = Quantizer, type("QuantizedTensorStorage", (), {})
    for mod in (gemm, utils, qt):
        sys.modules[mod.__name__] = mod
    setattr(sys.modules[pkgs[2]], "gemm", gemm)
    setattr(sys.modules[pkgs[2]], "reference_utils", utils)
    spec = importlib.util.spec_from_file_location(pkgs[2] + ".reference_nvfp4", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.NVFP4QuantizerRef, utils.Fp4Formats.E2M1, f"TransformerEngine's reference_nvfp4.py from {path}"


def te_copies(ref_class, e2m1, x, tile_rows, mse):
    q = ref_class(dtype=e2m1, rowwise=True, columnwise=True, pow_2_scales=False, eps=0.0,
                  quant_tile_shape=(tile_rows, 16), nvfp4_use_4over6=True, nvfp4_e4m3_max=256,
                  nvfp4_4over6_err_mode="MSE" if mse else "MAE", with_rht=False)
    r = q.quantize(x)
    return {"row_data": r.data.view(torch.uint8), "row_scales": r.scale.view(torch.uint8),
            "row_amax": r.global_amax_row.reshape(()), "col_data": r.data_t.view(torch.uint8),
            "col_scales": r.scale_t.view(torch.uint8), "col_amax": r.global_amax_col.reshape(())}


# ---- inputs, nibble, comparison ---------------------------------------------------------------------------------
def inputs():
    g = torch.Generator().manual_seed(31)
    for rows, cols in SHAPES:
        z = torch.randn(rows, cols, generator=g)
        yield f"normal {rows}x{cols}", z.bfloat16()
        hit = torch.rand(rows, cols, generator=g) < 0.01
        yield f"outliers {rows}x{cols}", torch.where(hit, z * 100, z).bfloat16()
        sign = torch.where(torch.rand(rows, cols, generator=g) < 0.5, -torch.ones(rows, cols), torch.ones(rows, cols))
        yield f"lognormal {rows}x{cols}", (torch.exp(2 * torch.randn(rows, cols, generator=g)) * sign).bfloat16()
    z = torch.randn(256, 512, generator=g).clamp(-4.25, 4.25)
    z[0, 7] = -4.375
    yield "normal 256x512 amax 4.375", z.bfloat16()


def run_nibble(binary, work, x, mse, two_d, device):
    src, out = os.path.join(work, "x.safetensors"), os.path.join(work, "q.safetensors")
    write_bf16_safetensors(src, "x", x)
    cmd = [binary, "quant", "--input", src, "--tensor", "x", "--format", "nvfp4", "--4over6", "--fp4-4over6-err-mode",
           "mse" if mse else "mae", "--device", device, "--out", out] + (["--2d"] if two_d else [])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    t, meta = read_safetensors(out)
    rows, cols = x.shape
    u8 = lambda k, shape: torch.frombuffer(bytearray(t[k]), dtype=torch.uint8).view(*shape)  # noqa: E731
    f32 = lambda k: torch.frombuffer(bytearray(t[k]), dtype=torch.float32)[0]  # noqa: E731
    return {"row_data": u8("row_data", (rows, cols // 2)), "row_scales": u8("row_scales", (rows, cols // 16)),
            "row_amax": f32("row_amax"), "col_data": u8("col_data", (cols, rows // 2)),
            "col_scales": u8("col_scales", (cols, rows // 16)), "col_amax": f32("col_amax")}, meta


def differences(a, b):
    """Names of the fields that differ, with the count of differing elements."""
    out = []
    for k in ("row_data", "row_scales", "col_data", "col_scales"):
        n = int((a[k].to(torch.int64) != b[k].to(torch.int64)).sum())
        if n:
            out.append(f"{k} {n} differ")
    for k in ("row_amax", "col_amax"):
        if float(a[k]) != float(b[k]):
            out.append(f"{k} {float(a[k])} vs {float(b[k])}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("nibble")
    ap.add_argument("work")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where nibble quantizes")
    ap.add_argument("--te-reference", help="TE's transformer_engine/pytorch/custom_recipes/reference_nvfp4.py")
    ap.add_argument("--transcription", action="store_true",
                    help="without TE: compare with this script's own transcription of TE's reference")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    try:
        ref_class, e2m1, ref_name = load_te_reference(args.te_reference)
    except Exception as e:  # noqa: BLE001  (any import failure means: no TE code to compare with)
        print(f"TransformerEngine is not importable here ({type(e).__name__}: {e}).")
        if not args.transcription:
            print("No comparison made. Install TransformerEngine, pass --te-reference FILE (its reference_nvfp4.py), "
                  "or pass --transcription to compare with this script's own transcription instead.")
            return 2
        ref_class, ref_name = None, "the script's own PyTorch transcription of TE's reference (NOT TE's code)"
    print(f"reference: {ref_name}; nibble on {args.device}; torch {torch.__version__}", flush=True)
    failed = 0
    for name, x in inputs():
        for mse in (False, True):
            for two_d in (False, True):
                case = f"{name} {'mse' if mse else 'mae'} {'16x16' if two_d else '1x16'}"
                got, meta = run_nibble(args.nibble, args.work, x, mse, two_d, args.device)
                mine = transcription_copies(x, 16 if two_d else 1, mse)
                ref = te_copies(ref_class, e2m1, x, 16 if two_d else 1, mse) if ref_class else mine
                diff = differences(got, ref)
                if meta.get("nvfp4_4over6") != ("mse" if mse else "mae") or meta.get("nvfp4_e4m3_max") != "256":
                    diff.append(f"metadata {meta}")
                label = "nibble vs TE" if ref_class else "nibble vs transcription (not TE)"
                print(f"{'FAIL' if diff else 'PASS'} {label} {case}: "
                      + ("; ".join(diff) if diff else f"bytes identical, amax {float(got['row_amax'])}"), flush=True)
                failed += bool(diff)
                if ref_class:
                    tdiff = differences(mine, ref)
                    print(f"{'FAIL' if tdiff else 'PASS'} transcription vs TE {case}: "
                          + ("; ".join(tdiff) if tdiff else "identical"), flush=True)
                    failed += bool(tdiff)
    print(f"{'FAILED' if failed else 'ALL PASSED'} ({failed} failing lines) against {ref_name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
