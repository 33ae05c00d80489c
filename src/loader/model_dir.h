#pragma once
// An HF model directory exactly as shipped: config.json, and either model.safetensors or
// model.safetensors.index.json + shards (all mmapped). Callers pass full checkpoint names
// (`language_model.model...`); a checkpoint saved text-only (names without that prefix) is
// found too. Vision and `mtp.` tensors are indexed but never read by the text model.
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "loader/safetensors.h"

namespace m3 {

class ModelDir {
 public:
  // Reads config.json (must exist and be a JSON object), then the sharded index or the single
  // file; every shard the index names must exist and hold the tensors mapped to it.
  static Result<std::unique_ptr<ModelDir>> open(const std::string& dir);

  const std::string& path() const { return dir_; }
  const nlohmann::json& config_json() const { return config_; }

  // The tensor stored under `name` or, when `name` starts with `language_model.` and is
  // absent, under the name without that prefix; nullptr when neither exists.
  const TensorInfo* find(std::string_view name) const;
  // The tensor, checked against the expected dtype and shape; the error names the file,
  // the tensor and what was expected ("not found", "dtype F32, expected BF16", "shape ...").
  Result<const TensorInfo*> get(std::string_view name, DType dtype, const Shape& shape) const;
  std::vector<std::string> tensor_names() const;
  size_t total_bytes() const;  // sum of all tensors' data bytes
  size_t num_files() const { return files_.size(); }

 private:
  std::string dir_;
  nlohmann::json config_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorInfo*, std::less<>> index_;
};

}  // namespace m3
