// The parameters as Hugging Face Llama tensors: one logical tensor per HF name, each a contiguous slice
// of the ParamStore's flat element space. nibble fuses gate and up into one [2F, H] weight
// (mlp.gate_up_proj.weight, rows [0, F) gate, [F, 2F) up), so that parameter is two HF tensors; every
// other parameter is its own HF tensor under the same name. RoPE needs no permutation: nibble uses the
// rotate-half pairing (i, i + head_dim/2) that HF's q_proj/k_proj rows assume (ops/rope.h).
// Checkpoints and the HF import/export both go through this list, so a checkpoint's tensors are the
// logical model (loadable by a different world size or layout) and never nibble's flat buffers.
#pragma once
#include <cstdint>
#include <string>
#include <vector>
#include "model/params.h"

namespace nb {

struct HfTensor {
  std::string name;            // e.g. model.layers.0.mlp.gate_proj.weight
  std::vector<int64_t> shape;  // [out, in] or [n]
  int64_t flat_offset = 0;     // first element in the ParamStore's flat buffers
  int64_t numel = 0;
};

// In the ParamStore's order (decayed 2-D weights first, gate before up).
std::vector<HfTensor> hf_tensors(const ParamStore& params);
// ... of parameters laid out as a store lays them out (ParamStore::flat_layout; a tensor-parallel run's whole model).
std::vector<HfTensor> hf_tensors(const std::vector<ParamInfo>& params);

}  // namespace nb
