#include "core/log.h"

#include <atomic>
#include <chrono>
#include <mutex>

namespace m3 {
namespace {
// The one process-wide setting: which lines reach stderr. Set at start-up by the CLI.
std::atomic<int> g_level{int(LogLevel::kInfo)};
std::mutex g_mutex;
const char* level_tag(LogLevel l) {
  switch (l) {
    case LogLevel::kDebug: return "DEBUG";
    case LogLevel::kInfo: return "INFO";
    case LogLevel::kWarn: return "WARN";
    case LogLevel::kError: return "ERROR";
  }
  return "?";
}
}  // namespace

void set_log_level(LogLevel level) { g_level = int(level); }
LogLevel log_level() { return LogLevel(g_level.load()); }

void log_line(LogLevel level, const std::string& message) {
  if (int(level) < g_level.load()) return;
  auto now = std::chrono::system_clock::now().time_since_epoch();
  double secs = std::chrono::duration<double>(now).count();
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fprintf(stderr, "[m3 %s %.3f] %s\n", level_tag(level), secs, message.c_str());
}

}  // namespace m3
