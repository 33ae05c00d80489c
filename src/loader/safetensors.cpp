#include "loader/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

namespace m3 {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// Headers beyond this are not plausible checkpoints (the reference reader caps at 100 MB).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

Status file_error(const std::string& path, const std::string& what) {
  return Status::error("safetensors file " + path + ": " + what);
}

Status tensor_error(const std::string& path, const std::string& name, const std::string& what) {
  return Status::error("safetensors file " + path + ", tensor '" + name + "': " + what);
}

// Reads a JSON array of non-negative integers that fit in int64.
bool read_uint_array(const json& j, std::vector<uint64_t>& out) {
  if (!j.is_array()) return false;
  out.clear();
  for (const auto& v : j) {
    if (!v.is_number_integer() && !v.is_number_unsigned()) return false;
    if (v.is_number_integer() && !v.is_number_unsigned() && v.get<int64_t>() < 0) return false;
    uint64_t u = v.get<uint64_t>();
    if (u > uint64_t(std::numeric_limits<int64_t>::max())) return false;
    out.push_back(u);
  }
  return true;
}

std::string offsets_str(uint64_t b, uint64_t e) {
  std::string s = "[";
  s += std::to_string(b);
  s += ", ";
  s += std::to_string(e);
  s += "]";
  return s;
}

// Validates one header entry and fills `info` (data pointer excluded).
Status parse_entry(const std::string& path, const std::string& name, const json& entry, uint64_t buffer_bytes,
                   TensorInfo& info, uint64_t& begin, uint64_t& end) {
  if (!entry.is_object()) return tensor_error(path, name, "header entry is not a JSON object");
  auto dt = entry.find("dtype");
  if (dt == entry.end() || !dt->is_string())
    return tensor_error(path, name, "missing or non-string \"dtype\"");
  auto dtype = dtype_from_name(dt->get<std::string>());
  if (!dtype) {
    return tensor_error(path, name,
                        "unknown dtype \"" + dt->get<std::string>() +
                            "\" (expected one of F32, BF16, F16, F8_E4M3, U8, I32, I64, BOOL)");
  }
  std::vector<uint64_t> dims, offsets;
  auto sh = entry.find("shape");
  if (sh == entry.end() || !read_uint_array(*sh, dims))
    return tensor_error(path, name, "\"shape\" must be an array of non-negative integers");
  auto off = entry.find("data_offsets");
  if (off == entry.end() || !read_uint_array(*off, offsets) || offsets.size() != 2)
    return tensor_error(path, name, "\"data_offsets\" must be an array of two non-negative integers");
  begin = offsets[0];
  end = offsets[1];
  if (end < begin) return tensor_error(path, name, "data_offsets " + offsets_str(begin, end) + " end before they begin");
  // numel * element size, guarding against overflow from absurd shapes.
  unsigned __int128 expected = dtype_size_bytes(*dtype);
  std::vector<int64_t> sdims;
  for (uint64_t d : dims) {
    expected *= d;
    if (expected > (unsigned __int128)std::numeric_limits<int64_t>::max())
      return tensor_error(path, name, "shape is too large");
    sdims.push_back(int64_t(d));
  }
  info.name = name;
  info.dtype = *dtype;
  info.shape = Shape(std::move(sdims));
  info.file = path;
  info.size_bytes = size_t(end - begin);
  if (uint64_t(expected) != end - begin) {
    return tensor_error(path, name,
                        "data_offsets " + offsets_str(begin, end) + " span " + std::to_string(end - begin) +
                            " bytes, expected " + std::to_string(uint64_t(expected)) + " (shape " +
                            info.shape.str() + " x " + std::to_string(dtype_size_bytes(*dtype)) + " bytes of " +
                            std::string(dtype_name(*dtype)) + ")");
  }
  if (end > buffer_bytes) {
    return tensor_error(path, name,
                        "data_offsets " + offsets_str(begin, end) + " reach past the data buffer, which holds " +
                            std::to_string(buffer_bytes) + " bytes (file truncated or offsets out of range)");
  }
  return Status::ok();
}

}  // namespace

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return file_error(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return file_error(path, std::string("cannot stat: ") + std::strerror(err));
  }
  const uint64_t file_bytes = uint64_t(st.st_size);
  if (file_bytes < 8) {
    ::close(fd);
    return file_error(path, "file is " + std::to_string(file_bytes) +
                                " bytes, expected at least 8 (the header length)");
  }
  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  int map_err = errno;
  ::close(fd);
  if (map == MAP_FAILED) return file_error(path, std::string("mmap failed: ") + std::strerror(map_err));

  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  f->map_ = map;
  f->map_size_ = file_bytes;
  const auto* base = static_cast<const uint8_t*>(map);

  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | base[i];
  if (header_bytes > file_bytes - 8) {
    return file_error(path, "header length " + std::to_string(header_bytes) + " reaches past the end of the file (" +
                                std::to_string(file_bytes) + " bytes, so at most " +
                                std::to_string(file_bytes - 8) + " are available)");
  }
  if (header_bytes > kMaxHeaderBytes) {
    return file_error(path, "header length " + std::to_string(header_bytes) + " exceeds the limit of " +
                                std::to_string(kMaxHeaderBytes) + " bytes");
  }
  const char* header_begin = reinterpret_cast<const char*>(base + 8);
  json header;
  try {
    header = json::parse(header_begin, header_begin + header_bytes);
  } catch (const std::exception& e) {
    return file_error(path, std::string("header is not valid JSON (") + e.what() + ")");
  }
  if (!header.is_object()) return file_error(path, "header JSON is not an object, expected {name: {dtype, shape, data_offsets}}");

  const uint64_t data_start = 8 + header_bytes;
  const uint64_t buffer_bytes = file_bytes - data_start;
  struct Span {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<Span> spans;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& key = it.key();
    if (key == "__metadata__") {
      if (!it->is_object()) return file_error(path, "\"__metadata__\" is not an object of strings");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string())
          return file_error(path, "\"__metadata__\" entry '" + m.key() + "' is not a string");
        f->metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    TensorInfo info;
    uint64_t begin = 0, end = 0;
    M3_RETURN_IF_ERROR(parse_entry(path, key, *it, buffer_bytes, info, begin, end));
    info.data = base + data_start + begin;
    auto [pos, inserted] = f->tensors_.emplace(key, std::move(info));
    spans.push_back(Span{begin, end, &pos->first});
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  // Empty tensors occupy no bytes and may share an offset with anything.
  uint64_t max_end = 0;
  const Span* max_span = nullptr;
  for (const Span& cur : spans) {
    if (cur.end == cur.begin) continue;
    if (max_span && cur.begin < max_end) {
      return tensor_error(path, *cur.name,
                          "data_offsets " + offsets_str(cur.begin, cur.end) + " overlap tensor '" + *max_span->name +
                              "' at " + offsets_str(max_span->begin, max_span->end) + ", expected disjoint ranges");
    }
    if (cur.end > max_end) {
      max_end = cur.end;
      max_span = &cur;
    }
  }
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, map_size_);
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

// ---------------------------------------------------------------------------------------
// Writer

SafetensorsWriter::SafetensorsWriter(std::string dir, size_t max_shard_bytes)
    : dir_(std::move(dir)), max_shard_bytes_(max_shard_bytes == 0 ? 1 : max_shard_bytes) {}

void SafetensorsWriter::add(const std::string& name, DType dtype, const Shape& shape, const void* bytes) {
  const size_t size = size_t(shape.numel()) * dtype_size_bytes(dtype);
  auto copy = std::make_shared<std::vector<uint8_t>>(static_cast<const uint8_t*>(bytes),
                                                     static_cast<const uint8_t*>(bytes) + size);
  add_streamed(name, dtype, shape, [copy](const ByteSink& sink) { return sink(copy->data(), copy->size()); });
}

void SafetensorsWriter::add_streamed(const std::string& name, DType dtype, const Shape& shape,
                                     TensorProducer produce) {
  Pending p;
  p.name = name;
  p.dtype = dtype;
  p.shape = shape;
  p.size_bytes = size_t(shape.numel()) * dtype_size_bytes(dtype);
  p.produce = std::move(produce);
  pending_.push_back(std::move(p));
}

Status SafetensorsWriter::write_shard(const std::vector<const Pending*>& tensors, const std::string& file_name) const {
  const std::string path = (fs::path(dir_) / file_name).string();
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const Pending* t : tensors) {
    header[t->name] = {{"dtype", std::string(dtype_name(t->dtype))},
                       {"shape", t->shape.dims},
                       {"data_offsets", {offset, offset + t->size_bytes}}};
    offset += t->size_bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data buffer starts 8-byte aligned

  // Written under a temporary name and renamed, so a crash never leaves a plausible shard.
  const std::string tmp = path + ".tmp";
  std::FILE* out = std::fopen(tmp.c_str(), "wb");
  if (!out) return file_error(path, std::string("cannot create: ") + std::strerror(errno));
  std::vector<char> buf(8 << 20);
  std::setvbuf(out, buf.data(), _IOFBF, buf.size());
  bool io_ok = true;
  auto put = [&](const void* p, size_t n) {
    if (n && std::fwrite(p, 1, n, out) != n) io_ok = false;
    return io_ok;
  };
  uint8_t len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = uint8_t(uint64_t(text.size()) >> (8 * i));
  put(len_bytes, 8);
  put(text.data(), text.size());
  Status status;
  for (const Pending* t : tensors) {
    size_t written = 0;
    ByteSink sink = [&](const void* bytes, size_t n) -> Status {
      if (written + n > t->size_bytes) {
        return tensor_error(path, t->name, "producer wrote more than the expected " + std::to_string(t->size_bytes) +
                                               " bytes");
      }
      written += n;
      if (!put(bytes, n)) return tensor_error(path, t->name, std::string("write failed: ") + std::strerror(errno));
      return Status::ok();
    };
    status = t->produce(sink);
    if (status.is_ok() && written != t->size_bytes) {
      status = tensor_error(path, t->name, "producer wrote " + std::to_string(written) + " bytes, expected " +
                                               std::to_string(t->size_bytes));
    }
    if (!status.is_ok()) break;
  }
  if (std::fclose(out) != 0 && status.is_ok()) status = file_error(path, std::string("close failed: ") + std::strerror(errno));
  if (status.is_ok() && !io_ok) status = file_error(path, "write failed");
  if (!status.is_ok()) {
    std::remove(tmp.c_str());
    return status;
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) return file_error(path, "cannot rename from " + tmp + ": " + ec.message());
  return Status::ok();
}

Status SafetensorsWriter::finish() {
  if (finished_) return Status::error("safetensors writer for " + dir_ + ": finish() called twice");
  finished_ = true;
  std::set<std::string> names;
  for (const Pending& p : pending_) {
    if (p.name.empty() || p.name == "__metadata__")
      return Status::error("safetensors writer for " + dir_ + ": invalid tensor name '" + p.name + "'");
    if (!names.insert(p.name).second)
      return Status::error("safetensors writer for " + dir_ + ": tensor '" + p.name + "' added twice");
  }
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) return Status::error("cannot create directory " + dir_ + ": " + ec.message());
  // Stale files from an earlier checkpoint would shadow or contradict this one.
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    const std::string fname = entry.path().filename().string();
    const bool shard = fname.rfind("model-", 0) == 0 && fname.find("-of-") != std::string::npos &&
                       fname.size() > 12 && fname.substr(fname.size() - 12) == ".safetensors";
    if (shard || fname == "model.safetensors" || fname == "model.safetensors.index.json") fs::remove(entry.path(), ec);
  }

  // Greedy packing in order, as HF's save_pretrained does.
  std::vector<std::vector<const Pending*>> shards;
  size_t current = 0;
  for (const Pending& p : pending_) {
    if (shards.empty() || (current > 0 && current + p.size_bytes > max_shard_bytes_)) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(&p);
    current += p.size_bytes;
  }
  if (shards.empty()) shards.emplace_back();

  if (shards.size() == 1) {
    M3_RETURN_IF_ERROR(write_shard(shards[0], "model.safetensors"));
    written_.push_back("model.safetensors");
    return Status::ok();
  }
  json weight_map = json::object();
  uint64_t total = 0;
  const size_t count = shards.size();
  for (size_t i = 0; i < count; ++i) {
    char file_name[64];
    std::snprintf(file_name, sizeof(file_name), "model-%05zu-of-%05zu.safetensors", i + 1, count);
    M3_RETURN_IF_ERROR(write_shard(shards[i], file_name));
    written_.push_back(file_name);
    for (const Pending* p : shards[i]) {
      weight_map[p->name] = file_name;
      total += p->size_bytes;
    }
  }
  json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  const std::string index_path = (fs::path(dir_) / "model.safetensors.index.json").string();
  std::FILE* out = std::fopen(index_path.c_str(), "wb");
  if (!out) return Status::error("cannot create " + index_path + ": " + std::strerror(errno));
  const std::string text = index.dump(2) + "\n";
  const bool ok = std::fwrite(text.data(), 1, text.size(), out) == text.size();
  if (std::fclose(out) != 0 || !ok) return Status::error("write failed: " + index_path);
  written_.push_back("model.safetensors.index.json");
  return Status::ok();
}

}  // namespace m3
