#include "bench/results.h"

#include <ctime>
#include <filesystem>
#include <fstream>

namespace m3::bench {

Status write_text_file(const std::string& path, const std::string& text) {
  namespace fs = std::filesystem;
  const fs::path p(path);
  std::error_code ec;
  if (p.has_parent_path()) fs::create_directories(p.parent_path(), ec);
  if (ec) return Status::error("cannot create directory " + p.parent_path().string() + ": " + ec.message());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return Status::error("cannot write " + path);
  out << text;
  out.close();
  if (!out) return Status::error("error writing " + path);
  return Status::ok();
}

Status write_json_file(const std::string& path, const nlohmann::json& value) {
  return write_text_file(path, value.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
}

std::string path_in_dir(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return (std::filesystem::path(dir) / name).string();
}

std::string utc_timestamp() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace m3::bench
