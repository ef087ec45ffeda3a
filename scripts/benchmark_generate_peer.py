#!/usr/bin/env python3
"""The transformers side of scripts/benchmark_generate.sh (torch + transformers, one GPU).

    benchmark_generate_peer.py make-model DIR          # a random llama3.2-1b (Llama-3.2-1B's config), BF16
    benchmark_generate_peer.py prompts FILE B LEN      # B prompts of LEN random token ids as {"ids": [...]} lines
    benchmark_generate_peer.py run DIR PROMPTS NEW     # transformers' generate, greedy, BF16, sdpa

`run` times prefill (a forward of the prompts) and whole generate calls with NEW new tokens (end tokens
ignored) with the dynamic and the static KV cache (no torch.compile: its compile time is not a generate
call's), after one warm-up each, and prints one `result` line per cache: prefill tokens/s and decode
tokens/s = B * (NEW - 1) / (generate time - prefill time).
"""
import json
import sys
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
              num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
              rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=128000,
              eos_token_id=128001,
              rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=8192))


def make_model(path):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16)
    model.save_pretrained(path)
    print(f"wrote {path}: {sum(p.numel() for p in model.parameters()) / 1e9:.3f}B parameters")


def prompts(path, batch, length):
    g = torch.Generator().manual_seed(batch)
    with open(path, "w") as f:
        for _ in range(batch):
            f.write(json.dumps({"ids": torch.randint(0, 128000, (length,), generator=g).tolist()}) + "\n")


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def run(path, prompts_file, new):
    ids = torch.tensor([json.loads(line)["ids"] for line in open(prompts_file)], device="cuda")
    # transformers 5.x names the argument dtype; 4.x torch_dtype (an unknown keyword would be ignored).
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa", **{key: torch.bfloat16}).cuda().eval()
    model.generation_config.eos_token_id = None
    b, n = ids.shape
    kw = dict(max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None,
              attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        prefill = min(timed(lambda: model(input_ids=ids)) for _ in range(3))
        for cache in ("dynamic", "static"):
            try:
                extra = {} if cache == "dynamic" else dict(cache_implementation="static")
                timed(lambda: model.generate(ids, **kw, **extra))  # warm-up
                total = timed(lambda: model.generate(ids, **kw, **extra))
            except Exception as e:  # an older transformers without the static cache
                print(f"skip {cache}: {e}")
                continue
            decode = b * (new - 1) / max(total - prefill, 1e-9)
            print(f"result cache={cache} batch={b} prompt={n} new={new} prefill_tok_s={b * n / prefill:.1f} "
                  f"decode_tok_s={decode:.1f} total_s={total:.3f}")


def main(argv):
    if len(argv) == 3 and argv[1] == "make-model":
        make_model(argv[2])
    elif len(argv) == 5 and argv[1] == "prompts":
        prompts(argv[2], int(argv[3]), int(argv[4]))
    elif len(argv) == 5 and argv[1] == "run":
        run(argv[2], argv[3], int(argv[4]))
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
