"""The PyTorch peer: the same Llama model and training step as nibble, as a user would write it.

torch.compile, F.scaled_dot_product_attention (flash/cuDNN backend), fused AdamW, same shapes,
same batch, same FLOP formula (docs: bench protocol). The presets are nibble's (src/model/llama_config.cpp):
the protocol's Llama-3.1-8B proxies and the real Llama 3.2 1B / 3B with tied embeddings (the LM head is the
embedding's weight, one parameter), so parameters and model FLOPs equal nibble's. Two numerics:
  --numerics autocast : FP32 parameters and AdamW state, BF16 compute under torch.autocast
                        (the same numerics as nibble's bf16_mixed: the comparison that counts)
  --numerics bf16     : BF16 parameters and optimizer state (faster, weaker numerics)
Prints one JSON line with step time, tokens/s, model TFLOP/s and peak memory.
"""
import argparse, json, math, time

import torch
import torch.nn as nn
import torch.nn.functional as F

# Optional keys (defaults as in nibble's LlamaConfig): rope_theta 500000, rope_factor 8 (Llama 3.1 scaling),
# tied False.
PRESETS = {
    "llama3-8b-proxy": dict(hidden=4096, ffn=14336, layers=4, heads=32, kv_heads=8, head_dim=128, vocab=128256),
    "llama3-8b-proxy-deep": dict(hidden=4096, ffn=14336, layers=8, heads=32, kv_heads=8, head_dim=128, vocab=128256),
    # Llama 3.2: tied embeddings, RoPE scaling factor 32.
    "llama3.2-1b": dict(hidden=2048, ffn=8192, layers=16, heads=32, kv_heads=8, head_dim=64, vocab=128256,
                        rope_factor=32.0, tied=True),
    "llama3.2-3b": dict(hidden=3072, ffn=8192, layers=28, heads=24, kv_heads=8, head_dim=128, vocab=128256,
                        rope_factor=32.0, tied=True),
    "tiny": dict(hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=256),
}


def rope_tables(seq, head_dim, theta=500000.0, factor=8.0, low=1.0, high=4.0, orig=8192, device="cuda"):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    wavelen = 2 * math.pi / inv
    smooth = (orig / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > orig / low, inv / factor, inv)
    mid = (wavelen <= orig / low) & (wavelen >= orig / high)
    scaled = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    ang = torch.outer(torch.arange(seq, dtype=torch.float64), scaled)
    return ang.cos().float().to(device), ang.sin().float().to(device)


def apply_rope(x, cos, sin):  # x [B,S,H,D], rotate-half pairs (i, i + D/2)
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    c, s = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, q, kv, f = c["hidden"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"], c["ffn"]
        self.c = c
        self.attn_norm = nn.RMSNorm(h, eps=1e-5)
        self.wq, self.wk, self.wv = nn.Linear(h, q, bias=False), nn.Linear(h, kv, bias=False), nn.Linear(h, kv, bias=False)
        self.wo = nn.Linear(q, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=1e-5)
        self.w_gate_up = nn.Linear(h, 2 * f, bias=False)
        self.w_down = nn.Linear(f, h, bias=False)

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        c = self.c
        n = self.attn_norm(x)
        q = apply_rope(self.wq(n).view(B, S, c["heads"], c["head_dim"]), cos, sin)
        k = apply_rope(self.wk(n).view(B, S, c["kv_heads"], c["head_dim"]), cos, sin)
        v = self.wv(n).view(B, S, c["kv_heads"], c["head_dim"])
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).reshape(B, S, -1))
        g, u = self.w_gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w_down(F.silu(g) * u)


class Llama(nn.Module):
    def __init__(self, c, seq):
        super().__init__()
        self.embed = nn.Embedding(c["vocab"], c["hidden"])
        self.blocks = nn.ModuleList([Block(c) for _ in range(c["layers"])])
        self.norm = nn.RMSNorm(c["hidden"], eps=1e-5)
        self.lm_head = nn.Linear(c["hidden"], c["vocab"], bias=False)
        if c.get("tied", False):
            self.lm_head.weight = self.embed.weight  # one [vocab, hidden] parameter, gradients from both uses
        cos, sin = rope_tables(seq, c["head_dim"], theta=c.get("rope_theta", 500000.0),
                               factor=c.get("rope_factor", 8.0))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for p in self.parameters():  # a tied weight is listed (and initialized) once
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x, self.cos, self.sin)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def matmul_params(c):
    # The LM head's GEMM counts whether or not its weight is tied to the embedding (the lookup is no GEMM).
    h, q, kv, f = c["hidden"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"], c["ffn"]
    return c["layers"] * (h * (q + 2 * kv) + q * h + 3 * h * f) + h * c["vocab"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=list(PRESETS), default="llama3-8b-proxy")
    ap.add_argument("--numerics", choices=["autocast", "bf16"], default="autocast")
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--seq-length", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true")
    a = ap.parse_args()
    c = PRESETS[a.model]
    torch.manual_seed(1234)
    dev = "cuda"
    model = Llama(c, a.seq_length).to(dev)
    if a.numerics == "bf16":
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    fwd = model if a.no_compile else torch.compile(model)
    gen = torch.Generator(device=dev).manual_seed(0)
    data = torch.randint(0, c["vocab"], (a.micro_batches, a.micro_batch_size, a.seq_length + 1), device=dev, generator=gen)

    def step():
        for mb in range(a.micro_batches):
            t = data[mb]
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.numerics == "autocast"):
                loss = fwd(t[:, :-1], t[:, 1:]) / a.micro_batches
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    step_s = times[len(times) // 2]
    tokens = a.micro_batches * a.micro_batch_size * a.seq_length
    flops_tok = 6 * matmul_params(c) + 6 * c["layers"] * c["heads"] * c["head_dim"] * a.seq_length
    print(json.dumps({
        "system": "pytorch-" + a.numerics + ("" if a.no_compile else "-compile"), "model": a.model,
        "params": sum(p.numel() for p in model.parameters()), "gflops_per_token": flops_tok / 1e9,
        "device": torch.cuda.get_device_name(), "step_ms": step_s * 1e3, "tokens_per_s": tokens / step_s,
        "tflops": flops_tok * tokens / step_s / 1e12, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30, "loss": float(loss) * a.micro_batches,
        "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
