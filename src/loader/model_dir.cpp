#include "loader/model_dir.h"

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

namespace m3 {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

constexpr std::string_view kLanguagePrefix = "language_model.";

// Reads a whole JSON file, or says why it cannot.
Result<json> read_json_file(const fs::path& path, const std::string& what) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return Status::error(what + " not found: expected " + path.string());
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error("cannot open " + path.string());
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    return Status::error(path.string() + ": invalid JSON (" + e.what() + ")");
  }
  if (!j.is_object()) return Status::error(path.string() + ": expected a JSON object at top level");
  return j;
}

}  // namespace

Result<std::unique_ptr<ModelDir>> ModelDir::open(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return Status::error("model dir " + dir + ": not a directory");
  auto md = std::make_unique<ModelDir>();
  md->dir_ = dir;
  auto config = read_json_file(fs::path(dir) / "config.json", "model dir " + dir + ": config.json");
  if (!config) return config.status();
  md->config_ = std::move(config.value());

  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single_path = fs::path(dir) / "model.safetensors";
  if (fs::exists(index_path, ec)) {
    auto index = read_json_file(index_path, "model.safetensors.index.json");
    if (!index) return index.status();
    auto wm = index->find("weight_map");
    if (wm == index->end() || !wm->is_object())
      return Status::error(index_path.string() + ": missing \"weight_map\" object {tensor name: shard file}");
    // Shard file -> one tensor it should hold (for the error message), in sorted order.
    std::map<std::string, std::string> shards;
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      if (!it->is_string())
        return Status::error(index_path.string() + ": weight_map entry '" + it.key() + "' is not a file name string");
      const std::string file = it->get<std::string>();
      if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..")
        return Status::error(index_path.string() + ": weight_map maps tensor '" + it.key() + "' to invalid file name '" +
                             file + "'");
      shards.emplace(file, it.key());
    }
    std::map<std::string, const SafetensorsFile*> by_file;
    for (const auto& [file, example] : shards) {
      const fs::path shard_path = fs::path(dir) / file;
      if (!fs::is_regular_file(shard_path, ec)) {
        return Status::error(index_path.string() + ": shard file " + shard_path.string() + " (holding tensor '" +
                             example + "') does not exist");
      }
      auto f = SafetensorsFile::open(shard_path.string());
      if (!f) return f.status();
      by_file[file] = f->get();
      md->files_.push_back(std::move(f.value()));
    }
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      const SafetensorsFile* f = by_file.at(it->get<std::string>());
      const TensorInfo* t = f->find(it.key());
      if (!t) {
        return Status::error(index_path.string() + ": weight_map puts tensor '" + it.key() + "' in " + f->path() +
                             ", but that file has no such tensor");
      }
      md->index_.emplace(it.key(), t);
    }
    // Tensors a shard holds beyond the map are still reachable; the map wins on duplicates.
    for (const auto& f : md->files_) {
      for (const auto& [name, info] : f->tensors()) md->index_.emplace(name, &info);
    }
  } else if (fs::exists(single_path, ec)) {
    auto f = SafetensorsFile::open(single_path.string());
    if (!f) return f.status();
    for (const auto& [name, info] : (*f)->tensors()) md->index_.emplace(name, &info);
    md->files_.push_back(std::move(f.value()));
  } else {
    return Status::error("model dir " + dir + ": neither model.safetensors.index.json nor model.safetensors exists");
  }
  return md;
}

const TensorInfo* ModelDir::find(std::string_view name) const {
  if (auto it = index_.find(name); it != index_.end()) return it->second;
  if (name.substr(0, kLanguagePrefix.size()) == kLanguagePrefix) {
    if (auto it = index_.find(name.substr(kLanguagePrefix.size())); it != index_.end()) return it->second;
  }
  return nullptr;
}

Result<const TensorInfo*> ModelDir::get(std::string_view name, DType dtype, const Shape& shape) const {
  const TensorInfo* t = find(name);
  if (!t) {
    std::string msg = "model dir " + dir_ + ": tensor '" + std::string(name) + "' not found";
    if (name.substr(0, kLanguagePrefix.size()) == kLanguagePrefix)
      msg += " (also tried '" + std::string(name.substr(kLanguagePrefix.size())) + "')";
    return Status::error(msg);
  }
  if (t->dtype != dtype) {
    return Status::error("safetensors file " + t->file + ", tensor '" + t->name + "': dtype " +
                         std::string(dtype_name(t->dtype)) + ", expected " + std::string(dtype_name(dtype)));
  }
  if (!(t->shape == shape)) {
    return Status::error("safetensors file " + t->file + ", tensor '" + t->name + "': shape " + t->shape.str() +
                         ", expected " + shape.str());
  }
  return t;
}

std::vector<std::string> ModelDir::tensor_names() const {
  std::vector<std::string> names;
  names.reserve(index_.size());
  for (const auto& [name, info] : index_) names.push_back(name);
  return names;
}

size_t ModelDir::total_bytes() const {
  size_t total = 0;
  for (const auto& [name, info] : index_) total += info->size_bytes;
  return total;
}

}  // namespace m3
