#pragma once
// Writing result files: JSON (pretty) and text, creating parent directories.
#include <string>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace m3::bench {

Status write_text_file(const std::string& path, const std::string& text);
Status write_json_file(const std::string& path, const nlohmann::json& value);
// dir/name, or name when dir is empty.
std::string path_in_dir(const std::string& dir, const std::string& name);
// Current UTC time as ISO 8601 ("2026-11-30T02:38:28Z").
std::string utc_timestamp();

}  // namespace m3::bench
