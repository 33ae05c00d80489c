#pragma once
// safetensors files read through mmap, and a sharded writer. Every error names the file,
// the tensor (where there is one) and what was expected.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"

namespace m3 {

// One tensor inside a mapped file; `data` stays valid while the file object lives.
struct TensorInfo {
  std::string name;
  DType dtype;
  Shape shape;
  const uint8_t* data = nullptr;
  size_t size_bytes = 0;
  std::string file;  // path of the shard that holds it
  TensorView view() const { return TensorView{const_cast<uint8_t*>(data), dtype, shape, Device::kCpu}; }
};

class SafetensorsFile {
 public:
  // Validates the header completely (JSON, dtypes, offsets within the file, sizes = numel*dtype).
  static Result<std::unique_ptr<SafetensorsFile>> open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const TensorInfo* find(std::string_view name) const;
  const std::map<std::string, TensorInfo, std::less<>>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::map<std::string, TensorInfo, std::less<>> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Writes tensors into shards of at most `max_shard_bytes`, named like HF's
// model-00001-of-00003.safetensors, plus model.safetensors.index.json (or a single
// model.safetensors when everything fits in one shard).
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string dir, size_t max_shard_bytes);
  // The bytes are copied; order of addition is the order in the files.
  void add(const std::string& name, DType dtype, const Shape& shape, const void* bytes);
  Status finish();

 private:
  struct Pending {
    std::string name;
    DType dtype;
    Shape shape;
    std::vector<uint8_t> bytes;
  };
  Status write_shard(const std::vector<Pending>& tensors, const std::string& file_name) const;
  std::string dir_;
  size_t max_shard_bytes_;
  std::vector<std::vector<Pending>> shards_;
  size_t current_bytes_ = 0;
};

}  // namespace m3
