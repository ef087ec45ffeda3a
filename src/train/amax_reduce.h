// FP8 delayed scaling under data parallelism: every rank must record the same amax in its histories, so
// that activation and gradient scales stay equal on all ranks (weights are equal anyway). As
// TransformerEngine does, the step amaxes are all-reduced with MAX over the data-parallel ranks after the
// step's last backward and before begin_step() rolls the histories and derives the next scales.
#pragma once
#include "core/status.h"
#include "core/tensor.h"
#include "distributed/communicator.h"
#include "model/llama_model.h"

namespace nb {

// Replaces every step amax of `model`'s delayed-scaling Linears by its maximum over the ranks of `comm`
// (nothing for other recipes). One all-reduce of one contiguous buffer: the amaxes are gathered into
// `scratch` (allocated on first use, f32 on the model's device), reduced, and scattered back. Every rank
// must call it at the same points; it returns once the reduction has completed (bounded by the
// communicator's timeout). Calling it twice without new amaxes in between changes nothing (MAX is idempotent).
Status all_reduce_step_amaxes(const LlamaModel& model, dist::Communicator& comm, Buffer* scratch);

}  // namespace nb
