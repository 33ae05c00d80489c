#pragma once
// Small helpers the benchmark programs share: comma lists, and a corpus file as token ids.
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "core/status.h"
#include "tokenizer/tokenizer.h"

namespace m3::bench {

inline std::vector<int> parse_list(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) v.push_back(std::stoi(x));
  return v;
}

inline std::optional<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The corpus at `path` encoded with the tokenizer in `tokenizer_dir` (no special tokens).
inline Result<std::vector<int32_t>> corpus_tokens(const std::string& path, const std::string& tokenizer_dir) {
  const std::optional<std::string> text = read_file(path);
  if (!text) return Status::error("corpus " + path + " not found (pass --corpus FILE)");
  auto tok = Tokenizer::from_dir(tokenizer_dir);
  if (!tok) return Status::error("tokenizer: " + tok.error());
  return (*tok)->encode(*text, /*allow_special=*/false);
}

}  // namespace m3::bench
