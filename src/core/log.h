// Logging: timestamped lines to stderr at a global level; printf-style formatting.
#pragma once

namespace nb {

enum class LogLevel { debug = 0, info = 1, warn = 2, error = 3 };
void set_log_level(LogLevel level);
void log(LogLevel level, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

}  // namespace nb

#define NB_LOG_INFO(...) ::nb::log(::nb::LogLevel::info, __VA_ARGS__)
#define NB_LOG_WARN(...) ::nb::log(::nb::LogLevel::warn, __VA_ARGS__)
#define NB_LOG_ERROR(...) ::nb::log(::nb::LogLevel::error, __VA_ARGS__)
#define NB_LOG_DEBUG(...) ::nb::log(::nb::LogLevel::debug, __VA_ARGS__)
