#!/usr/bin/env python3
"""Parity of nibble's Hugging Face Llama import/export with transformers (GPU machine only; not CI).

    python3 scripts/hf_parity.py fixture OUTDIR        # the golden fixture of tests/io (tens of KB)
    python3 scripts/hf_parity.py check BUILD_DIR OUTDIR [--skip-cuda]  # nibble eval / export vs transformers

Needs torch, transformers (5.x; 4.x works too) and safetensors. Models are random LlamaForCausalLM with
GQA, llama3 RoPE scaling whose three frequency bands (kept, smoothed, divided) all occur, an untied head,
and weights rescaled so that activations are O(1) and attention is far from uniform (the default 0.02
init would make RoPE or GQA mistakes invisible). Weights are rounded to BF16 before anything is computed,
so both sides start from identical values (BF16 is exact in FP32).

Bounds (u = 2^-24, the FP32 unit roundoff; u_bf = 2^-8, BF16's):
  * nibble CPU (FP32 throughout) vs transformers FP32 (TF32 off, eager attention): a length-K FP32 dot
    product is within K*u*sum|a_i b_i| of exact (Higham's gamma_K); with O(1)-normalized activations the
    sum is of the order of the largest output. Chaining n = 10*L + 2 stages (per layer norm, qkv, scores,
    softmax, PV, o, norm, gate/up, SwiGLU, down; final norm, head) with K = max(hidden, ffn, seq) puts each
    side within n*K*u of exact relative to the logits' scale, so
        max|dlogit| <= 2*n*K*u * max(1, max|logit|),  |dloss| <= 2 * that (log-softmax is 2-Lipschitz
    in the max norm per token).
  * nibble CUDA (bf16_mixed: BF16 activations, FP32 accumulation, norms and loss) vs transformers FP32:
    the weights are BF16 already, so the error is the BF16 rounding of about n activation tensors on the
    path to the logits, each off by a relative error uniform in +-u_bf (rms u_bf/sqrt(3)); independent
    roundings add in quadrature and the normalized network passes them on with gain about 1:
        rel_rms = ||dlogits||_2 / ||logits||_2 <= 3 * u_bf/sqrt(3) * sqrt(n)   (3x safety)
        max|dlogit| <= 5 * rel_rms_bound * rms(logits),  |dloss| <= 2 * rel_rms_bound * rms(logits).
  * Re-export (bf16 -> FP32 in nibble -> bf16) is exact: the reloaded state dict must equal the original
    bit for bit, and its logits equal the original model's within the CPU-path bound (they are identical
    computations, so they are expected to be equal).
Every check prints one line: name, max abs and max rel (to max|logit|) difference, the bound, PASS/FAIL.
The exit code is 1 when any check fails.
"""
import json
import math
import os
import shutil
import subprocess
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

U32 = 2.0 ** -24
UBF = 2.0 ** -8


def tiny_config():
    """The fixture: head_dim 8, theta 1e4 -> wavelengths 6.3, 63, 628, 6283; with original 64, low 1,
    high 4 the first is kept (< 16), the second smoothed (16..64), the rest divided by 8."""
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128, max_position_embeddings=128, rms_norm_eps=1e-5,
                rope_theta=10000.0, tie_word_embeddings=False,
                rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=64))


def check_config():
    """head_dim 32, Llama 3.1's RoPE (theta 5e5, factor 8, original 8192): all three bands occur."""
    return dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=2, vocab_size=1024, max_position_embeddings=131072, rms_norm_eps=1e-5,
                rope_theta=500000.0, tie_word_embeddings=False,
                rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8192))


def build_model(cfg, seed):
    """A random model with O(1) activations, weights rounded to BF16 (kept in FP32 for computing)."""
    torch.manual_seed(seed)
    # rope_scaling + a top-level rope_theta: transformers 4.x reads them natively, 5.x converts them.
    config = LlamaConfig(**cfg)
    config._attn_implementation = "eager"  # the plain softmax(QK^T)V path, no fused kernel
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 1.0)
            elif p.dim() == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
            else:  # norm weights: not all ones, so a norm applied to the wrong tensor shows
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            p.copy_(p.to(torch.bfloat16).float())
    return model


def make_tokens(batch, seq_plus_1, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq_plus_1), generator=g, dtype=torch.int32)


def forward(model, tokens, device):
    """FP32 logits [B, S, V] and the mean token loss of inputs tokens[:, :-1], labels tokens[:, 1:]."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = model.to(device).float().eval()
    ids = tokens[:, :-1].long().to(device)
    labels = tokens[:, 1:].long().to(device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return logits.cpu(), float(loss)


def save_bf16(model, out_dir, max_shard_size="5GB"):
    model.to(torch.bfloat16).save_pretrained(out_dir, max_shard_size=max_shard_size)
    model.float()


def load_pretrained(path, dtype):
    # transformers 5.x names the argument dtype; 4.x torch_dtype (an unknown keyword would be ignored).
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    return LlamaForCausalLM.from_pretrained(path, attn_implementation="eager", **{key: dtype})


def cmd_fixture(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    cfg = tiny_config()
    model = build_model(cfg, seed=1234)
    save_bf16(model, out_dir)
    tokens = make_tokens(2, 17, cfg["vocab_size"], seed=4321)
    # The reference comes from the saved files, upcast to FP32, as nibble will read them.
    logits, loss = forward(load_pretrained(out_dir, torch.float32), tokens, "cpu")
    save_file({"tokens": tokens.contiguous()}, os.path.join(out_dir, "tokens.safetensors"))
    save_file({"logits": logits.contiguous(), "loss": torch.tensor([loss], dtype=torch.float32)},
              os.path.join(out_dir, "expected.safetensors"))
    total = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    print(f"fixture {out_dir}: {sorted(os.listdir(out_dir))}, {total / 1024:.1f} KiB, loss {loss:.6f}, "
          f"max|logit| {logits.abs().max():.4f}")


class Checks:
    def __init__(self):
        self.failed = 0

    def report(self, name, ok, text):
        print(f"{'PASS' if ok else 'FAIL'} {name}: {text}")
        self.failed += 0 if ok else 1

    def logits(self, name, got, ref, bound_abs, loss_got, loss_ref, bound_loss, rel_rms_bound=None):
        d = (got - ref).abs()
        scale = float(ref.abs().max())
        max_abs, rel_rms = float(d.max()), float((got - ref).norm() / ref.norm())
        ok = max_abs <= bound_abs and abs(loss_got - loss_ref) <= bound_loss
        text = (f"max abs {max_abs:.3g} max rel {max_abs / scale:.3g} (bound {bound_abs:.3g}); "
                f"loss {loss_got:.6f} vs {loss_ref:.6f} diff {abs(loss_got - loss_ref):.3g} (bound {bound_loss:.3g})")
        if rel_rms_bound is not None:
            ok = ok and rel_rms <= rel_rms_bound
            text += f"; rel rms {rel_rms:.3g} (bound {rel_rms_bound:.3g})"
        self.report(name, ok, text)


def nibble_eval(build_dir, model_dir, tokens_file, out_file, device):
    cmd = [os.path.join(build_dir, "nibble"), "eval", "--load-hf", model_dir, "--tokens", tokens_file,
           "--out", out_file, "--device", device]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"nibble eval failed ({' '.join(cmd)}):\n{r.stdout}{r.stderr}")
    t = load_file(out_file)
    return t["logits"], float(t["loss"][0])


def write_v4_config(src_dir, dst_dir):
    """The same model with a config.json in transformers 4.x spelling only (the Hub's Llama 3.1 files)."""
    shutil.copytree(src_dir, dst_dir)
    with open(os.path.join(src_dir, "config.json")) as f:
        c = json.load(f)
    rope = c.pop("rope_parameters", None) or c.get("rope_scaling") or {}
    c["rope_theta"] = rope.get("rope_theta", c.get("rope_theta"))
    c["rope_scaling"] = {k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                              "original_max_position_embeddings", "rope_type")}
    c["torch_dtype"] = c.pop("dtype", "bfloat16")
    with open(os.path.join(dst_dir, "config.json"), "w") as f:
        json.dump(c, f, indent=2)


def check_export(checks, build_dir, src_dir, out_dir, ref_logits, tokens, cpu_bound):
    exp = os.path.join(out_dir, "export_bf16")
    shutil.rmtree(exp, ignore_errors=True)
    r = subprocess.run([os.path.join(build_dir, "nibble"), "export", "--hf", exp, "--load-hf", src_dir,
                        "--dtype", "bf16", "--max-shard-size", "300KB"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"nibble export failed:\n{r.stdout}{r.stderr}")
    orig = load_pretrained(src_dir, torch.bfloat16).state_dict()
    back = load_pretrained(exp, torch.bfloat16).state_dict()
    same_keys = set(orig) == set(back)
    diff_bits = [k for k in orig if k in back and not torch.equal(orig[k].view(torch.int16), back[k].view(torch.int16))]
    checks.report("export bf16 weights bit-identical", same_keys and not diff_bits,
                  f"{len(orig)} tensors, keys equal {same_keys}, differing {diff_bits[:3]}")
    cfg = AutoConfig.from_pretrained(exp)
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    checks.report("export config read by transformers", rope.get("rope_type") == "llama3" and
                  float(rope.get("factor", 0)) == 8.0, f"rope {rope}")
    logits, loss = forward(load_pretrained(exp, torch.float32), tokens, "cuda")
    d = float((logits - ref_logits).abs().max())
    checks.report("export reload logits", d <= cpu_bound, f"max abs {d:.3g} (bound {cpu_bound:.3g})")


def cmd_check(build_dir, out_dir, skip_cuda=False):
    os.makedirs(out_dir, exist_ok=True)
    cfg = check_config()
    model = build_model(cfg, seed=99)
    base, sharded, v4 = (os.path.join(out_dir, n) for n in ("model", "model_sharded", "model_v4"))
    for d in (base, sharded, v4):
        shutil.rmtree(d, ignore_errors=True)
    save_bf16(model, base)
    save_bf16(model, sharded, max_shard_size="300KB")
    write_v4_config(base, v4)
    tokens = make_tokens(2, 129, cfg["vocab_size"], seed=7)
    tokens_file = os.path.join(out_dir, "tokens.safetensors")
    save_file({"tokens": tokens.contiguous()}, tokens_file)
    ref, ref_loss = forward(load_pretrained(base, torch.float32), tokens, "cuda")
    layers, seq = cfg["num_hidden_layers"], tokens.shape[1] - 1
    n = 10 * layers + 2
    k = max(cfg["hidden_size"], cfg["intermediate_size"], seq)
    scale = max(1.0, float(ref.abs().max()))
    cpu_bound = 2 * n * k * U32 * scale
    rel_rms_bound = 3 * UBF / math.sqrt(3) * math.sqrt(n)
    rms_ref = float(ref.pow(2).mean().sqrt())
    checks = Checks()
    print(f"reference: transformers FP32 on cuda, loss {ref_loss:.6f}, max|logit| {scale:.3f}, rms {rms_ref:.3f}, "
          f"n={n} stages, K={k}")
    cpu, cpu_loss = nibble_eval(build_dir, base, tokens_file, os.path.join(out_dir, "cpu.safetensors"), "cpu")
    checks.logits("nibble cpu (fp32) vs transformers", cpu, ref, cpu_bound, cpu_loss, ref_loss, 2 * cpu_bound)
    if skip_cuda:  # a CPU-only nibble build: the CUDA path is left out, and said so
        print("SKIP nibble cuda (bf16_mixed) vs transformers: --skip-cuda")
    else:
        gpu, gpu_loss = nibble_eval(build_dir, base, tokens_file, os.path.join(out_dir, "cuda.safetensors"), "cuda")
        checks.logits("nibble cuda (bf16_mixed) vs transformers", gpu, ref, 5 * rel_rms_bound * rms_ref, gpu_loss,
                      ref_loss, 2 * rel_rms_bound * rms_ref, rel_rms_bound)
    for name, d in (("sharded folder", sharded), ("4.x config spelling", v4)):
        got, got_loss = nibble_eval(build_dir, d, tokens_file, os.path.join(out_dir, "x.safetensors"), "cpu")
        diff = float((got - cpu).abs().max())
        checks.report(f"nibble cpu, {name} == single folder", diff == 0.0 and got_loss == cpu_loss,
                      f"max abs {diff:.3g} (bound 0: same weights, same computation)")
    check_export(checks, build_dir, base, out_dir, ref, tokens, cpu_bound)
    print(f"{checks.failed} check(s) failed" if checks.failed else "all checks passed")
    return 1 if checks.failed else 0


def main(argv):
    if len(argv) == 3 and argv[1] == "fixture":
        cmd_fixture(argv[2])
        return 0
    if len(argv) in (4, 5) and argv[1] == "check" and argv[4:] in ([], ["--skip-cuda"]):
        return cmd_check(argv[2], argv[3], skip_cuda=len(argv) == 5)
    print(__doc__.split("\n\n")[1])
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
