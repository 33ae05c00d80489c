#pragma once
// A progress bar on stderr, thread-safe: on a terminal one line redrawn at most every 100 ms;
// otherwise (a log file) a plain line every 10 s and at the end.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>

namespace m3::bench {

class ProgressBar {
 public:
  ProgressBar(std::string label, int64_t total, bool enabled, std::FILE* out = stderr);
  void add(bool success);
  void finish();
  // The line for the given counts and elapsed time (no carriage return).
  static std::string render(const std::string& label, int64_t done, int64_t failed,
                            int64_t total, double elapsed_s);

 private:
  void draw_locked(bool force);
  std::string label_;
  int64_t total_;
  bool enabled_;
  bool tty_;
  std::FILE* out_;
  std::mutex mu_;
  int64_t done_ = 0;
  int64_t failed_ = 0;
  bool finished_ = false;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
};

}  // namespace m3::bench
