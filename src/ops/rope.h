// Rotary position embedding, Hugging Face rotate-half convention: element i of a head is paired with
// element i + hd/2, both rotated by the angle pos * inv_freq[i].
// Shapes: x / dx [B, S, nheads, hd] (rotated in place; hd even); cos, sin [S_table, hd/2] FP32 with
// S_table >= S (row s is position s). CPU: FP32 x. CUDA: BF16 or FP32 x, FP32 math, one rounding.
// The table comes from rope_table (host, FP64 math then FP32) and is copied to the device by the caller.
// positions (optional, every op): [B*S] i32 on x's device; token t = b*S + s is rotated by table row
// positions[t] instead of s -- packed sequences restart at 0 at each segment start. nullptr: row s, exactly
// as without the argument. The CPU checks 0 <= positions[t] < S_table; CUDA assumes it (no host copy).
#pragma once
#include <cstdint>
#include "core/stream.h"
#include "core/tensor.h"

namespace nb::ops {

// Llama 3 base frequencies theta^(-2i/hd), with the Llama 3.1 long-context rule when llama31_scaling:
// wavelength 2*pi/f below original_max_pos/high_freq_factor keeps f, above original_max_pos/low_freq_factor
// divides f by factor, and in between blends (1-s)*f/factor + s*f with
// s = (original_max_pos/wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor).
struct RopeConfig {
  double theta = 500000;
  bool llama31_scaling = true;
  double factor = 8, low_freq_factor = 1, high_freq_factor = 4;
  int64_t original_max_pos = 8192;
};

// inv_freq[i] for i in [0, head_dim/2), FP64.
void rope_inv_freq(const RopeConfig& cfg, int64_t head_dim, double* inv_freq_out);
// cos_out/sin_out: host arrays of seq_len * head_dim/2 floats, [s][i] = cos/sin(s * inv_freq[i]).
void rope_table(const RopeConfig& cfg, int64_t seq_len, int64_t head_dim, float* cos_out, float* sin_out);

// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin  (x1 = x[i], x2 = x[i + hd/2]).
void rope_forward(const Tensor& x, const Tensor& cos, const Tensor& sin, Stream stream,
                  const Tensor* positions = nullptr);
// The transpose (= inverse) rotation, applied to the gradient in place.
void rope_backward(const Tensor& dx, const Tensor& cos, const Tensor& sin, Stream stream,
                   const Tensor* positions = nullptr);

// The fused QKV projection's output qkv [B, S, Hq + 2*Hkv, hd] (per token: the Hq query heads, then the
// Hkv key heads, then the Hkv value heads) split into q [B, S, Hq, hd] and k [B, S, Hkv, hd], both rotated
// (exactly rope_forward's arithmetic), and v [B, S, Hkv, hd], copied: one pass instead of a split copy
// and two in-place rotations.
void rope_split_qkv(const Tensor& qkv, const Tensor& cos, const Tensor& sin, const Tensor& q, const Tensor& k,
                    const Tensor& v, Stream stream, const Tensor* positions = nullptr);
// Its backward: dqkv = [rope_backward(dq) | rope_backward(dk) | dv] per token.
void rope_merge_qkv_grad(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& cos, const Tensor& sin,
                         const Tensor& dqkv, Stream stream, const Tensor* positions = nullptr);

namespace detail {
// positions: device array of B*S table rows, or nullptr for row s.
void rope_apply_cuda(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse, const int32_t* positions,
                     Stream stream);
// merge == false: qkv -> q, k, v (forward rotation); merge == true: q, k, v -> qkv (inverse rotation).
void rope_qkv_cuda(const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cos,
                   const Tensor& sin, bool merge, const int32_t* positions, Stream stream);
}  // namespace detail

}  // namespace nb::ops
