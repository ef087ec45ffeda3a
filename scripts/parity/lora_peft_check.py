#!/usr/bin/env python3
"""Loads a nibble LoRA adapter with Hugging Face PEFT and writes the logits, for comparison with nibble
(GPU machine or CPU; not run in CI). Needs torch, transformers, peft, safetensors and numpy.

    python3 scripts/parity/lora_peft_check.py MODEL_DIR ADAPTER_DIR --tokens 1,2,3,4 --out OUT
        [--merged MERGED_DIR] [--dtype fp32|bf16] [--device cpu|cuda]

MODEL_DIR    an HF Llama folder nibble exported (the base model the adapter was trained on).
ADAPTER_DIR  a folder nibble wrote with write_peft_adapter (adapter_config.json + adapter_model.safetensors).
--tokens     comma-separated token ids, or @FILE with a JSON list of ids; one sequence.
--out        writes OUT.npy (logits [T, V], float32) and OUT.json (shape, argmax per position, loss of
             predicting each next token, max |logit|, the LoRA scaling PEFT applied).
--merged     also loads MERGED_DIR (nibble's export with the adapter merged, lora_merged_source) as a plain
             model and prints max |logits - PeftModel logits|: the two must agree within FP32 rounding.
Before any forward pass it checks that every lora_A/lora_B of the adapter file landed in the PeftModel
bit for bit (PEFT only warns about keys it could not place) and that the model has no LoRA
parameter the file lacks.
Default dtype fp32 with TF32 off, so differences come from summation order only.
"""
import argparse
import json

import numpy as np
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def parse_tokens(spec):
    if spec.startswith("@"):
        with open(spec[1:]) as f:
            return [int(t) for t in json.load(f)]
    return [int(t) for t in spec.split(",") if t.strip()]


def check_loaded(model, adapter_dir):
    """Every saved tensor sits in the model under PEFT's name with the adapter name put back."""
    saved = load_file(f"{adapter_dir}/adapter_model.safetensors")
    params = dict(model.named_parameters())
    for key, value in saved.items():
        name = key.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight")
        if name not in params:
            raise SystemExit(f"PEFT did not place {key} (no parameter {name}); the adapter's names are wrong")
        if not torch.equal(params[name].detach().cpu().to(value.dtype), value):
            raise SystemExit(f"{name} differs from {key} in the file after loading")
    placed = sum(1 for n in params if ".lora_" in n)
    if placed != len(saved):
        raise SystemExit(f"the model has {placed} LoRA parameters but the file {len(saved)}")
    print(f"loaded: {len(saved)} LoRA tensors placed bit for bit")


def logits_of(model, ids, device):
    with torch.no_grad():
        return model(torch.tensor([ids], device=device)).logits[0].float().cpu()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("adapter_dir")
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--merged")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dtype = torch.float32 if a.dtype == "fp32" else torch.bfloat16
    ids = parse_tokens(a.tokens)

    base = AutoModelForCausalLM.from_pretrained(a.model_dir, torch_dtype=dtype, attn_implementation="eager")
    model = PeftModel.from_pretrained(base, a.adapter_dir).to(a.device).eval()
    check_loaded(model, a.adapter_dir)
    scaling = next(m.scaling["default"] for m in model.modules() if hasattr(m, "scaling") and m.scaling)
    logits = logits_of(model, ids, a.device)

    logp = torch.log_softmax(logits.double(), dim=-1)
    nll = [-logp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    np.save(f"{a.out}.npy", logits.numpy())
    summary = {"shape": list(logits.shape), "argmax": logits.argmax(-1).tolist(), "next_token_nll": nll,
               "max_abs_logit": logits.abs().max().item(), "lora_scaling": scaling, "dtype": a.dtype}
    if a.merged:
        merged = AutoModelForCausalLM.from_pretrained(a.merged, torch_dtype=dtype, attn_implementation="eager")
        diff = (logits_of(merged.to(a.device).eval(), ids, a.device) - logits).abs().max().item()
        summary["max_abs_diff_vs_merged"] = diff
        print(f"merged vs PeftModel: max |dlogit| = {diff:.3e} (max |logit| {summary['max_abs_logit']:.3e})")
    with open(f"{a.out}.json", "w") as f:
        json.dump(summary, f, indent=2)
    print(f"wrote {a.out}.npy {list(logits.shape)} and {a.out}.json; LoRA scaling {scaling}")


if __name__ == "__main__":
    main()
