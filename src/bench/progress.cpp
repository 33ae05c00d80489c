#include "bench/progress.h"

#include <algorithm>

#include <unistd.h>

namespace m3::bench {

ProgressBar::ProgressBar(std::string label, int64_t total, bool enabled, std::FILE* out)
    : label_(std::move(label)),
      total_(total),
      enabled_(enabled),
      tty_(isatty(fileno(out)) != 0),
      out_(out),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_ - std::chrono::seconds(1)) {}

namespace {

std::string clock_text(double seconds) {
  const auto s = static_cast<long>(std::max(0.0, seconds));
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%02ld:%02ld", s / 60, s % 60);
  return buf;
}

}  // namespace

std::string ProgressBar::render(const std::string& label, int64_t done, int64_t failed,
                                int64_t total, double elapsed_s) {
  constexpr int kWidth = 30;
  const double frac = total > 0 ? std::clamp(static_cast<double>(done) / static_cast<double>(total), 0.0, 1.0) : 1.0;
  const int filled = static_cast<int>(frac * kWidth);
  std::string bar(static_cast<size_t>(filled), '#');
  bar.resize(kWidth, '.');
  const double rate = elapsed_s > 0 ? static_cast<double>(done) / elapsed_s : 0.0;
  const double eta = rate > 0 ? static_cast<double>(total - done) / rate : 0.0;
  char buf[256];
  std::snprintf(buf, sizeof(buf), "%s [%s] %lld/%lld (%lld failed) %.2f req/s %s<%s", label.c_str(),
                bar.c_str(), static_cast<long long>(done), static_cast<long long>(total),
                static_cast<long long>(failed), rate, clock_text(elapsed_s).c_str(),
                clock_text(eta).c_str());
  return buf;
}

void ProgressBar::add(bool success) {
  std::lock_guard<std::mutex> lock(mu_);
  ++done_;
  if (!success) ++failed_;
  draw_locked(done_ == total_);
}

void ProgressBar::finish() {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return;
  if (done_ != total_) draw_locked(true);  // add() already drew the completed bar
  if (enabled_ && tty_) std::fputc('\n', out_);
  finished_ = true;
}

void ProgressBar::draw_locked(bool force) {
  if (!enabled_ || finished_) return;
  const auto now = std::chrono::steady_clock::now();
  if (!force && now - last_draw_ < (tty_ ? std::chrono::milliseconds(100) : std::chrono::milliseconds(10000))) return;
  last_draw_ = now;
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const std::string line = render(label_, done_, failed_, total_, elapsed);
  if (tty_) {
    std::fprintf(out_, "\r%s", line.c_str());
  } else {
    std::fprintf(out_, "%s\n", line.c_str());
  }
  std::fflush(out_);
}

}  // namespace m3::bench
