// safetensors reader / writer and ModelDir: round trips and every malformed-input error.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "loader/model_dir.h"
#include "loader/safetensors.h"

namespace m3 {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// A fresh directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            ("m3_loader_" + std::string(info->test_suite_name()) + "_" + info->name() + "_" +
             std::to_string(std::random_device{}()));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string str() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

// A safetensors file with the given header text and data; `header_len` overrides the prefix.
void write_raw(const std::string& path, const std::string& header, const std::vector<uint8_t>& data,
               int64_t header_len = -1) {
  uint64_t n = header_len >= 0 ? uint64_t(header_len) : header.size();
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[size_t(i)] = char(uint8_t(n >> (8 * i)));
  bytes += header;
  bytes.append(reinterpret_cast<const char*>(data.data()), data.size());
  write_text(path, bytes);
}

std::string open_error(const std::string& path) {
  auto r = SafetensorsFile::open(path);
  EXPECT_FALSE(r.is_ok()) << "expected " << path << " to be rejected";
  return r.is_ok() ? std::string() : r.error();
}

void expect_contains(const std::string& text, const std::string& needle) {
  EXPECT_NE(text.find(needle), std::string::npos) << "message: " << text << "\nmissing: " << needle;
}

std::vector<uint8_t> iota_bytes(size_t n, uint8_t start = 0) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = uint8_t(start + i * 7);
  return v;
}

struct Item {
  std::string name;
  DType dtype;
  Shape shape;
  std::vector<uint8_t> bytes;
};

std::vector<Item> sample_items() {
  std::vector<Item> items;
  auto add = [&](std::string name, DType dt, Shape shape) {
    size_t n = size_t(shape.numel()) * dtype_size_bytes(dt);
    items.push_back(Item{std::move(name), dt, shape, iota_bytes(n, uint8_t(items.size()))});
  };
  add("language_model.model.embed_tokens.weight", DType::kBF16, {16, 8});
  add("language_model.model.layers.0.mlp.gate.weight", DType::kF32, {4, 8});
  add("language_model.model.layers.0.q_proj.weight", DType::kF8E4M3, {8, 64});
  add("language_model.model.layers.0.q_proj.weight_scale_inv", DType::kU8, {8, 2});
  add("empty", DType::kF32, {0, 3});
  add("scalar", DType::kI64, {});
  add("big", DType::kBF16, {40, 10});
  return items;
}

void check_items(const ModelDir& dir, const std::vector<Item>& items) {
  EXPECT_EQ(dir.tensor_names().size(), items.size());
  size_t total = 0;
  for (const Item& it : items) {
    auto t = dir.get(it.name, it.dtype, it.shape);
    ASSERT_TRUE(t.is_ok()) << t.error();
    ASSERT_EQ((*t)->size_bytes, it.bytes.size()) << it.name;
    if (!it.bytes.empty()) {
      EXPECT_EQ(std::memcmp((*t)->data, it.bytes.data(), it.bytes.size()), 0) << it.name;
    }
    total += it.bytes.size();
  }
  EXPECT_EQ(dir.total_bytes(), total);
}

TEST(SafetensorsWriter, RoundTripSingleFile) {
  TempDir tmp;
  write_text(tmp.file("config.json"), "{}");
  auto items = sample_items();
  SafetensorsWriter w(tmp.str(), 1 << 20);
  for (const Item& it : items) w.add(it.name, it.dtype, it.shape, it.bytes.data());
  ASSERT_TRUE(w.finish().is_ok());
  ASSERT_EQ(w.written_files(), std::vector<std::string>{"model.safetensors"});
  EXPECT_FALSE(fs::exists(tmp.file("model.safetensors.index.json")));

  // Header length is a multiple of 8 so the data buffer is aligned.
  std::ifstream in(tmp.file("model.safetensors"), std::ios::binary);
  uint8_t len[8];
  in.read(reinterpret_cast<char*>(len), 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  EXPECT_EQ(n % 8, 0u);

  auto f = SafetensorsFile::open(tmp.file("model.safetensors"));
  ASSERT_TRUE(f.is_ok()) << f.error();
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  EXPECT_EQ((*f)->tensors().size(), items.size());
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*f)->find(items[0].name)->data) % 8, 0u);

  auto dir = ModelDir::open(tmp.str());
  ASSERT_TRUE(dir.is_ok()) << dir.error();
  EXPECT_EQ((*dir)->num_files(), 1u);
  check_items(**dir, items);
}

TEST(SafetensorsWriter, RoundTripSharded) {
  TempDir tmp;
  write_text(tmp.file("config.json"), "{\"a\": 1}");
  auto items = sample_items();
  // 700 bytes per shard: "big" (800 bytes) must get a shard of its own.
  SafetensorsWriter w(tmp.str(), 700);
  for (const Item& it : items) w.add(it.name, it.dtype, it.shape, it.bytes.data());
  ASSERT_TRUE(w.finish().is_ok());
  const auto& files = w.written_files();
  ASSERT_GE(files.size(), 3u);
  const size_t shards = files.size() - 1;
  EXPECT_EQ(files.back(), "model.safetensors.index.json");
  char first[64];
  std::snprintf(first, sizeof(first), "model-00001-of-%05zu.safetensors", shards);
  EXPECT_EQ(files[0], first);
  EXPECT_FALSE(fs::exists(tmp.file("model.safetensors")));

  std::ifstream in(tmp.file("model.safetensors.index.json"));
  json index = json::parse(in);
  size_t total = 0;
  for (const Item& it : items) total += it.bytes.size();
  EXPECT_EQ(index["metadata"]["total_size"].get<size_t>(), total);
  EXPECT_EQ(index["weight_map"].size(), items.size());
  for (size_t i = 0; i < shards; ++i) {
    auto f = SafetensorsFile::open(tmp.file(files[i]));
    ASSERT_TRUE(f.is_ok()) << f.error();
    size_t bytes = 0;
    for (const auto& [name, info] : (*f)->tensors()) {
      bytes += info.size_bytes;
      EXPECT_EQ(index["weight_map"][name], files[i]);
    }
    EXPECT_TRUE(bytes <= 700 || (*f)->tensors().size() == 1) << files[i];
  }
  {  // the oversized tensor sits alone in its shard
    auto f = SafetensorsFile::open(tmp.file(index["weight_map"]["big"].get<std::string>()));
    ASSERT_TRUE(f.is_ok()) << f.error();
    EXPECT_EQ((*f)->tensors().size(), 1u);
  }

  auto dir = ModelDir::open(tmp.str());
  ASSERT_TRUE(dir.is_ok()) << dir.error();
  EXPECT_EQ((*dir)->num_files(), shards);
  EXPECT_EQ((*dir)->config_json()["a"], 1);
  check_items(**dir, items);

  // Rewriting the directory as one file removes the old shards and index.
  SafetensorsWriter single(tmp.str(), 1 << 20);
  single.add(items[0].name, items[0].dtype, items[0].shape, items[0].bytes.data());
  ASSERT_TRUE(single.finish().is_ok());
  EXPECT_FALSE(fs::exists(tmp.file("model.safetensors.index.json")));
  EXPECT_FALSE(fs::exists(tmp.file(files[0])));
  auto dir2 = ModelDir::open(tmp.str());
  ASSERT_TRUE(dir2.is_ok()) << dir2.error();
  EXPECT_EQ((*dir2)->tensor_names().size(), 1u);
}

TEST(SafetensorsWriter, StreamedProducerInPieces) {
  TempDir tmp;
  SafetensorsWriter w(tmp.str(), 1 << 20);
  w.add_streamed("t", DType::kF32, {3, 5}, [](const ByteSink& sink) -> Status {
    for (int i = 0; i < 15; ++i) {
      float v = float(i) * 0.5f;
      M3_RETURN_IF_ERROR(sink(&v, 4));
    }
    return Status::ok();
  });
  ASSERT_TRUE(w.finish().is_ok());
  auto f = SafetensorsFile::open(tmp.file("model.safetensors"));
  ASSERT_TRUE(f.is_ok()) << f.error();
  const TensorInfo* t = (*f)->find("t");
  ASSERT_NE(t, nullptr);
  float v[15];
  std::memcpy(v, t->data, sizeof(v));
  EXPECT_EQ(v[14], 7.0f);
}

TEST(SafetensorsWriter, ProducerByteCountMismatchNamesTensor) {
  TempDir tmp;
  SafetensorsWriter w(tmp.str(), 1 << 20);
  w.add_streamed("short_one", DType::kBF16, {4}, [](const ByteSink& sink) {
    uint16_t v[3] = {1, 2, 3};
    return sink(v, sizeof(v));
  });
  Status s = w.finish();
  ASSERT_FALSE(s.is_ok());
  expect_contains(s.message(), "short_one");
  expect_contains(s.message(), "expected 8");
  EXPECT_FALSE(fs::exists(tmp.file("model.safetensors")));  // no plausible partial file

  SafetensorsWriter dup(tmp.str(), 1 << 20);
  float x = 1.0f;
  dup.add("d", DType::kF32, {1}, &x);
  dup.add("d", DType::kF32, {1}, &x);
  Status s2 = dup.finish();
  ASSERT_FALSE(s2.is_ok());
  expect_contains(s2.message(), "'d' added twice");
}

// ----- malformed files -----

TEST(SafetensorsFile, TooShortFile) {
  TempDir tmp;
  const std::string p = tmp.file("short.safetensors");
  write_text(p, "abc");
  std::string e = open_error(p);
  expect_contains(e, p);
  expect_contains(e, "3 bytes, expected at least 8");
}

TEST(SafetensorsFile, MissingFile) {
  TempDir tmp;
  std::string e = open_error(tmp.file("nope.safetensors"));
  expect_contains(e, tmp.file("nope.safetensors"));
  expect_contains(e, "cannot open");
}

TEST(SafetensorsFile, HeaderLengthPastEnd) {
  TempDir tmp;
  const std::string p = tmp.file("x.safetensors");
  write_raw(p, "{}", {}, 1000);
  std::string e = open_error(p);
  expect_contains(e, p);
  expect_contains(e, "header length 1000 reaches past the end of the file (10 bytes");
}

TEST(SafetensorsFile, InvalidJson) {
  TempDir tmp;
  const std::string p = tmp.file("x.safetensors");
  write_raw(p, "{\"a\": {\"dtype\": ", {});
  std::string e = open_error(p);
  expect_contains(e, p);
  expect_contains(e, "header is not valid JSON");

  write_raw(p, "[1, 2]", {});
  e = open_error(p);
  expect_contains(e, "header JSON is not an object");
}

TEST(SafetensorsFile, UnknownDtype) {
  TempDir tmp;
  const std::string p = tmp.file("x.safetensors");
  write_raw(p, R"({"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}})", {0});
  std::string e = open_error(p);
  expect_contains(e, p);
  expect_contains(e, "tensor 'w'");
  expect_contains(e, "unknown dtype \"F4\"");
}

TEST(SafetensorsFile, MalformedEntries) {
  TempDir tmp;
  const std::string p = tmp.file("x.safetensors");
  write_raw(p, R"({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", iota_bytes(8));
  expect_contains(open_error(p), "tensor 'w': \"shape\" must be an array of non-negative integers");
  write_raw(p, R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0]}})", iota_bytes(8));
  expect_contains(open_error(p), "tensor 'w': \"data_offsets\" must be an array of two");
  write_raw(p, R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", iota_bytes(8));
  expect_contains(open_error(p), "tensor 'w': data_offsets [8, 0] end before they begin");
  write_raw(p, R"({"w": 3})", {});
  expect_contains(open_error(p), "tensor 'w': header entry is not a JSON object");
  write_raw(p, R"({"__metadata__": {"k": 1}})", {});
  expect_contains(open_error(p), "\"__metadata__\" entry 'k' is not a string");
}

TEST(SafetensorsFile, SizeNotMatchingShape) {
  TempDir tmp;
  const std::string p = tmp.file("x.safetensors");
  write_raw(p, R"({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 10]}})", iota_bytes(10));
  std::string e = open_error(p);
  expect_contains(e, p);
  expect_contains(e, "tensor 'w'");
  expect_contains(e, "span 10 bytes, expected 12 (shape [2, 3] x 2 bytes of BF16)");
}

TEST(SafetensorsFile, OffsetsOutOfRangeAndTruncatedData) {
  TempDir tmp;
  const std::string p = tmp.file("x.safetensors");
  write_raw(p, R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                   "w": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})",
            iota_bytes(20));  // 4 bytes short: a truncated download
  std::string e = open_error(p);
  expect_contains(e, p);
  expect_contains(e, "tensor 'w'");
  expect_contains(e, "data_offsets [8, 24] reach past the data buffer, which holds 20 bytes");
}

TEST(SafetensorsFile, OverlappingTensors) {
  TempDir tmp;
  const std::string p = tmp.file("x.safetensors");
  write_raw(p, R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                   "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
            iota_bytes(12));
  std::string e = open_error(p);
  expect_contains(e, p);
  expect_contains(e, "tensor 'b': data_offsets [4, 12] overlap tensor 'a' at [0, 8]");
}

TEST(SafetensorsFile, ValidHandWrittenFile) {
  TempDir tmp;
  const std::string p = tmp.file("x.safetensors");
  float vals[2] = {1.5f, -2.0f};
  std::vector<uint8_t> data(12, 0);
  std::memcpy(data.data() + 4, vals, 8);  // a leading 4-byte gap is tolerated
  write_raw(p, R"({"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
                   "z": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}})",
            data);
  auto f = SafetensorsFile::open(p);
  ASSERT_TRUE(f.is_ok()) << f.error();
  const TensorInfo* a = (*f)->find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->view().as<float>()[1], -2.0f);
  EXPECT_EQ(a->file, p);
  EXPECT_EQ((*f)->find("zz"), nullptr);
}

// Every truncation of a valid file is rejected, and random header corruption never crashes
// nor yields a tensor outside the file.
TEST(SafetensorsFile, TruncationsAndCorruptionAreRejectedSafely) {
  TempDir tmp;
  SafetensorsWriter w(tmp.str(), 1 << 20);
  auto items = sample_items();
  for (const Item& it : items) w.add(it.name, it.dtype, it.shape, it.bytes.data());
  ASSERT_TRUE(w.finish().is_ok());
  std::ifstream in(tmp.file("model.safetensors"), std::ios::binary);
  const std::string good((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string p = tmp.file("x.safetensors");
  for (size_t len = 0; len < good.size(); len += (len < 64 ? 1 : 37)) {
    write_text(p, good.substr(0, len));
    auto r = SafetensorsFile::open(p);
    ASSERT_FALSE(r.is_ok()) << "truncated to " << len;
    expect_contains(r.error(), p);
  }
  static const char kJsonChars[] = "0123456789[]{},:\"- ";
  std::mt19937 rng(1234);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | uint8_t(good[size_t(i)]);
  int accepted = 0;
  for (int iter = 0; iter < 150; ++iter) {
    std::string bad = good;
    const int flips = 1 + int(rng() % 3);
    for (int f = 0; f < flips; ++f) {
      const size_t pos = rng() % (8 + header_len);
      bad[pos] = char(iter % 2 ? uint8_t(rng()) : uint8_t(kJsonChars[rng() % (sizeof(kJsonChars) - 1)]));
    }
    write_text(p, bad);
    auto r = SafetensorsFile::open(p);
    if (!r.is_ok()) {
      expect_contains(r.error(), p);
      continue;
    }
    ++accepted;
    for (const auto& [name, t] : (*r)->tensors()) {
      EXPECT_EQ(t.size_bytes, size_t(t.shape.numel()) * dtype_size_bytes(t.dtype)) << name;
    }
  }
  EXPECT_LT(accepted, 150);
}

// ----- ModelDir -----

void write_single(const TempDir& tmp, const std::vector<Item>& items) {
  SafetensorsWriter w(tmp.str(), 1 << 20);
  for (const Item& it : items) w.add(it.name, it.dtype, it.shape, it.bytes.data());
  ASSERT_TRUE(w.finish().is_ok());
}

TEST(ModelDir, MissingOrInvalidConfig) {
  TempDir tmp;
  write_single(tmp, sample_items());
  auto r = ModelDir::open(tmp.str());
  ASSERT_FALSE(r.is_ok());
  expect_contains(r.error(), "config.json not found");
  expect_contains(r.error(), tmp.file("config.json"));

  write_text(tmp.file("config.json"), "{\"vocab\": ");
  r = ModelDir::open(tmp.str());
  ASSERT_FALSE(r.is_ok());
  expect_contains(r.error(), tmp.file("config.json") + ": invalid JSON");

  r = ModelDir::open(tmp.file("does_not_exist"));
  ASSERT_FALSE(r.is_ok());
  expect_contains(r.error(), "not a directory");
}

TEST(ModelDir, NoWeights) {
  TempDir tmp;
  write_text(tmp.file("config.json"), "{}");
  auto r = ModelDir::open(tmp.str());
  ASSERT_FALSE(r.is_ok());
  expect_contains(r.error(), tmp.str());
  expect_contains(r.error(), "neither model.safetensors.index.json nor model.safetensors");
}

TEST(ModelDir, MissingShardFile) {
  TempDir tmp;
  write_text(tmp.file("config.json"), "{}");
  auto items = sample_items();
  SafetensorsWriter w(tmp.str(), 700);
  for (const Item& it : items) w.add(it.name, it.dtype, it.shape, it.bytes.data());
  ASSERT_TRUE(w.finish().is_ok());
  const std::string victim = w.written_files()[1];
  fs::remove(tmp.file(victim));
  auto r = ModelDir::open(tmp.str());
  ASSERT_FALSE(r.is_ok());
  expect_contains(r.error(), "model.safetensors.index.json");
  expect_contains(r.error(), "shard file " + tmp.file(victim));
  expect_contains(r.error(), "does not exist");
  expect_contains(r.error(), "holding tensor '");
}

TEST(ModelDir, IndexPointsToWrongShard) {
  TempDir tmp;
  write_text(tmp.file("config.json"), "{}");
  auto items = sample_items();
  SafetensorsWriter w(tmp.str(), 700);
  for (const Item& it : items) w.add(it.name, it.dtype, it.shape, it.bytes.data());
  ASSERT_TRUE(w.finish().is_ok());
  std::ifstream in(tmp.file("model.safetensors.index.json"));
  json index = json::parse(in);
  in.close();
  const std::string other = w.written_files()[0] == index["weight_map"]["big"] ? w.written_files()[1]
                                                                               : w.written_files()[0];
  index["weight_map"]["big"] = other;
  write_text(tmp.file("model.safetensors.index.json"), index.dump());
  auto r = ModelDir::open(tmp.str());
  ASSERT_FALSE(r.is_ok());
  expect_contains(r.error(), "weight_map puts tensor 'big' in " + tmp.file(other));
}

TEST(ModelDir, BadShardPropagatesFileError) {
  TempDir tmp;
  write_text(tmp.file("config.json"), "{}");
  write_text(tmp.file("model.safetensors"), "1234");
  auto r = ModelDir::open(tmp.str());
  ASSERT_FALSE(r.is_ok());
  expect_contains(r.error(), tmp.file("model.safetensors"));
  expect_contains(r.error(), "expected at least 8");
}

TEST(ModelDir, FindFallsBackToBareTextName) {
  TempDir tmp;
  write_text(tmp.file("config.json"), "{}");
  float x[4] = {1, 2, 3, 4};
  SafetensorsWriter w(tmp.str(), 1 << 20);
  w.add("model.norm.weight", DType::kF32, {4}, x);
  w.add("language_model.lm_head.weight", DType::kF32, {2, 2}, x);
  ASSERT_TRUE(w.finish().is_ok());
  auto dir = ModelDir::open(tmp.str());
  ASSERT_TRUE(dir.is_ok()) << dir.error();
  const ModelDir& d = **dir;
  ASSERT_NE(d.find("language_model.model.norm.weight"), nullptr);
  EXPECT_EQ(d.find("language_model.model.norm.weight")->name, "model.norm.weight");
  EXPECT_NE(d.find("model.norm.weight"), nullptr);
  EXPECT_NE(d.find("language_model.lm_head.weight"), nullptr);
  EXPECT_EQ(d.find("lm_head.weight"), nullptr);  // the fallback only strips, never adds
  EXPECT_EQ(d.find("vision_tower.model.norm.weight"), nullptr);
}

TEST(ModelDir, GetErrorsNameTensorFileAndExpectation) {
  TempDir tmp;
  write_text(tmp.file("config.json"), "{}");
  auto items = sample_items();
  write_single(tmp, items);
  auto dir = ModelDir::open(tmp.str());
  ASSERT_TRUE(dir.is_ok()) << dir.error();
  const ModelDir& d = **dir;
  const std::string file = tmp.file("model.safetensors");

  auto missing = d.get("language_model.model.nothing.weight", DType::kBF16, {1});
  ASSERT_FALSE(missing.is_ok());
  expect_contains(missing.error(), "model dir " + tmp.str());
  expect_contains(missing.error(), "tensor 'language_model.model.nothing.weight' not found");
  expect_contains(missing.error(), "also tried 'model.nothing.weight'");

  auto dtype = d.get(items[1].name, DType::kBF16, items[1].shape);
  ASSERT_FALSE(dtype.is_ok());
  expect_contains(dtype.error(), file);
  expect_contains(dtype.error(), "tensor '" + items[1].name + "'");
  expect_contains(dtype.error(), "dtype F32, expected BF16");

  auto shape = d.get(items[0].name, DType::kBF16, {8, 16});
  ASSERT_FALSE(shape.is_ok());
  expect_contains(shape.error(), file);
  expect_contains(shape.error(), "tensor '" + items[0].name + "'");
  expect_contains(shape.error(), "shape [16, 8], expected [8, 16]");
}

}  // namespace
}  // namespace m3
