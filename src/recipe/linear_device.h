// Small device-side helpers of Linear (linear_device.cu; the CPU-only build answers with an error).
// Per-role state lives in device memory so a step needs no host synchronization:
//   floats [scale_inv, row_amax, col_amax, scale, step_amax]   ints [flag, nonfinite_count]
// scale_inv comes first: it is cuBLASLt's FP8 scale pointer, kept 16-byte aligned.
// After each quantization fold_role_state adds the quantizer's non-finite flag into the count and
// folds the copy's amax into step_amax (NaN once a non-finite source was seen in the step), which
// delayed scaling reads once per step.
#pragma once
#include <cstddef>
#include <cstdint>
#include "core/status.h"
#include "core/stream.h"

namespace nb::recipe::detail {

enum : int { kScaleInv = 0, kRowAmax = 1, kColAmax = 2, kScale = 3, kStepAmax = 4, kStateFloats = 5 };
enum : int { kFlag = 0, kNonfiniteCount = 1, kStateInts = 2 };

// Host version of the fold (CPU backend and tests).
void fold_role_state_host(float* floats, int* ints);
Status fold_role_state_cuda(float* floats, int* ints, Stream stream);
Status memset_cuda(void* p, int value, size_t bytes, Stream stream);
// Synchronous host <-> device copies on `stream` (waits for the stream).
Status copy_to_host_cuda(void* dst, const void* src, size_t bytes, Stream stream);
Status copy_to_device_cuda(void* dst, const void* src, size_t bytes, Stream stream);
// Queued on `stream`, no synchronization.
Status copy_device_to_device_cuda(void* dst, const void* src, size_t bytes, Stream stream);
// src [rows, cols] of 1-byte elements -> dst [cols, rows] (a frozen per-tensor FP8 weight's column-wise
// copy from its row copy: same codes, same scale). rows and cols multiples of 4 (the Linear's are of 16),
// pointers 4-byte aligned. The host loop is transpose_bytes_host in linear_frozen.cpp.
Status transpose_bytes_cuda(const uint8_t* src, int64_t rows, int64_t cols, uint8_t* dst, Stream stream);

}  // namespace nb::recipe::detail
