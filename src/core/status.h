// Status for recoverable failures (I/O, config, out of memory) and always-on NB_CHECK for
// programming errors. A Status carries one sentence for the user: what, where, what to do.
#pragma once
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

namespace nb {

class [[nodiscard]] Status {
 public:
  Status() = default;
  static Status ok() { return {}; }
  static Status error(std::string msg) {
    Status s;
    s.msg_ = std::move(msg);
    s.failed_ = true;
    return s;
  }
  bool is_ok() const { return !failed_; }
  explicit operator bool() const { return !failed_; }
  const std::string& message() const { return msg_; }
  // Adds context in front: "reading x.safetensors: <original>".
  Status& context(const std::string& where) {
    if (failed_) msg_ = where + ": " + msg_;
    return *this;
  }

 private:
  std::string msg_;
  bool failed_ = false;
};

// printf-style message formatting (GCC 12 ships no std::format).
std::string strprintf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline Status errorf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline Status errorf(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return Status::error(buf);
}

[[noreturn]] void check_failed(const char* expr, const char* file, int line, const std::string& msg);

}  // namespace nb

// Always on, also in release builds: a failed check is a bug in nibble, never bad user input.
#define NB_CHECK(cond, ...)                                                                      \
  do {                                                                                           \
    if (!(cond)) ::nb::check_failed(#cond, __FILE__, __LINE__, ::nb::strprintf("" __VA_ARGS__)); \
  } while (0)

// Propagates a failed Status to the caller.
#define NB_TRY(expr)                            \
  do {                                          \
    ::nb::Status nb_try_status_ = (expr);       \
    if (!nb_try_status_) return nb_try_status_; \
  } while (0)
