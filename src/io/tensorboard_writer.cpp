// TensorBoard event files (tensorboard_writer.h): TFRecord framing with Boost.CRC's CRC-32C, Events
// serialized by the protobuf-lite classes generated from tensorboard_event.proto.
#include "io/tensorboard_writer.h"
#include <unistd.h>
#include <boost/crc.hpp>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include "io/tensorboard_event.pb.h"

namespace nb {

namespace {

// The value TFRecord adds after rotating: its masking constant.
constexpr uint32_t kMaskDelta = 0xa282ead8u;

void put_le(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(char((v >> (8 * i)) & 0xff));
}

// The file name TensorBoard's reader looks for ("tfevents" in it); <host> is this machine's name.
std::string event_file_name(int64_t unix_time) {
  char host[256] = "localhost";
  if (gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "localhost");
  host[sizeof host - 1] = '\0';
  return strprintf("events.out.tfevents.%010lld.%s.%d.nibble", (long long)unix_time, host, int(getpid()));
}

}  // namespace

uint32_t crc32c(const void* data, size_t bytes) {
  boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true> crc;
  crc.process_bytes(data, bytes);
  return crc.checksum();
}

uint32_t masked_crc32c(const void* data, size_t bytes) {
  const uint32_t c = crc32c(data, bytes);
  return ((c >> 15) | (c << 17)) + kMaskDelta;
}

std::string tfrecord_frame(std::string_view data) {
  std::string out;
  out.reserve(data.size() + 16);
  put_le(&out, data.size(), 8);
  put_le(&out, masked_crc32c(out.data(), 8), 4);
  out.append(data);
  put_le(&out, masked_crc32c(data.data(), data.size()), 4);
  return out;
}

TensorBoardWriter::~TensorBoardWriter() { close(); }

void TensorBoardWriter::close() {
  if (f_) std::fclose(f_);
  f_ = nullptr;
}

Status TensorBoardWriter::open(const std::string& dir) {
  close();
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return errorf("cannot create the folder %s: %s", dir.c_str(), ec.message().c_str());
  // Never append to another writer's file: a name taken (same second, same process) moves to the next second.
  const int64_t now = int64_t(std::time(nullptr));
  for (int64_t t = now; t < now + 100 && !f_; ++t) {
    path_ = (std::filesystem::path(dir) / event_file_name(t)).string();
    f_ = std::fopen(path_.c_str(), "wbx");
    if (!f_ && errno != EEXIST)
      return errorf("cannot create the event file %s: %s", path_.c_str(), std::strerror(errno));
  }
  if (!f_) return errorf("cannot create an event file in %s: every name of the next 100 seconds is taken", dir.c_str());
  tensorboard::Event e;
  e.set_wall_time(double(now));
  e.set_file_version("brain.Event:2");
  NB_TRY(write_record(e.SerializeAsString()));
  return flush();
}

Status TensorBoardWriter::add_scalar(const std::string& tag, int64_t step, float value, double wall_time) {
  tensorboard::Event e;
  e.set_wall_time(wall_time);
  e.set_step(step);
  tensorboard::Summary::Value* v = e.mutable_summary()->add_value();
  v->set_tag(tag);
  v->set_simple_value(value);
  return write_record(e.SerializeAsString());
}

Status TensorBoardWriter::write_record(const std::string& data) {
  if (!f_) return errorf("the TensorBoard event file is not open");
  const std::string rec = tfrecord_frame(data);
  if (std::fwrite(rec.data(), 1, rec.size(), f_) != rec.size())
    return errorf("cannot write the event file %s: %s", path_.c_str(), std::strerror(errno));
  return Status::ok();
}

Status TensorBoardWriter::flush() {
  if (!f_) return errorf("the TensorBoard event file is not open");
  if (std::fflush(f_) != 0 || std::ferror(f_))
    return errorf("cannot write the event file %s: %s", path_.c_str(), std::strerror(errno));
  return Status::ok();
}

}  // namespace nb
