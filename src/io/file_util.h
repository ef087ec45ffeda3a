// Durable file operations for checkpoints: whole-file writes that are flushed to the disk before they
// count, atomic replacement (temporary name + fsync + rename + fsync of the folder), and a CRC-32
// (zlib's) of a file. Every error names the path and the system's reason (ENOSPC, EACCES, ...).
#pragma once
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include "core/status.h"

namespace nb {

// A file being written: every write() is checked, the CRC-32 of the bytes so far is kept, and
// finish() flushes and fsyncs before closing. The destructor of an unfinished file closes it.
class DurableFile {
 public:
  ~DurableFile();
  Status open(const std::string& path);
  Status write(const void* data, size_t bytes);
  Status finish();
  uint32_t crc32() const { return crc_; }
  uint64_t size() const { return size_; }

 private:
  std::FILE* f_ = nullptr;
  std::string path_;
  uint32_t crc_ = 0;
  uint64_t size_ = 0;
};

// Writes `text` to `path` through path + ".tmp", fsync and rename: readers see the old or the new file.
Status replace_file_atomically(const std::string& path, const std::string& text);
// fsync of a folder, so that renames inside it survive a power loss.
Status sync_folder(const std::string& dir);
// A folder that a writer may create: absent or empty, else one sentence naming it (`what`: "output", "adapter").
Status check_new_folder(const std::string& dir, const char* what);
// CRC-32 and size of a whole file, read front to back in blocks; `visit`, when given, sees each block
// and the file offset of its first byte (a checkpoint load copies tensors out as they pass).
using FileBlockVisitor = std::function<void(const char* data, size_t bytes, uint64_t offset)>;
Status file_crc32(const std::string& path, uint32_t* crc, uint64_t* size, const FileBlockVisitor& visit = {});
uint32_t crc32_of(const void* data, size_t bytes, uint32_t crc = 0);

}  // namespace nb
