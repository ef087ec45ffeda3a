// The few kernels inference needs beyond the model's ops: writing new keys and values into the KV cache,
// attention of one query token per sequence over its cache, the greedy argmax and the position counter.
//
// Shapes (row-major, contiguous; B sequences, L cache positions, Hq query and Hkv key/value heads of hd):
//   cache_k, cache_v  [B, L, Hkv, hd]   compute dtype (BF16 on CUDA, FP32 on the CPU backend)
//   k, v (new)        [T, Hkv, hd]      token t belongs to row t / per_row, at position pos[t]
//   q, out            [B, Hq, hd]       one query per sequence; row b attends to positions 0..pos[b]
//   pos               [T] or [B] i32    on the tensors' device
//   logits [B, V] f32, ids [B] i32
// GQA: query head h reads key/value head h / (Hq / Hkv), as ops/attention.h.
// Precision: CPU FP64 accumulation in exactly the reference attention's operations (so a CPU decode step
// equals the training forward bit for bit); CUDA FP32 scores, online softmax and accumulator, one rounding
// of the output to BF16. The CUDA attention runs one block per (sequence, query head), four warps over
// interleaved positions, each keeping a running max, sum and accumulator that are merged at the end
// (flash-decoding's combine, without splitting across blocks).
#pragma once
#include <cstdint>
#include "core/status.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace nb::infer {

void kv_cache_write(const Tensor& k, const Tensor& v, const Tensor& cache_k, const Tensor& cache_v, const Tensor& pos,
                    int64_t per_row, Stream stream);
// Errors: head_dim above 256 on CUDA (the kernel keeps 8 accumulator values per lane).
Status cache_attention(const Tensor& q, const Tensor& cache_k, const Tensor& cache_v, const Tensor& pos,
                       const Tensor& out, float scale, Stream stream);
// ids[b] = the first index of the largest logit of row b (torch.argmax's choice among equal values).
void argmax_rows(const Tensor& logits, const Tensor& ids, Stream stream);
// pos[b] += 1 (the next decode step's position; on the device so that the step needs no upload).
void advance_positions(const Tensor& pos, Stream stream);

namespace detail {
void kv_cache_write_cuda(const Tensor& k, const Tensor& v, const Tensor& cache_k, const Tensor& cache_v,
                         const Tensor& pos, int64_t per_row, Stream stream);
Status cache_attention_cuda(const Tensor& q, const Tensor& cache_k, const Tensor& cache_v, const Tensor& pos,
                            const Tensor& out, float scale, Stream stream);
void argmax_rows_cuda(const Tensor& logits, const Tensor& ids, Stream stream);
void advance_positions_cuda(const Tensor& pos, Stream stream);
}  // namespace detail

}  // namespace nb::infer
