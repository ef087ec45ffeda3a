// The few kernels inference needs beyond the model's ops: writing new keys and values into the KV cache,
// attention of one query token per sequence over its cache, the greedy argmax, the position counter, and
// the matrix-vector products of a decode step's linears at a few rows (CUDA).
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
// of the output to BF16. The CUDA attention runs one block per (sequence, query head) of 256 threads: for
// BF16 and head_dim 32, 64, 128 or 256, head_dim / 8 lanes share a position (one 16-byte load of its key
// and of its value each) and every lane group walks four positions at a time, so a block has up to 256
// positions' loads in flight; each group keeps a running max, sum and accumulator, merged at the end
// (flash-decoding's combine, without splitting across blocks). Other shapes: four warps, a lane per dim.
// Every kernel reads positions from the device (nothing a step changes is a launch argument), so a decode
// step can be captured once in a CUDA graph and replayed.
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
// Tensor parallelism's vocabulary-parallel embedding: out[t] = ids[t] - begin where begin <= ids[t] < end (this
// rank's rows), else -1 (another rank's row: a zero row, ops/embedding.h). ids and out [T] i32.
void vocab_shard_ids(const Tensor& ids, int64_t begin, int64_t end, const Tensor& out, Stream stream);

// y[M, N] = x[M, K] W[N, K]^T, plus y's own values when `accumulate` (the residual add, one rounding of
// acc + y): BF16 x and W, FP32 accumulation (per lane in k order, then a fixed-order warp butterfly), y
// BF16 or FP32, CUDA only. A decode step's linears at M <= kGemvMaxRows rows, where a GEMM reads W once
// and a GEMM library's tiles waste most of their rows (one warp per output column, 16-byte loads).
constexpr int64_t kGemvMaxRows = 8;
// Whether decode_gemv takes these operands: CUDA, contiguous, 1 <= M <= kGemvMaxRows, K a multiple of 8,
// x and W 16-byte aligned. The generator falls back to gemm::matmul otherwise (and on the CPU backend).
bool gemv_fits(const Tensor& x, const Tensor& w, const Tensor& y);
void decode_gemv(const Tensor& x, const Tensor& w, const Tensor& y, bool accumulate, Stream stream);

namespace detail {
void kv_cache_write_cuda(const Tensor& k, const Tensor& v, const Tensor& cache_k, const Tensor& cache_v,
                         const Tensor& pos, int64_t per_row, Stream stream);
Status cache_attention_cuda(const Tensor& q, const Tensor& cache_k, const Tensor& cache_v, const Tensor& pos,
                            const Tensor& out, float scale, Stream stream);
void argmax_rows_cuda(const Tensor& logits, const Tensor& ids, Stream stream);
void advance_positions_cuda(const Tensor& pos, Stream stream);
void vocab_shard_ids_cuda(const Tensor& ids, int64_t begin, int64_t end, const Tensor& out, Stream stream);
void decode_gemv_cuda(const Tensor& x, const Tensor& w, const Tensor& y, bool accumulate, Stream stream);
}  // namespace detail

}  // namespace nb::infer
