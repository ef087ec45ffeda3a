// The work of the training step's phases, from the shapes: FLOPs and the bytes each kernel must move at
// the least (its inputs read once, its outputs written once), for the step profiler's roofline
// (core/gpu_profile.h NB_PROFILE_WORK, train/roofline.h). Activations are BF16 (2 bytes), norm and softmax
// statistics, losses, gradients and optimizer state FP32 (4 bytes). GEMMs count their own work
// (gemm/gemm_call.h). Elementwise FLOPs count one per arithmetic operation as written in the kernels'
// math (a sigmoid as 4), so that the phases can be placed on the roofline; they never bound a phase.
// docs/PERFORMANCE.md ("Roofline") states every formula.
#pragma once
#include <cstdint>

namespace nb::work {

struct Work {
  double flops = 0, bytes = 0;
  Work operator+(const Work& o) const { return {flops + o.flops, bytes + o.bytes}; }
};

// RMSNorm over T rows of width h: forward reads x and writes y (BF16) and 1/rms (FP32); backward reads x,
// dy and 1/rms and writes dx (the FP32 weight gradient is h wide per block: not counted).
Work rmsnorm_forward(int64_t t, int64_t h);
Work rmsnorm_backward(int64_t t, int64_t h);
// y += x over T x h (or a copy when `copy`: read one, write one).
Work add(int64_t t, int64_t h);
Work copy(int64_t t, int64_t h);
// RoPE on the fused q|k|v rows (forward split or backward merge): reads and writes T x (dq + 2 dkv).
Work rope(int64_t t, int64_t q_dim, int64_t kv_dim);
// SwiGLU over T x f outputs: forward reads gate|up and writes a; backward reads gate|up and da, writes dgate|dup.
Work swiglu_forward(int64_t t, int64_t f);
Work swiglu_backward(int64_t t, int64_t f);
// Cross-entropy forward and backward over a chunk of T rows of V logits (dlogits written in place).
Work cross_entropy(int64_t t, int64_t vocab);
// Causal flash attention, b sequences of s tokens: forward 2 b heads s^2 hd FLOPs (QK^T and PV, half
// the square); backward 2.5 times that (QK^T recomputed, dV, dP, dQ, dK).
Work attention_forward(int64_t b, int64_t s, int64_t heads, int64_t kv_heads, int64_t head_dim);
Work attention_backward(int64_t b, int64_t s, int64_t heads, int64_t kv_heads, int64_t head_dim);
// Context parallelism's ring over `ranks` ranks (ops/cp_ring.h), from the rank's own causal call of its S/C
// tokens (`own`): its C blocks together do 1/C of the whole row's causal work, C times the own call's
// FLOPs, and each block reads and writes about one call's bytes.
Work ring_attention(const Work& own, int ranks);
// Gradient norm and AdamW over p parameters: the norm reads the FP32 gradient (4 bytes); AdamW reads the
// gradient, master, m and v (16) and writes master, m, v (12) and the BF16 weight (2): 34 bytes per parameter.
Work grad_norm_adamw(int64_t p);

}  // namespace nb::work
