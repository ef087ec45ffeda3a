// Megatron .bin/.idx reader (mmap, validated) and writer (byte-identical to Megatron's builder).
#include "data/indexed_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>

namespace nb {

namespace {
constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
constexpr int64_t kHeader = 34;

template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

Status map_file(const std::string& path, const uint8_t** data, size_t* size) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0)
    return errorf("cannot open %s: %s; check the data path prefix (without .bin/.idx)", path.c_str(),
                  std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    ::close(fd);
    return errorf("cannot stat %s: %s", path.c_str(), std::strerror(errno));
  }
  *size = static_cast<size_t>(st.st_size);
  *data = nullptr;
  if (*size > 0) {
    void* p = mmap(nullptr, *size, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      return errorf("cannot memory-map %s: %s", path.c_str(), std::strerror(errno));
    }
    *data = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
  return Status::ok();
}
}  // namespace

int64_t indexed_dtype_size(IndexedDtype d) {
  switch (d) {
    case IndexedDtype::u8:
    case IndexedDtype::i8: return 1;
    case IndexedDtype::i16:
    case IndexedDtype::u16: return 2;
    case IndexedDtype::i32:
    case IndexedDtype::f32: return 4;
    case IndexedDtype::i64:
    case IndexedDtype::f64: return 8;
  }
  return 0;
}

IndexedDtype token_dtype_for_vocab(int64_t vocab_size) {
  return vocab_size < 65500 ? IndexedDtype::u16 : IndexedDtype::i32;
}

IndexedDataset::~IndexedDataset() {
  if (idx_) munmap(const_cast<uint8_t*>(idx_), idx_size_);
  if (bin_) munmap(const_cast<uint8_t*>(bin_), bin_size_);
}

Status IndexedDataset::open(const std::string& prefix, std::unique_ptr<IndexedDataset>* out) {
  auto ds = std::unique_ptr<IndexedDataset>(new IndexedDataset());
  ds->prefix_ = prefix;
  const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
  NB_TRY(map_file(idx_path, &ds->idx_, &ds->idx_size_));
  NB_TRY(map_file(bin_path, &ds->bin_, &ds->bin_size_));
  const uint8_t* p = ds->idx_;
  const int64_t isz = static_cast<int64_t>(ds->idx_size_);
  const char* f = idx_path.c_str();
  if (isz < kHeader)
    return errorf("%s: header truncated: the file has %lld bytes, expected at least %lld; re-run preprocessing", f,
                  (long long)isz, (long long)kHeader);
  if (std::memcmp(p, kMagic, 9) != 0)
    return errorf(
        "%s: field magic: expected \"MMIDIDX\\0\\0\", found other bytes; this is not a Megatron indexed dataset index",
        f);
  uint64_t version = load<uint64_t>(p + 9);
  if (version != 1) return errorf("%s: field version: expected 1, found %llu", f, (unsigned long long)version);
  uint8_t code = p[17];
  ds->dtype_ = static_cast<IndexedDtype>(code);
  if (indexed_dtype_size(ds->dtype_) == 0)
    return errorf("%s: field dtype: code %u is not one of Megatron's codes 1..8", f, unsigned(code));
  if (ds->dtype_ == IndexedDtype::f32 || ds->dtype_ == IndexedDtype::f64)
    return errorf(
        "%s: field dtype: code %u is a float type; token files must hold integers (uint16 code 8 or int32 code 4)", f,
        unsigned(code));
  uint64_t n = load<uint64_t>(p + 18), d = load<uint64_t>(p + 26);
  // Sizes must match before any array is touched; 128-bit arithmetic so corrupt counts cannot overflow.
  const unsigned __int128 expected = (unsigned __int128)kHeader + (unsigned __int128)12 * n + (unsigned __int128)8 * d;
  // Multimodal files append one int8 mode per sequence; anything else is a mismatch.
  if ((unsigned __int128)isz != expected && (unsigned __int128)isz != expected + n) {
    std::string want =
        expected > (unsigned __int128)INT64_MAX ? std::string("more than 2^63") : std::to_string((uint64_t)expected);
    return errorf(
        "%s: file size: expected %s bytes for the %llu sequences and %llu document indices its header declares "
        "(fields sequence_count, document_count), found %lld; the file is truncated or corrupt",
        f, want.c_str(), (unsigned long long)n, (unsigned long long)d, (long long)isz);
  }
  ds->n_ = int64_t(n);
  ds->d_ = int64_t(d);
  const int64_t item = indexed_dtype_size(ds->dtype_);
  ds->lengths_.resize(n);
  if (n) std::memcpy(ds->lengths_.data(), p + kHeader, 4 * n);
  int64_t expect_ptr = 0;
  for (int64_t i = 0; i < ds->n_; ++i) {
    int32_t len = ds->lengths_[i];
    if (len < 0) return errorf("%s: field sequence_lengths[%lld]: expected >= 0, found %d", f, (long long)i, len);
    int64_t ptr = ds->sequence_pointer(i);
    if (ptr != expect_ptr)
      return errorf("%s: field sequence_pointers[%lld]: expected %lld (running sum of length x %lld bytes), found %lld",
                    f, (long long)i, (long long)expect_ptr, (long long)item, (long long)ptr);
    expect_ptr += int64_t(len) * item;
  }
  if (expect_ptr != static_cast<int64_t>(ds->bin_size_))
    return errorf(
        "%s: file size: expected %lld bytes (sum of sequence_lengths x %lld from %s), found %lld; the pair is "
        "mismatched or truncated",
        bin_path.c_str(), (long long)expect_ptr, (long long)item, f, (long long)ds->bin_size_);
  if (ds->d_ < 1) return errorf("%s: field document_indices: expected at least one entry (0), found none", f);
  if (ds->document_index(0) != 0)
    return errorf("%s: field document_indices[0]: expected 0, found %lld", f, (long long)ds->document_index(0));
  for (int64_t i = 1; i < ds->d_; ++i)
    if (ds->document_index(i) < ds->document_index(i - 1))
      return errorf("%s: field document_indices[%lld]: expected >= %lld (non-decreasing), found %lld", f, (long long)i,
                    (long long)ds->document_index(i - 1), (long long)ds->document_index(i));
  if (ds->document_index(ds->d_ - 1) != ds->n_)
    return errorf("%s: field document_indices[%lld]: expected the sequence count %lld, found %lld", f,
                  (long long)(ds->d_ - 1), (long long)ds->n_, (long long)ds->document_index(ds->d_ - 1));
  *out = std::move(ds);
  return Status::ok();
}

int32_t IndexedDataset::sequence_length(int64_t i) const { return lengths_[static_cast<size_t>(i)]; }
int64_t IndexedDataset::sequence_pointer(int64_t i) const { return load<int64_t>(idx_ + kHeader + 4 * n_ + 8 * i); }
int64_t IndexedDataset::document_index(int64_t i) const { return load<int64_t>(idx_ + kHeader + 12 * n_ + 8 * i); }

void IndexedDataset::read(int64_t i, int64_t offset, int64_t length, std::vector<int32_t>* out) const {
  const int64_t len = sequence_length(i);
  if (length < 0) length = len - offset;
  NB_CHECK(offset >= 0 && offset + length <= len, "read(%lld, %lld, %lld) outside sequence of %lld tokens",
           (long long)i, (long long)offset, (long long)length, (long long)len);
  const int64_t item = indexed_dtype_size(dtype_);
  const uint8_t* src = bin_ + sequence_pointer(i) + offset * item;
  size_t base = out->size();
  out->resize(base + static_cast<size_t>(length));
  int32_t* dst = out->data() + base;
  for (int64_t k = 0; k < length; ++k) {
    const uint8_t* e = src + k * item;
    switch (dtype_) {
      case IndexedDtype::u8: dst[k] = e[0]; break;
      // NOLINTNEXTLINE(bugprone-signed-char-misuse): int8 tokens are signed
      case IndexedDtype::i8: dst[k] = static_cast<int8_t>(e[0]); break;
      case IndexedDtype::i16: dst[k] = load<int16_t>(e); break;
      case IndexedDtype::u16: dst[k] = load<uint16_t>(e); break;
      case IndexedDtype::i32: dst[k] = load<int32_t>(e); break;
      case IndexedDtype::i64: dst[k] = static_cast<int32_t>(load<int64_t>(e)); break;
      default: dst[k] = 0; break;
    }
  }
}

namespace {
template <typename T>
void scan_range(const uint8_t* bin, size_t bytes, int64_t* lo, int64_t* hi) {
  T mn = std::numeric_limits<T>::max(), mx = std::numeric_limits<T>::lowest();
  const size_t n = bytes / sizeof(T);
  for (size_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, bin + i * sizeof(T), sizeof(T));
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
  }
  if (n == 0) {
    *lo = 0;
    *hi = -1;
    return;
  }
  *lo = int64_t(mn);  // NOLINT(bugprone-signed-char-misuse): T = int8_t holds signed tokens
  *hi = int64_t(mx);  // NOLINT(bugprone-signed-char-misuse)
}
}  // namespace

void IndexedDataset::token_id_range(int64_t* min_id, int64_t* max_id) const {
  switch (dtype_) {
    case IndexedDtype::u8: scan_range<uint8_t>(bin_, bin_size_, min_id, max_id); break;
    case IndexedDtype::i8: scan_range<int8_t>(bin_, bin_size_, min_id, max_id); break;
    case IndexedDtype::i16: scan_range<int16_t>(bin_, bin_size_, min_id, max_id); break;
    case IndexedDtype::u16: scan_range<uint16_t>(bin_, bin_size_, min_id, max_id); break;
    case IndexedDtype::i32: scan_range<int32_t>(bin_, bin_size_, min_id, max_id); break;
    case IndexedDtype::i64: scan_range<int64_t>(bin_, bin_size_, min_id, max_id); break;
    default:
      *min_id = 0;
      *max_id = -1;
      break;  // float dtypes are refused by open()
  }
}

// ---------------------------------------------------------------- writer
IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (bin_) std::fclose(bin_);
}

Status IndexedDatasetWriter::create(const std::string& prefix, IndexedDtype dtype,
                                    std::unique_ptr<IndexedDatasetWriter>* out) {
  if (indexed_dtype_size(dtype) == 0) return errorf("unknown indexed dataset dtype code %u", unsigned(dtype));
  auto w = std::unique_ptr<IndexedDatasetWriter>(new IndexedDatasetWriter());
  w->prefix_ = prefix;
  w->dtype_ = dtype;
  std::string path = prefix + ".bin";
  w->bin_ = std::fopen(path.c_str(), "wb");
  if (!w->bin_)
    return errorf("cannot create %s: %s; check that the output folder exists and is writable", path.c_str(),
                  std::strerror(errno));
  *out = std::move(w);
  return Status::ok();
}

Status IndexedDatasetWriter::add_document(const int32_t* tokens, int64_t count) {
  const int64_t item = indexed_dtype_size(dtype_);
  scratch_.resize(static_cast<size_t>(count * item));
  for (int64_t k = 0; k < count; ++k) {
    int64_t v = tokens[k];
    std::memcpy(scratch_.data() + k * item, &v, static_cast<size_t>(item));  // little-endian truncation
  }
  if (count && std::fwrite(scratch_.data(), 1, scratch_.size(), bin_) != scratch_.size())
    return errorf("writing %s.bin failed: %s (disk full?)", prefix_.c_str(), std::strerror(errno));
  bin_bytes_ += count * item;
  lengths_.push_back(static_cast<int32_t>(count));
  doc_indices_.push_back(static_cast<int64_t>(lengths_.size()));
  return Status::ok();
}

Status IndexedDatasetWriter::finalize() {
  if (bin_ && std::fclose(bin_) != 0) {
    bin_ = nullptr;
    return errorf("closing %s.bin failed: %s", prefix_.c_str(), std::strerror(errno));
  }
  bin_ = nullptr;
  const uint64_t n = lengths_.size(), d = doc_indices_.size();
  std::vector<uint8_t> buf(static_cast<size_t>(kHeader + 12 * n + 8 * d));
  uint8_t* p = buf.data();
  std::memcpy(p, kMagic, 9);
  uint64_t version = 1;
  std::memcpy(p + 9, &version, 8);
  p[17] = static_cast<uint8_t>(dtype_);
  std::memcpy(p + 18, &n, 8);
  std::memcpy(p + 26, &d, 8);
  if (n) std::memcpy(p + kHeader, lengths_.data(), 4 * n);
  const int64_t item = indexed_dtype_size(dtype_);
  int64_t ptr = 0;
  for (uint64_t i = 0; i < n; ++i) {
    std::memcpy(p + kHeader + 4 * n + 8 * i, &ptr, 8);
    ptr += int64_t(lengths_[i]) * item;
  }
  std::memcpy(p + kHeader + 12 * n, doc_indices_.data(), 8 * d);
  std::string path = prefix_ + ".idx";
  FILE* fp = std::fopen(path.c_str(), "wb");
  if (!fp) return errorf("cannot create %s: %s", path.c_str(), std::strerror(errno));
  bool ok = std::fwrite(buf.data(), 1, buf.size(), fp) == buf.size();
  ok = (std::fclose(fp) == 0) && ok;
  if (!ok) return errorf("writing %s failed: %s (disk full?)", path.c_str(), std::strerror(errno));
  return Status::ok();
}

}  // namespace nb
