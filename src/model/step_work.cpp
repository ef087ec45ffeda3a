// The work of the step's phases from their shapes (formulas: step_work.h, docs/PERFORMANCE.md).
#include "model/step_work.h"

namespace nb::work {

namespace {
constexpr double kAct = 2.0, kF32 = 4.0;  // bytes of an activation (BF16) and of an FP32 value
}  // namespace

Work rmsnorm_forward(int64_t t, int64_t h) {
  const double th = double(t) * double(h);
  return {4.0 * th, kAct * (2.0 * th + double(h)) + kF32 * double(t)};
}

Work rmsnorm_backward(int64_t t, int64_t h) {
  const double th = double(t) * double(h);
  return {8.0 * th, kAct * (3.0 * th + double(h)) + kF32 * double(t)};
}

Work add(int64_t t, int64_t h) {
  const double th = double(t) * double(h);
  return {th, kAct * 3.0 * th};
}

Work copy(int64_t t, int64_t h) { return {0.0, kAct * 2.0 * double(t) * double(h)}; }

Work rope(int64_t t, int64_t q_dim, int64_t kv_dim) {
  const double width = double(q_dim + 2 * kv_dim), rotated = double(q_dim + kv_dim);
  return {3.0 * double(t) * rotated, kAct * 2.0 * double(t) * width};
}

Work swiglu_forward(int64_t t, int64_t f) {
  const double tf = double(t) * double(f);
  return {6.0 * tf, kAct * 3.0 * tf};
}

Work swiglu_backward(int64_t t, int64_t f) {
  const double tf = double(t) * double(f);
  return {10.0 * tf, kAct * 5.0 * tf};
}

Work cross_entropy(int64_t t, int64_t vocab) {
  const double tv = double(t) * double(vocab);
  return {5.0 * tv, kAct * 2.0 * tv + 2.0 * kF32 * double(t)};
}

Work attention_forward(int64_t b, int64_t s, int64_t heads, int64_t kv_heads, int64_t head_dim) {
  const double t = double(b) * double(s), dq = double(heads * head_dim), dkv = double(kv_heads * head_dim);
  const double flops = 2.0 * double(b) * double(heads) * double(s) * double(s) * double(head_dim);
  return {flops, kAct * t * (2.0 * dq + 2.0 * dkv) + kF32 * t * double(heads)};
}

Work attention_backward(int64_t b, int64_t s, int64_t heads, int64_t kv_heads, int64_t head_dim) {
  const double t = double(b) * double(s), dq = double(heads * head_dim), dkv = double(kv_heads * head_dim);
  const double flops = 5.0 * double(b) * double(heads) * double(s) * double(s) * double(head_dim);
  // reads q, k, v, o, do and the softmax statistics; writes dq, dk, dv
  return {flops, kAct * t * (3.0 * dq + 2.0 * dkv) + kF32 * t * double(heads) + kAct * t * (dq + 2.0 * dkv)};
}

Work ring_attention(const Work& own, int ranks) { return {own.flops * ranks, own.bytes * ranks}; }

Work grad_norm_adamw(int64_t p) { return {2.0 * double(p) + 16.0 * double(p), 34.0 * double(p)}; }

}  // namespace nb::work
