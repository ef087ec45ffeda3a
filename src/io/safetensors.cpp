// safetensors I/O. Layout and validation rules follow huggingface/safetensors (tensor.rs).
#include "io/safetensors.h"
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace nb {

namespace {
constexpr uint64_t kMaxHeader = 100ull * 1000 * 1000;

struct DTypeInfo {
  const char* name;
  int size;
};
constexpr DTypeInfo kDTypes[] = {{"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"F8_E8M0", 1},
                                 {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},     {"U32", 4},
                                 {"F32", 4},  {"F64", 8}, {"I64", 8}, {"U64", 8}};
}  // namespace

int safetensors_dtype_size(const std::string& dtype) {
  for (const auto& d : kDTypes)
    if (dtype == d.name) return d.size;
  return 0;
}

namespace {
// One tensor's byte range in the data buffer, kept to check that the ranges tile it exactly.
struct Span {
  uint64_t begin, end;
  std::string name;
};

// What the header steps share: the file, the sizes that bound every offset, and the ranges seen so far.
struct HeaderScan {
  const std::string& path;
  uint64_t file_size = 0;
  uint64_t header_len = 0;   // the JSON header's length, from the file's first 8 bytes
  uint64_t buffer_size = 0;  // the tensor data after the header
  std::vector<Span> spans{};
};

// Reads the little-endian header length and the JSON text it covers, checking both fit the file.
Status read_header_text(HeaderScan* s, std::string* header) {
  const std::string& path = s->path;
  std::ifstream f(path, std::ios::binary);
  if (!f) return errorf("cannot open %s: %s", path.c_str(), std::strerror(errno));
  f.seekg(0, std::ios::end);
  const uint64_t file_size = uint64_t(f.tellg());
  f.seekg(0);
  if (file_size < 8)
    return errorf("%s is not a safetensors file: %llu bytes, too short for the 8-byte header length", path.c_str(),
                  (unsigned long long)file_size);
  uint8_t len_bytes[8];
  f.read(reinterpret_cast<char*>(len_bytes), 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];
  if (n > kMaxHeader || n > file_size - 8)
    return errorf("%s has a corrupt safetensors header: header length %llu exceeds the file (%llu bytes) or 100 MB",
                  path.c_str(), (unsigned long long)n, (unsigned long long)file_size);
  header->assign(n, '\0');
  f.read(header->data(), std::streamsize(n));
  s->file_size = file_size;
  s->header_len = n;
  s->buffer_size = file_size - 8 - n;
  return Status::ok();
}

// The header must be one JSON object: tensor name -> entry, plus an optional __metadata__.
Status parse_header_object(const std::string& path, const std::string& header, nlohmann::json* j) {
  try {
    *j = nlohmann::json::parse(header);
  } catch (const std::exception& e) {
    return errorf("%s has a corrupt safetensors header: invalid JSON (%s)", path.c_str(), e.what());
  }
  if (!j->is_object()) return errorf("%s has a corrupt safetensors header: the JSON is not an object", path.c_str());
  return Status::ok();
}

// __metadata__ maps names to strings; only string values are kept, others are skipped.
Status read_metadata(const std::string& path, const nlohmann::json& v, std::map<std::string, std::string>* metadata) {
  if (!v.is_object()) return errorf("%s: __metadata__ is not an object", path.c_str());
  for (auto m = v.begin(); m != v.end(); ++m)
    if (m.value().is_string()) (*metadata)[m.key()] = m.value().get<std::string>();
  return Status::ok();
}

// Dimensions must be non-negative integers whose product stays under 2^50, so byte counts cannot overflow.
Status read_shape(const std::string& path, const std::string& name, const nlohmann::json& shape,
                  std::vector<int64_t>* dims, uint64_t* numel) {
  *numel = 1;
  for (const auto& d : shape) {
    if (!d.is_number_unsigned())
      return errorf("%s: tensor '%s' has a negative or non-integer dimension", path.c_str(), name.c_str());
    uint64_t dim = d.get<uint64_t>();
    if (dim != 0 && *numel > (1ull << 50) / dim)
      return errorf("%s: tensor '%s' shape overflows", path.c_str(), name.c_str());
    *numel *= dim;
    dims->push_back(int64_t(dim));
  }
  return Status::ok();
}

// Checks one tensor's fields, dtype, shape and byte range, then records it; its range joins the tiling check.
Status add_tensor(HeaderScan* s, const std::string& name, const nlohmann::json& v, SafeTensorsHeader* out) {
  const std::string& path = s->path;
  if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets") ||
      !v["dtype"].is_string() || !v["shape"].is_array() || !v["data_offsets"].is_array() ||
      v["data_offsets"].size() != 2)
    return errorf("%s: tensor '%s' needs string dtype, array shape and two data_offsets", path.c_str(), name.c_str());
  SafeTensorEntry t;
  t.dtype = v["dtype"].get<std::string>();
  int esize = safetensors_dtype_size(t.dtype);
  if (esize == 0) return errorf("%s: tensor '%s' has unknown dtype '%s'", path.c_str(), name.c_str(), t.dtype.c_str());
  uint64_t numel = 0;
  NB_TRY(read_shape(path, name, v["shape"], &t.shape, &numel));
  const auto& off = v["data_offsets"];
  if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned())
    return errorf("%s: tensor '%s' has non-integer data_offsets", path.c_str(), name.c_str());
  uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
  if (e < b || e > s->buffer_size)
    return errorf("%s: tensor '%s' data_offsets [%llu, %llu) fall outside the %llu-byte buffer (truncated file?)",
                  path.c_str(), name.c_str(), (unsigned long long)b, (unsigned long long)e,
                  (unsigned long long)s->buffer_size);
  if (e - b != numel * uint64_t(esize))
    return errorf("%s: tensor '%s' spans %llu bytes but its shape and dtype need %llu", path.c_str(), name.c_str(),
                  (unsigned long long)(e - b), (unsigned long long)(numel * esize));
  s->spans.push_back({b, e, name});
  t.file_offset = 8 + s->header_len + b;  // absolute: the buffer starts after the length and the header
  t.nbytes = e - b;
  out->tensors[name] = std::move(t);
  return Status::ok();
}

// Sorted by start, the tensors' ranges must cover the buffer with no gap and no overlap.
Status check_spans_tile_buffer(HeaderScan* s) {
  std::sort(s->spans.begin(), s->spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  uint64_t pos = 0;
  for (const auto& sp : s->spans) {
    if (sp.begin != pos)
      return errorf("%s: tensor '%s' starts at byte %llu, expected %llu (offsets must tile the buffer)",
                    s->path.c_str(), sp.name.c_str(), (unsigned long long)sp.begin, (unsigned long long)pos);
    pos = sp.end;
  }
  if (pos != s->buffer_size)
    return errorf("%s: tensors cover %llu bytes but the buffer holds %llu", s->path.c_str(), (unsigned long long)pos,
                  (unsigned long long)s->buffer_size);
  return Status::ok();
}
}  // namespace

Status read_safetensors_header(const std::string& path, SafeTensorsHeader* out) {
  HeaderScan s{path};
  std::string header;
  NB_TRY(read_header_text(&s, &header));
  nlohmann::json j;
  NB_TRY(parse_header_object(path, header, &j));
  *out = SafeTensorsHeader{};
  out->file_size = s.file_size;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      NB_TRY(read_metadata(path, it.value(), &out->metadata));
      continue;
    }
    NB_TRY(add_tensor(&s, it.key(), it.value(), out));
  }
  return check_spans_tile_buffer(&s);
}

Status read_safetensors(const std::string& path, SafeTensorsFile* out) {
  SafeTensorsHeader h;
  NB_TRY(read_safetensors_header(path, &h));
  out->tensors.clear();
  out->metadata = h.metadata;
  std::ifstream f(path, std::ios::binary);
  if (!f) return errorf("cannot open %s: %s", path.c_str(), std::strerror(errno));
  for (const auto& [name, e] : h.tensors) {
    SafeTensor& t = out->tensors[name];
    t.dtype = e.dtype;
    t.shape = e.shape;
    t.bytes.resize(e.nbytes);
    f.seekg(std::streamoff(e.file_offset));
    f.read(reinterpret_cast<char*>(t.bytes.data()), std::streamsize(t.bytes.size()));
    if (!f) return errorf("%s: short read of tensor '%s'", path.c_str(), name.c_str());
  }
  return Status::ok();
}

Status write_safetensors(const std::string& path, const SafeTensorsFile& file) {
  std::vector<std::string> names;
  for (const auto& [name, t] : file.tensors) {
    int esize = safetensors_dtype_size(t.dtype);
    if (esize == 0)
      return errorf("writing %s: tensor '%s' has unknown dtype '%s'", path.c_str(), name.c_str(), t.dtype.c_str());
    uint64_t numel = 1;
    for (int64_t d : t.shape) numel *= uint64_t(d);
    if (numel * esize != t.bytes.size())
      return errorf("writing %s: tensor '%s' holds %zu bytes, its shape needs %llu", path.c_str(), name.c_str(),
                    t.bytes.size(), (unsigned long long)(numel * esize));
    names.push_back(name);
  }
  // Descending dtype alignment, then name, as the reference writer orders them.
  std::sort(names.begin(), names.end(), [&](const std::string& a, const std::string& b) {
    int sa = safetensors_dtype_size(file.tensors.at(a).dtype), sb = safetensors_dtype_size(file.tensors.at(b).dtype);
    return sa != sb ? sa > sb : a < b;
  });
  nlohmann::ordered_json j;
  nlohmann::ordered_json meta = nlohmann::ordered_json::object();
  for (const auto& [k, v] : file.metadata) meta[k] = v;
  if (!meta.contains("format")) meta["format"] = "pt";
  j["__metadata__"] = meta;
  uint64_t pos = 0;
  for (const auto& name : names) {
    const auto& t = file.tensors.at(name);
    j[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {pos, pos + t.bytes.size()}}};
    pos += t.bytes.size();
  }
  std::string header = j.dump();
  header.append((8 - header.size() % 8) % 8, ' ');
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) return errorf("cannot write %s: %s", tmp.c_str(), std::strerror(errno));
    uint64_t n = header.size();
    uint8_t len_bytes[8];
    for (int i = 0; i < 8; ++i) len_bytes[i] = uint8_t(n >> (8 * i));
    f.write(reinterpret_cast<const char*>(len_bytes), 8);
    f.write(header.data(), std::streamsize(n));
    for (const auto& name : names) {
      const auto& b = file.tensors.at(name).bytes;
      f.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
    }
    if (!f) return errorf("writing %s failed (disk full?)", tmp.c_str());
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return errorf("cannot move %s to %s: %s", tmp.c_str(), path.c_str(), ec.message().c_str());
  return Status::ok();
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out.append(i ? ", " : "").append(std::to_string(shape[i]));
  return out + "]";
}

}  // namespace nb
