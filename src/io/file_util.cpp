// DurableFile, atomic replacement and CRC-32 on POSIX (fsync) and zlib (crc32).
#include "io/file_util.h"
#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

namespace nb {

namespace {
Status sys_error(const char* what, const std::string& path) {
  return errorf("cannot %s %s: %s", what, path.c_str(), std::strerror(errno));
}
}  // namespace

uint32_t crc32_of(const void* data, size_t bytes, uint32_t crc) {
  const auto* p = static_cast<const Bytef*>(data);
  while (bytes > 0) {  // zlib takes 32-bit lengths
    const uInt n = uInt(std::min<size_t>(bytes, 1u << 30));
    crc = uint32_t(::crc32(crc, p, n));
    p += n;
    bytes -= n;
  }
  return crc;
}

DurableFile::~DurableFile() {
  if (f_) std::fclose(f_);
}

Status DurableFile::open(const std::string& path) {
  path_ = path;
  f_ = std::fopen(path.c_str(), "wb");
  if (!f_) return sys_error("create", path);
  crc_ = 0;
  size_ = 0;
  return Status::ok();
}

Status DurableFile::write(const void* data, size_t bytes) {
  if (bytes == 0) return Status::ok();
  errno = 0;
  if (std::fwrite(data, 1, bytes, f_) != bytes) return sys_error("write", path_);
  crc_ = crc32_of(data, bytes, crc_);
  size_ += bytes;
  return Status::ok();
}

Status DurableFile::finish() {
  errno = 0;
  if (std::fflush(f_) != 0) return sys_error("write", path_);
  if (::fsync(fileno(f_)) != 0) return sys_error("flush to disk", path_);
  const int rc = std::fclose(f_);
  f_ = nullptr;
  if (rc != 0) return sys_error("close", path_);
  return Status::ok();
}

Status check_new_folder(const std::string& dir, const char* what) {
  std::error_code ec;
  if (std::filesystem::exists(dir, ec) &&
      !(std::filesystem::is_directory(dir, ec) && std::filesystem::is_empty(dir, ec)))
    return errorf("%s already exists and is not an empty folder; choose a new %s folder or remove it", dir.c_str(),
                  what);
  return Status::ok();
}

Status sync_folder(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return sys_error("open folder", dir);
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return sys_error("flush folder", dir);
  return Status::ok();
}

Status replace_file_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  DurableFile f;
  NB_TRY(f.open(tmp));
  NB_TRY(f.write(text.data(), text.size()));
  NB_TRY(f.finish());
  if (std::rename(tmp.c_str(), path.c_str()) != 0) return sys_error("rename into", path);
  const size_t slash = path.find_last_of('/');
  return sync_folder(slash == std::string::npos ? "." : path.substr(0, slash));
}

Status file_crc32(const std::string& path, uint32_t* crc, uint64_t* size, const FileBlockVisitor& visit) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return sys_error("open", path);
  std::vector<char> buf(size_t(16) << 20);
  uint32_t c = 0;
  uint64_t n = 0;
  size_t got = 0;
  while ((got = std::fread(buf.data(), 1, buf.size(), f)) > 0) {
    c = crc32_of(buf.data(), got, c);
    if (visit) visit(buf.data(), got, n);
    n += got;
  }
  const bool bad = std::ferror(f) != 0;
  std::fclose(f);
  if (bad) return sys_error("read", path);
  *crc = c;
  *size = n;
  return Status::ok();
}

}  // namespace nb
