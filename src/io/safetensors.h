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
  std::string dtype;  // safetensors spelling: "BF16", "F32", "F8_E4M3", "U8", ...
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // row-major, little-endian
};

struct SafeTensorsFile {
  std::map<std::string, SafeTensor> tensors;
  std::map<std::string, std::string> metadata;
};

// Bytes per element of a safetensors dtype name; 0 if unknown.
int safetensors_dtype_size(const std::string& dtype);

// One tensor's header entry: where its bytes lie in the file, so large files can be read a tensor at
// a time (Hugging Face checkpoints of many GB) instead of whole.
struct SafeTensorEntry {
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t file_offset = 0;  // absolute byte offset of the first byte in the file
  uint64_t nbytes = 0;
};

struct SafeTensorsHeader {
  std::map<std::string, SafeTensorEntry> tensors;
  std::map<std::string, std::string> metadata;
  uint64_t file_size = 0;
};

// Parses and validates the header (every rule read_safetensors applies) without reading tensor data.
Status read_safetensors_header(const std::string& path, SafeTensorsHeader* out);
Status read_safetensors(const std::string& path, SafeTensorsFile* out);
// Writes atomically (temporary file + rename): an existing file is never left half-written.
// Adds __metadata__ {"format": "pt"} unless metadata already sets "format".
Status write_safetensors(const std::string& path, const SafeTensorsFile& file);
// "[a, b]": a tensor's shape in messages.
std::string shape_text(const std::vector<int64_t>& shape);

}  // namespace nb
