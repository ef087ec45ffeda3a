// safetensors reader and writer (huggingface/safetensors format): u64 little-endian header length,
// a UTF-8 JSON header mapping names to {dtype, shape, data_offsets}, then the packed byte buffer.
// The reader validates everything before use (header size, offsets tiling the buffer exactly,
// sizes matching shapes) and names the file and field in every error.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>
#include "core/status.h"

namespace nb {

struct SafeTensor {
  std::string dtype;             // safetensors spelling: "BF16", "F32", "F8_E4M3", "U8", ...
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;    // row-major, little-endian
};

struct SafeTensorsFile {
  std::map<std::string, SafeTensor> tensors;
  std::map<std::string, std::string> metadata;
};

// Bytes per element of a safetensors dtype name; 0 if unknown.
int safetensors_dtype_size(const std::string& dtype);

Status read_safetensors(const std::string& path, SafeTensorsFile* out);
// Writes atomically (temporary file + rename): an existing file is never left half-written.
// Adds __metadata__ {"format": "pt"} unless metadata already sets "format".
Status write_safetensors(const std::string& path, const SafeTensorsFile& file);

}  // namespace nb
