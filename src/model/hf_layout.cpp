// hf_tensors: the ParamStore's parameters under their Hugging Face names (gate_up split in two).
#include "model/hf_layout.h"

namespace nb {

std::vector<HfTensor> hf_tensors(const ParamStore& params) { return hf_tensors(params.params()); }

std::vector<HfTensor> hf_tensors(const std::vector<ParamInfo>& params) {
  static const std::string kFused = "mlp.gate_up_proj.weight";
  std::vector<HfTensor> out;
  for (const ParamInfo& p : params) {
    const size_t at = p.name.size() >= kFused.size() ? p.name.size() - kFused.size() : std::string::npos;
    if (at != std::string::npos && p.name.compare(at, kFused.size(), kFused) == 0) {
      const std::string prefix = p.name.substr(0, at);
      const int64_t half_rows = p.shape[0] / 2, cols = p.shape[1];
      out.push_back({prefix + "mlp.gate_proj.weight", {half_rows, cols}, p.offset, half_rows * cols});
      out.push_back({prefix + "mlp.up_proj.weight", {half_rows, cols}, p.offset + half_rows * cols, half_rows * cols});
    } else {
      out.push_back({p.name, p.shape, p.offset, p.numel});
    }
  }
  return out;
}

}  // namespace nb
