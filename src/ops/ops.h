// The ops layer in one include: every non-GEMM op of a Llama training step, each with a CPU reference
// (the spec) and a CUDA implementation behind one signature that dispatches on the tensors' device.
#pragma once
#include "ops/adamw.h"
#include "ops/cross_entropy.h"
#include "ops/dropout.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/swiglu.h"
