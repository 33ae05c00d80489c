#pragma once
// An HF model directory exactly as shipped: config.json, and either model.safetensors or
// model.safetensors.index.json + shards (all mmapped). Text tensors are looked up under the
// `language_model.` prefix first, then bare; vision and `mtp.` tensors are never touched.
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
  static Result<std::unique_ptr<ModelDir>> open(const std::string& dir);

  const std::string& path() const { return dir_; }
  const nlohmann::json& config_json() const { return config_; }

  // The tensor stored under `name`, or nullptr.
  const TensorInfo* find(std::string_view name) const;
  // The tensor, checked against the expected dtype and shape; the error names the file,
  // the tensor and what was expected ("missing", "dtype F32, expected BF16", "shape ...").
  Result<const TensorInfo*> get(std::string_view name, DType dtype, const Shape& shape) const;
  std::vector<std::string> tensor_names() const;
  size_t total_bytes() const;

 private:
  std::string dir_;
  nlohmann::json config_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorInfo*, std::less<>> index_;
};

}  // namespace m3
