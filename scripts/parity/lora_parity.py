#!/usr/bin/env python3
"""LoRA parity of nibble against Hugging Face PEFT (GPU machine or any host with torch, transformers, peft,
safetensors, numpy; not run in CI).

    python3 scripts/parity/lora_parity.py NIBBLE_BINARY WORK_DIR [--device cpu|cuda]

1. Writes a small random Llama (transformers, FP32) and a PEFT LoRA on all seven projections with random,
   non-zero A and B. q/k/v (and gate/up) share one A, as a fused nibble LoRA does.
2. Loss, logits and adapter gradients: PEFT (torch FP32, TF32 off) against `nibble eval --adapter` on the
   same tokens. nibble's gradients are per fused linear: A's is the sum of PEFT's q, k, v (gate, up) A
   gradients, B's their rows stacked.
3. nibble trains an adapter (`nibble train --peft lora --load-hf`), PeftModel.from_pretrained loads the
   folder nibble wrote, and its logits are compared with `nibble eval --adapter` of that folder.
Bounds (stated, derived from FP32 summation-order noise): on --device cpu both sides compute in FP32:
loss within 1e-5 relative, logits within 1e-4 absolute, each gradient's relative L2 error below 1e-4. On
cuda nibble runs BF16 GEMMs against PEFT's FP32: loss within 1e-2 relative, gradients' relative L2 below
5e-2 (the bound the CUDA-vs-CPU model test uses). Exits 1 when any bound fails.
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.numpy import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

FUSED = {"self_attn.linear_qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
         "self_attn.linear_proj": ["self_attn.o_proj"],
         "mlp.linear_fc1": ["mlp.gate_proj", "mlp.up_proj"],
         "mlp.linear_fc2": ["mlp.down_proj"]}
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_base(path):
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=256,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float()
    model.save_pretrained(path, safe_serialization=True)
    return model


def make_adapter(model, path, rank=8, alpha=16):
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                                                  target_modules=MODULES, bias="none"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in peft_model.base_model.model.model.layers:
            for fused, parts in FUSED.items():
                mods = [layer.get_submodule(p) for p in parts]
                a = torch.randn(mods[0].lora_A["default"].weight.shape, generator=g) * 0.05
                for m in mods:
                    m.lora_A["default"].weight.copy_(a)
                    m.lora_B["default"].weight.copy_(torch.randn(m.lora_B["default"].weight.shape, generator=g) * 0.05)
    peft_model.save_pretrained(path)
    return peft_model


def torch_loss_grads(peft_model, tokens):
    peft_model.zero_grad()
    ids = torch.tensor(tokens).long()
    logits = peft_model(input_ids=ids[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {}
    for i, layer in enumerate(peft_model.base_model.model.model.layers):
        for fused, parts in FUSED.items():
            mods = [layer.get_submodule(p) for p in parts]
            ga = sum(m.lora_A["default"].weight.grad for m in mods)
            gb = torch.cat([m.lora_B["default"].weight.grad for m in mods], 0)
            grads[f"grad.model.layers.{i}.{fused}.lora_A.weight"] = ga.numpy()
            grads[f"grad.model.layers.{i}.{fused}.lora_B.weight"] = gb.numpy()
    return float(loss), logits.detach().numpy(), grads


def nibble_eval(binary, base, adapter, tok_file, out, device):
    subprocess.run([binary, "eval", "--load-hf", base, "--adapter", adapter, "--tokens", tok_file, "--out", out,
                    "--device", device], check=True)
    return load_file(out)


def rel_l2(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("work")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    os.makedirs(args.work, exist_ok=True)
    base, adapter = f"{args.work}/base", f"{args.work}/adapter"
    peft_model = make_adapter(make_base(base), adapter)
    tokens = np.random.default_rng(2).integers(0, 256, size=(2, 65)).astype(np.int32)
    tok_file = f"{args.work}/tokens.safetensors"
    save_file({"tokens": tokens}, tok_file)
    tight = args.device == "cpu"
    loss_tol, grad_tol, logit_tol = (1e-5, 1e-4, 1e-4) if tight else (1e-2, 5e-2, 0.1)
    report, ok = {"device": args.device}, True

    t_loss, t_logits, t_grads = torch_loss_grads(peft_model, tokens)
    n = nibble_eval(args.binary, base, adapter, tok_file, f"{args.work}/nibble_eval.safetensors", args.device)
    n_loss = float(n["loss"][0])
    report["loss"] = {"peft": t_loss, "nibble": n_loss, "rel_diff": abs(n_loss - t_loss) / abs(t_loss)}
    ok &= report["loss"]["rel_diff"] < loss_tol
    report["logits_max_abs_diff"] = float(np.abs(n["logits"] - t_logits).max())
    ok &= report["logits_max_abs_diff"] < logit_tol
    worst = max((rel_l2(n[k], v), k) for k, v in t_grads.items())
    report["grad_rel_l2_worst"] = {"value": worst[0], "tensor": worst[1], "count": len(t_grads)}
    ok &= worst[0] < grad_tol and all(k in n for k in t_grads)

    # nibble trains an adapter; PEFT loads what nibble wrote.
    run = f"{args.work}/train"
    subprocess.run([args.binary, "train", "--load-hf", base, "--peft", "lora", "--lora-rank", "8",
                    "--train-iters", "3", "--lr", "1e-2", "--seq-length", "64", "--global-batch-size", "2",
                    "--device", args.device, "--save", run], check=True, stdout=subprocess.DEVNULL)
    trained = f"{run}/peft_adapter_iter_0000003"
    loaded = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32), trained)
    with torch.no_grad():
        p_logits = loaded(input_ids=torch.tensor(tokens[:, :-1]).long()).logits.numpy()
    n2 = nibble_eval(args.binary, base, trained, tok_file, f"{args.work}/nibble_trained.safetensors", args.device)
    report["trained_adapter_logits_max_abs_diff"] = float(np.abs(n2["logits"] - p_logits).max())
    ok &= report["trained_adapter_logits_max_abs_diff"] < logit_tol
    report["bounds"] = {"loss_rel": loss_tol, "grad_rel_l2": grad_tol, "logits_abs": logit_tol}
    report["pass"] = bool(ok)
    print(json.dumps(report, indent=2))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
