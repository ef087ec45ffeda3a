#!/usr/bin/env python3
"""`nibble generate` against transformers' generate and PEFT (GPU machine with torch, transformers, peft,
safetensors; not run in CI).

    python3 scripts/parity/generate_parity.py BUILD_DIR WORK_DIR [--skip-cuda]

Models: random LlamaForCausalLM with GQA (8 heads, 2 KV heads of 32) and Llama 3.1's RoPE scaling (theta 5e5,
factor 8, original 8192: the kept, smoothed and divided bands all occur), weights scaled for O(1) activations
and rounded to BF16 (scripts/hf_parity.py's build_model), tied and untied, saved in BF16. Prompts: 4 random
prompts of 5, 17, 33 and 60 tokens, each continued by 64 greedy tokens (end tokens ignored on both sides).
The reference runs each prompt alone in FP32 on the CPU (eager attention), so padding plays no part there.
It is transformers' model loaded back from the saved folder (and PeftModel.from_pretrained of the saved
adapter), so both sides read the same files. The in-memory model that was cast to BF16 to save it is not
used: nn.Module.to(bfloat16) also rounds the RoPE inv_freq buffer (a float buffer like any other), which
.float() cannot restore; the rounded frequencies move the logits by 1e-4 to 1e-2 of their scale, growing with
position and larger with the adapter, enough to flip greedy near-ties (an INFO line shows how far that copy's
inv_freq is from the fresh one).

Checks, each one line with PASS/FAIL (exit code 1 when any fails):
  * CPU: nibble generate --device cpu (FP32) equals model.generate(do_sample=False) token for token. A
    failure also prints both tokens and transformers' top-2 logit gap at the divergence (absolute, and
    relative to the step's largest |logit|: near FP32 rounding, ~1e-6, it is a near tie), but still fails.
  * CUDA: the prefill logits of every prompt position meet hf_parity.py's BF16 bound (relative RMS
    3 * 2^-8/sqrt(3) * sqrt(n), n = 10 L + 2; max abs 5x that of the reference's RMS), and the greedy tokens
    agree with the reference until at least the first step whose reference top-2 logits are closer than
    that max-abs bound (where a BF16 path may rightly pick the other token). Each prompt reports its first
    divergence and its first near tie.
  * A PEFT LoRA adapter on all seven projections (q/k/v and gate/up sharing A, as a fused nibble LoRA does):
    nibble generate --adapter (unmerged, as PEFT computes it) on the CPU equals PeftModel's greedy tokens,
    and on CUDA meets the bounds above. An INFO line (not a check) shows the CPU with --merge-adapter.
"""
import json
import math
import os
import shutil
import subprocess
import sys

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.numpy import load_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from hf_parity import UBF, build_model, check_config, load_pretrained  # noqa: E402

LENGTHS = (5, 17, 33, 60)
NEW_TOKENS = 64
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FUSED = [["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]]


class Checks:
    def __init__(self):
        self.failed = 0

    def report(self, name, ok, text):
        self.failed += 0 if ok else 1
        print(f"{'PASS' if ok else 'FAIL'} {name}: {text}", flush=True)


def greedy_config(model):
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def inv_freq_drift(saved, fresh):
    """Largest relative difference of the RoPE inv_freq buffers (None where the model has none)."""
    a, b = (getattr(getattr(m.model, "rotary_emb", None), "inv_freq", None) for m in (saved, fresh))
    return None if a is None or b is None else float(((a.float() - b.float()).abs() / b.float().abs()).max())


def make_model(path, tied):
    """Saves a random model in BF16; returns transformers' FP32 model loaded back from that folder."""
    cfg = dict(check_config(), tie_word_embeddings=tied, eos_token_id=None, bos_token_id=None, pad_token_id=0)
    model = greedy_config(build_model(cfg, seed=11 if tied else 12))
    model.to(torch.bfloat16).save_pretrained(path)
    fresh = greedy_config(load_pretrained(path, torch.float32))
    print(f"INFO RoPE inv_freq of the model cast to BF16 for saving vs loaded back: max relative difference "
          f"{inv_freq_drift(model.float(), fresh)} (the reference uses the one loaded back)", flush=True)
    return fresh


def make_adapter(model, path):
    """Random non-zero A and B (A shared across a fused group), scaled so the adapter visibly moves the logits.
    get_peft_model changes `model` in place: call it after the base model's reference."""
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=MODULES))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in peft_model.base_model.model.model.layers:
            for group in FUSED:
                mods = [m for n, m in layer.named_modules() if n.split(".")[-1] in group and hasattr(m, "lora_A")]
                a = torch.randn(mods[0].lora_A["default"].weight.shape, generator=g) / math.sqrt(mods[0].in_features)
                for m in mods:
                    m.lora_A["default"].weight.copy_(a)
                    m.lora_B["default"].weight.copy_(torch.randn(m.lora_B["default"].weight.shape, generator=g) * 0.2)
    peft_model.save_pretrained(path)


def load_adapter_reference(model_dir, adapter_dir):
    """PEFT's model as it reads the saved base and adapter, as nibble does (FP32 adapter, eager attention)."""
    return greedy_config(PeftModel.from_pretrained(load_pretrained(model_dir, torch.float32), adapter_dir))


def prompts(vocab):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def reference(model, ids):
    """Greedy tokens, the logits that chose them [NEW, V], and the prefill logits [len, V] (FP32, CPU)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                             do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                             eos_token_id=None)
        prefill = model(input_ids=x).logits[0].float()
    return out.sequences[0, len(ids):].tolist(), torch.stack([s[0] for s in out.scores]).float(), prefill


def nibble(build, model_dir, prompts_file, out_dir, device, adapter=None, merge=False):
    out = os.path.join(out_dir, f"{device}{'_lora' if adapter else ''}{'_merged' if merge else ''}")
    cmd = [os.path.join(build, "nibble"), "generate", "--load-hf", model_dir, "--prompts", prompts_file,
           "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--device", device, "--out", out + ".jsonl",
           "--logits-out", out + ".safetensors"] + (["--adapter", adapter] if adapter else [])
    cmd += ["--merge-adapter"] if merge else []
    r = subprocess.run(cmd, capture_output=True, text=True)
    print(r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "", flush=True)
    if r.returncode != 0:
        raise SystemExit(f"nibble generate failed:\n{r.stdout}\n{r.stderr}")
    rows = [json.loads(line) for line in open(out + ".jsonl")]
    return [row["ids"] for row in rows], load_file(out + ".safetensors")["prefill_logits"]


def first_divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def divergence_text(d, toks, mine, scores):
    """Where nibble leaves the reference, and how close transformers' own choice was there."""
    if d is None:
        return f"{NEW_TOKENS} of {NEW_TOKENS} tokens equal" if len(mine) == NEW_TOKENS else f"{len(mine)} tokens"
    row = scores[d]
    top2 = row.topk(2).values
    gap, scale = float(top2[0] - top2[1]), float(row.abs().max())
    behind = float(top2[0] - row[mine[d]])
    return (f"first divergence at new token {d} (transformers {toks[d]}, nibble {mine[d]}); transformers' top-2 "
            f"gap there {gap:.3g} ({gap / scale:.3g} of max |logit| {scale:.3g}), nibble's token {behind:.3g} "
            f"below the top")


def check_cpu(checks, name, refs, got, info=False):
    for i, ((toks, scores, _), mine) in enumerate(zip(refs, got)):
        d = first_divergence(toks, mine)
        ok = d is None and len(mine) == NEW_TOKENS
        label, text = f"{name} cpu greedy, prompt {i} ({LENGTHS[i]} tokens)", divergence_text(d, toks, mine, scores)
        if info:
            print(f"INFO {label}: {text}", flush=True)
        else:
            checks.report(label, ok, text)


def check_cuda(checks, name, refs, got, logits, layers):
    n = 10 * layers + 2
    rel_bound = 3 * UBF / math.sqrt(3) * math.sqrt(n)
    for i, ((toks, scores, prefill), mine) in enumerate(zip(refs, got)):
        mine_logits = torch.from_numpy(logits[i, :LENGTHS[i]].copy())
        diff = mine_logits - prefill
        rms = float(prefill.pow(2).mean().sqrt())
        rel, mx, bound = float(diff.norm() / prefill.norm()), float(diff.abs().max()), 5 * rel_bound * rms
        checks.report(f"{name} cuda prefill logits, prompt {i}", rel <= rel_bound and mx <= bound,
                      f"rel rms {rel:.3g} (bound {rel_bound:.3g}), max abs {mx:.3g} (bound {bound:.3g})")
        top2 = scores.topk(2, dim=-1).values
        gaps = (top2[:, 0] - top2[:, 1]).tolist()
        tie = next((k for k, g in enumerate(gaps) if g < bound), None)
        d = first_divergence(toks, mine)
        ok = d is None or (tie is not None and d >= tie)
        checks.report(f"{name} cuda greedy, prompt {i}", ok,
                      f"first divergence {'none in 64' if d is None else f'at new token {d}'}; first top-2 gap "
                      f"below {bound:.3g} {'none in 64' if tie is None else f'at new token {tie} ({gaps[tie]:.3g})'}")


def run_case(checks, build, work, tied, skip_cuda):
    name = "tied" if tied else "untied"
    d = os.path.join(work, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    model = make_model(os.path.join(d, "model"), tied)
    ps = prompts(model.config.vocab_size)
    pfile = os.path.join(d, "prompts.jsonl")
    with open(pfile, "w") as f:
        f.writelines(json.dumps({"ids": p}) + "\n" for p in ps)
    layers = model.config.num_hidden_layers
    refs = [reference(model, p) for p in ps]
    got, _ = nibble(build, os.path.join(d, "model"), pfile, d, "cpu")
    check_cpu(checks, name, refs, got)
    if not skip_cuda:
        got, logits = nibble(build, os.path.join(d, "model"), pfile, d, "cuda")
        check_cuda(checks, name, refs, got, logits, layers)
    make_adapter(model, os.path.join(d, "adapter"))
    peft_model = load_adapter_reference(os.path.join(d, "model"), os.path.join(d, "adapter"))
    refs = [reference(peft_model, p) for p in ps]
    got, _ = nibble(build, os.path.join(d, "model"), pfile, d, "cpu", os.path.join(d, "adapter"))
    check_cpu(checks, name + " + LoRA (PEFT)", refs, got)
    got, _ = nibble(build, os.path.join(d, "model"), pfile, d, "cpu", os.path.join(d, "adapter"), merge=True)
    check_cpu(checks, name + " + LoRA merged (--merge-adapter)", refs, got, info=True)
    if not skip_cuda:
        got, logits = nibble(build, os.path.join(d, "model"), pfile, d, "cuda", os.path.join(d, "adapter"))
        check_cuda(checks, name + " + LoRA (PEFT)", refs, got, logits, layers)


def main(argv):
    if len(argv) not in (3, 4) or argv[3:] not in ([], ["--skip-cuda"]):
        print(__doc__.split("\n\n")[1])
        return 2
    checks = Checks()
    for tied in (False, True):
        run_case(checks, argv[1], argv[2], tied, len(argv) == 4)
    print(f"{checks.failed} check(s) failed" if checks.failed else "all checks passed")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
