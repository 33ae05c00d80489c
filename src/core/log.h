#pragma once
// Minimal leveled logging to stderr; the level is set once by the CLI.
#include <cstdio>
#include <string>

namespace m3 {
enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };
void set_log_level(LogLevel level);
LogLevel log_level();
void log_line(LogLevel level, const std::string& message);
}  // namespace m3

#define M3_LOG_INFO(msg) ::m3::log_line(::m3::LogLevel::kInfo, (msg))
#define M3_LOG_WARN(msg) ::m3::log_line(::m3::LogLevel::kWarn, (msg))
#define M3_LOG_ERROR(msg) ::m3::log_line(::m3::LogLevel::kError, (msg))
#define M3_LOG_DEBUG(msg) ::m3::log_line(::m3::LogLevel::kDebug, (msg))
