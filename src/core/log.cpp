// Logging implementation: one line per call, written atomically with a timestamp like Megatron's.
#include "core/log.h"
#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <ctime>

namespace nb {

static std::atomic<int> g_level{int(LogLevel::info)};

void set_log_level(LogLevel level) { g_level = int(level); }

void log(LogLevel level, const char* fmt, ...) {
  if (int(level) < g_level) return;
  static const char* kNames[] = {"debug", "info", "warn", "error"};
  auto now = std::chrono::system_clock::now();
  std::time_t t = std::chrono::system_clock::to_time_t(now);
  std::tm tm{};
  localtime_r(&t, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y-%m-%d %H:%M:%S", &tm);
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "[%s] %s: %s\n", stamp, kNames[int(level)], msg);
}

}  // namespace nb
