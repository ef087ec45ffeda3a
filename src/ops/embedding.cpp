// CPU reference and device dispatch for the embedding (see embedding.h).
#include "ops/embedding.h"
#include "ops/ops_common.h"

namespace nb::ops {
using namespace detail;

void embedding_forward(const Tensor& table, const Tensor& ids, const Tensor& out, [[maybe_unused]] Stream stream) {
  const char* op = "embedding_forward";
  NB_CHECK(table.ndim == 2, "%s: table must be [V, H], got %s", op, table.shape_str().c_str());
  check_contiguous(op, "table", table);
  check_contiguous(op, "ids", ids);
  check_contiguous(op, "out", out);
  check_float(op, "table", table);
  check_dtype(op, "ids", ids, DType::i32);
  NB_CHECK(out.dtype == table.dtype, "%s: out must have the table's dtype", op);
  check_same_device(op, table, ids);
  check_same_device(op, table, out);
  const int64_t V = table.shape[0], H = table.shape[1], T = ids.numel();
  check_numel(op, "out", out, T * H);
  if (table.device == Device::cuda) NB_OPS_CUDA(op, embedding_forward_cuda(table, ids, out, stream));
  for (int64_t t = 0; t < T; ++t) {
    int32_t id = ids.ptr<int32_t>()[t];
    NB_CHECK(id >= -1 && id < V, "%s: token id %d at position %lld is outside the vocabulary of %lld", op, id,
             (long long)t, (long long)V);
    for (int64_t j = 0; j < H; ++j) out.ptr<float>()[t * H + j] = id < 0 ? 0.0f : table.ptr<float>()[id * H + j];
  }
}

void embedding_backward(const Tensor& ids, const Tensor& dout, const Tensor& dtable_f32,
                        [[maybe_unused]] Stream stream) {
  const char* op = "embedding_backward";
  NB_CHECK(dtable_f32.ndim == 2, "%s: dtable must be [V, H], got %s", op, dtable_f32.shape_str().c_str());
  check_contiguous(op, "ids", ids);
  check_contiguous(op, "dout", dout);
  check_contiguous(op, "dtable_f32", dtable_f32);
  check_dtype(op, "ids", ids, DType::i32);
  check_float(op, "dout", dout);
  check_dtype(op, "dtable_f32", dtable_f32, DType::f32);
  check_same_device(op, ids, dout);
  check_same_device(op, ids, dtable_f32);
  const int64_t V = dtable_f32.shape[0], H = dtable_f32.shape[1], T = ids.numel();
  check_numel(op, "dout", dout, T * H);
  if (ids.device == Device::cuda) NB_OPS_CUDA(op, embedding_backward_cuda(ids, dout, dtable_f32, stream));
  for (int64_t t = 0; t < T; ++t) {
    int32_t id = ids.ptr<int32_t>()[t];
    NB_CHECK(id >= -1 && id < V, "%s: token id %d at position %lld is outside the vocabulary of %lld", op, id,
             (long long)t, (long long)V);
    if (id < 0) continue;
    for (int64_t j = 0; j < H; ++j) dtable_f32.ptr<float>()[id * H + j] += dout.ptr<float>()[t * H + j];
  }
}

}  // namespace nb::ops
