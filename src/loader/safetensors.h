#pragma once
// safetensors files read through mmap, and a sharded, streaming writer. Every error names
// the file, the tensor (where there is one) and what was expected.
//
// Format: 8-byte little-endian header length N, N bytes of JSON
// {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}, then the
// data buffer; offsets are relative to the start of the buffer.
#include <cstdint>
#include <functional>
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
  // Validates the header completely: JSON structure, dtypes, shapes, offsets inside the
  // data buffer, sizes = numel * dtype size, no two tensors overlapping.
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

// Receives a tensor's bytes in order, in pieces of any size.
using ByteSink = std::function<Status(const void* bytes, size_t size_bytes)>;
// Produces exactly one tensor's bytes into the sink (called once, during finish()).
using TensorProducer = std::function<Status(const ByteSink& sink)>;

// Writes tensors into shards of at most `max_shard_bytes` of tensor data (a single larger
// tensor gets a shard of its own), named like HF's model-00001-of-00003.safetensors, plus
// model.safetensors.index.json; or a single model.safetensors when everything fits in one
// shard. Headers are padded with spaces to 8-byte alignment. Tensors appear in the files in
// the order they were added, and producers run in that order, so a producer may hand data
// to a later one (e.g. a weight's quantisation scales).
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::string dir, size_t max_shard_bytes);
  // The bytes are copied now.
  void add(const std::string& name, DType dtype, const Shape& shape, const void* bytes);
  // The bytes are produced during finish(); memory stays bounded by what the producer holds.
  void add_streamed(const std::string& name, DType dtype, const Shape& shape, TensorProducer produce);
  // Removes checkpoint files a previous run left in the directory (model.safetensors,
  // model-*-of-*.safetensors, the index), then writes every shard and the index.
  Status finish();
  // The file names written by finish() (shards, then the index if any).
  const std::vector<std::string>& written_files() const { return written_; }

 private:
  struct Pending {
    std::string name;
    DType dtype;
    Shape shape;
    size_t size_bytes = 0;
    TensorProducer produce;
  };
  Status write_shard(const std::vector<const Pending*>& tensors, const std::string& file_name) const;
  std::string dir_;
  size_t max_shard_bytes_;
  std::vector<Pending> pending_;
  std::vector<std::string> written_;
  bool finished_ = false;
};

}  // namespace m3
