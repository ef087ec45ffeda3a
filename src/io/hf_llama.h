// Hugging Face Llama checkpoints in and out: config.json (transformers 4.x and 5.x spellings),
// a streaming reader for a model folder (one model.safetensors, or an index plus shards, read one
// tensor at a time so a 16 GB model never sits in memory whole), loading into a ParamStore, and a
// folder writer (config.json, shards + index, tokenizer.json) that stages into a temporary folder and
// renames it, so a crash never leaves a half export under the final name.
// Tensor names and their place in nibble's flat buffers come from model/hf_layout.h; nibble's RoPE is
// HF's rotate-half, so q_proj/k_proj rows are copied as they are (no permutation). See docs/HF.md.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>
#include "core/status.h"
#include "io/safetensors.h"
#include "model/hf_layout.h"
#include "model/llama_config.h"
#include "model/params.h"

namespace nb {

// Parses DIR/config.json (model_type llama, silu, no biases; rope "default"/null or "llama3").
// Sets out->name = "hf:<folder name>" and out->max_seq = max_position_embeddings.
Status read_hf_config(const std::string& dir, LlamaConfig* out);
// The same from JSON text; `where` names the source in error sentences.
Status parse_hf_config(const std::string& json_text, const std::string& where, LlamaConfig* out);
// A config.json both transformers 4.x and 5.x read: rope_theta + rope_scaling (4.x) and rope_parameters
// (5.x), torch_dtype and dtype. dtype_name is "bfloat16" or "float32"; bos/eos < 0 are written as null.
std::string hf_config_json(const LlamaConfig& c, const std::string& dtype_name, int64_t bos, int64_t eos);

// bos_token_id / eos_token_id of DIR/config.json when they are single integers (else -1: a list of
// end tokens, or none), so an export from an HF folder keeps them.
void read_hf_token_ids(const std::string& dir, int64_t* bos, int64_t* eos);

// The HF tensors a Llama of config c has, names and shapes only (flat offsets 0): what export checks
// and streams without allocating a ParamStore (a 70B model's flat buffers would not fit in host memory).
// Lists the same names and shapes as hf_tensors(ParamStore) (tested in tests/io).
std::vector<HfTensor> hf_expected_tensors(const LlamaConfig& c);

// Reads an HF model folder (or one safetensors file) tensor by tensor; only headers stay in memory.
class HfCheckpointReader {
 public:
  // DIR/model.safetensors.index.json + shards, or DIR/model.safetensors. Every shard the index names
  // must exist and hold exactly the tensors the index maps to it.
  Status open(const std::string& dir);
  // One safetensors file (a nibble checkpoint's model.safetensors).
  Status open_file(const std::string& path);
  bool has(const std::string& name) const { return entries_.count(name) != 0; }
  const std::vector<int64_t>& shape(const std::string& name) const;
  const std::string& dtype(const std::string& name) const;
  const std::string& file_of(const std::string& name) const;
  std::vector<std::string> names() const;
  const std::string& where() const { return where_; }  // the index or file opened, for messages
  // Converts BF16, F16 or F32 to FP32 exactly into dst (numel elements).
  Status read_f32(const std::string& name, float* dst) const;

 private:
  struct Entry {
    std::string file;
    SafeTensorEntry e;
  };
  Status add_file(const std::string& path, const std::vector<std::string>* expected);
  std::map<std::string, Entry> entries_;
  std::string where_;  // the folder or file, for messages
};

// Checks that `r` holds every tensor of `expected` with its shape (and nothing else but what transformers
// ignores: rotary_emb.inv_freq, and lm_head.weight of a tied model), then reads them into host_flat at
// their flat offsets. host_flat must hold the ParamStore's total() elements, zeroed.
Status read_hf_weights(const HfCheckpointReader& r, const std::vector<HfTensor>& expected, bool tied, float* host_flat);
// The checks of read_hf_weights without reading data (export streams tensors afterwards).
Status check_hf_tensors(const HfCheckpointReader& r, const std::vector<HfTensor>& expected, bool tied);
// Loads an HF folder into params: its config must match model_cfg in every shape field.
Status load_hf_weights(const std::string& dir, const LlamaConfig& model_cfg, ParamStore& params);
// Loads from an opened reader (a nibble checkpoint's model file holds HF names too).
Status load_hf_weights(const HfCheckpointReader& r, const LlamaConfig& model_cfg, ParamStore& params);

struct HfExportOptions {
  std::string dtype = "bf16";                    // bf16 (round to nearest even) | fp32
  int64_t max_shard_bytes = 5000000000;          // transformers' default "5GB"
  std::string tokenizer_file;                    // copied as tokenizer.json when set
  int64_t bos_token_id = -1, eos_token_id = -1;  // written to config.json; < 0 = null
};
// Supplies tensor t's t.numel FP32 values.
using HfTensorSource = std::function<Status(const HfTensor& t, float* dst)>;
// Writes out_dir (which must not exist, or be empty): config.json, model.safetensors or
// model-0000k-of-0000n.safetensors + model.safetensors.index.json, tokenizer.json.
Status write_hf_folder(const std::string& out_dir, const LlamaConfig& c, const std::vector<HfTensor>& tensors,
                       const HfTensorSource& source, const HfExportOptions& opt = {});
// The same from a host flat array laid out as the tensors' flat offsets say (ParamStore::get_flat).
Status write_hf_folder(const std::string& out_dir, const LlamaConfig& c, const std::vector<HfTensor>& tensors,
                       const float* host_flat, const HfExportOptions& opt = {});
// Parses "5GB", "500MB", "2GiB", "123" (bytes) as transformers' max_shard_size does (GB = 10^9).
Status parse_shard_size(const std::string& s, int64_t* bytes);

}  // namespace nb
