// Loading a Tokenizer from HF files, and the streaming decoder.
#include <filesystem>
#include <fstream>
#include <sstream>

#include "tokenizer/bpe_tokenizer.h"

namespace m3 {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

Result<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error("cannot open " + path);
  std::ostringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

Result<json> read_json(const std::string& path) {
  auto text = read_file(path);
  if (!text) return text.status();
  json parsed = json::parse(text.value(), nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) return Status::error(path + ": invalid JSON");
  return parsed;
}

Result<AddedToken> parse_added_token(const json& entry, int32_t id, const std::string& where) {
  if (!entry.is_object() || !entry.contains("content") || !entry["content"].is_string()) {
    return Status::error(where + ": expected an object with a string 'content'");
  }
  AddedToken token;
  token.id = id;
  token.content = entry["content"].get<std::string>();
  token.special = entry.value("special", false);
  token.single_word = entry.value("single_word", false);
  token.lstrip = entry.value("lstrip", false);
  token.rstrip = entry.value("rstrip", false);
  // HF's default is normalized = !special.
  token.normalized = entry.value("normalized", !token.special);
  return token;
}

Status parse_vocab(const json& vocab, const std::string& where, BpeSpec& spec) {
  if (!vocab.is_object()) return Status::error(where + ": expected an object of token -> id");
  spec.vocab.reserve(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!it.value().is_number_integer()) {
      return Status::error(where + ": id of '" + it.key() + "' is not an integer");
    }
    spec.vocab.emplace_back(it.key(), it.value().get<int32_t>());
  }
  return Status::ok();
}

Status add_merge_line(std::string_view line, size_t rank, BpeSpec& spec) {
  const size_t space = line.find(' ');
  if (space == std::string_view::npos || line.find(' ', space + 1) != std::string_view::npos) {
    return Status::error("merges: entry " + std::to_string(rank) + " ('" + std::string(line) +
                         "') is not two tokens separated by one space");
  }
  spec.merges.emplace_back(std::string(line.substr(0, space)), std::string(line.substr(space + 1)));
  return Status::ok();
}

}  // namespace

Result<std::unique_ptr<Tokenizer>> Tokenizer::from_tokenizer_json(const std::string& path) {
  auto parsed = read_json(path);
  if (!parsed) return parsed.status();
  const json& root = parsed.value();
  if (!root.is_object() || !root.contains("model")) {
    return Status::error(path + ": no 'model' section");
  }
  const json& model = root["model"];
  if (model.contains("type") && model["type"] != "BPE") {
    return Status::error(path + ": model.type '" + model["type"].dump() + "' is not BPE");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && model[key].is_string() && !model[key].get<std::string>().empty()) {
      return Status::error(path + ": model." + key + " is not supported for byte-level BPE");
    }
  }
  if (root.contains("normalizer") && !root["normalizer"].is_null()) {
    return Status::error(path + ": normalizer '" + root["normalizer"].value("type", "?") +
                         "' is not supported");
  }

  BpeSpec spec;
  M3_RETURN_IF_ERROR(parse_vocab(model.value("vocab", json()), "model.vocab", spec));
  const json merges = model.value("merges", json::array());
  if (!merges.is_array()) return Status::error(path + ": model.merges is not an array");
  spec.merges.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const json& merge = merges[rank];
    if (merge.is_string()) {
      M3_RETURN_IF_ERROR(add_merge_line(merge.get<std::string>(), rank, spec));
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() &&
               merge[1].is_string()) {
      spec.merges.emplace_back(merge[0].get<std::string>(), merge[1].get<std::string>());
    } else {
      return Status::error(path + ": model.merges[" + std::to_string(rank) + "] is malformed");
    }
  }
  if (model.contains("unk_token") && model["unk_token"].is_string()) {
    spec.unk_token = model["unk_token"].get<std::string>();
  }
  spec.ignore_merges = model.value("ignore_merges", false);

  const json added = root.value("added_tokens", json::array());
  for (size_t i = 0; i < added.size(); ++i) {
    const std::string where = "added_tokens[" + std::to_string(i) + "]";
    if (!added[i].contains("id") || !added[i]["id"].is_number_integer()) {
      return Status::error(path + ": " + where + ".id is missing");
    }
    auto token = parse_added_token(added[i], added[i]["id"].get<int32_t>(), where);
    if (!token) return token.status();
    spec.added_tokens.push_back(std::move(token.value()));
  }

  auto pre = PreTokenizer::from_json(root.value("pre_tokenizer", json()));
  if (!pre) return Status::error(path + ": " + pre.error());
  spec.pre_tokenizer = std::move(pre.value());
  auto tok = BpeTokenizer::build(std::move(spec));
  if (!tok) return Status::error(path + ": " + tok.error());
  return std::unique_ptr<Tokenizer>(std::move(tok.value()));
}

Result<std::unique_ptr<Tokenizer>> Tokenizer::from_vocab_merges(const std::string& model_dir) {
  const fs::path dir(model_dir);
  BpeSpec spec;
  auto vocab = read_json((dir / "vocab.json").string());
  if (!vocab) return vocab.status();
  M3_RETURN_IF_ERROR(parse_vocab(vocab.value(), "vocab.json", spec));

  auto merges = read_file((dir / "merges.txt").string());
  if (!merges) return merges.status();
  std::string_view text = merges.value();
  size_t rank = 0;
  while (!text.empty()) {
    const size_t eol = text.find('\n');
    std::string_view line = text.substr(0, eol);
    text = eol == std::string_view::npos ? std::string_view() : text.substr(eol + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || line.rfind("#version", 0) == 0) continue;
    M3_RETURN_IF_ERROR(add_merge_line(line, rank++, spec));
  }

  // Added tokens: tokenizer_config.json's added_tokens_decoder carries the flags;
  // added_tokens.json only maps content -> id.
  std::unordered_map<int32_t, size_t> added_index;
  const fs::path config_path = dir / "tokenizer_config.json";
  if (fs::exists(config_path)) {
    auto config = read_json(config_path.string());
    if (!config) return config.status();
    const json decoder = config.value().value("added_tokens_decoder", json::object());
    for (auto it = decoder.begin(); it != decoder.end(); ++it) {
      int32_t id = 0;
      try {
        id = std::stoi(it.key());
      } catch (...) {
        return Status::error("tokenizer_config.json: added_tokens_decoder key '" + it.key() +
                             "' is not an id");
      }
      auto token = parse_added_token(it.value(), id, "added_tokens_decoder." + it.key());
      if (!token) return token.status();
      added_index[id] = spec.added_tokens.size();
      spec.added_tokens.push_back(std::move(token.value()));
    }
  }
  const fs::path added_path = dir / "added_tokens.json";
  if (fs::exists(added_path)) {
    auto added = read_json(added_path.string());
    if (!added) return added.status();
    if (!added.value().is_object()) return Status::error("added_tokens.json: expected an object");
    for (auto it = added.value().begin(); it != added.value().end(); ++it) {
      if (!it.value().is_number_integer()) {
        return Status::error("added_tokens.json: id of '" + it.key() + "' is not an integer");
      }
      const auto id = it.value().get<int32_t>();
      if (added_index.count(id)) continue;
      AddedToken token;
      token.id = id;
      token.content = it.key();
      token.normalized = true;
      added_index[id] = spec.added_tokens.size();
      spec.added_tokens.push_back(std::move(token));
    }
  }

  auto pre = PreTokenizer::gpt2();
  if (!pre) return pre.status();
  spec.pre_tokenizer = std::move(pre.value());
  auto tok = BpeTokenizer::build(std::move(spec));
  if (!tok) return Status::error(model_dir + ": " + tok.error());
  return std::unique_ptr<Tokenizer>(std::move(tok.value()));
}

Result<std::unique_ptr<Tokenizer>> Tokenizer::from_dir(const std::string& model_dir) {
  const fs::path dir(model_dir);
  if (fs::exists(dir / "tokenizer.json")) return from_tokenizer_json((dir / "tokenizer.json").string());
  if (fs::exists(dir / "vocab.json") && fs::exists(dir / "merges.txt")) {
    return from_vocab_merges(model_dir);
  }
  return Status::error(model_dir + ": neither tokenizer.json nor vocab.json + merges.txt found");
}

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special)
    : tokenizer_(tokenizer), skip_special_(skip_special) {}

std::string StreamDecoder::push(int32_t id) {
  std::string out;
  if (skip_special_ && tokenizer_.is_special(id)) return out;
  pending_bytes_ += tokenizer_.token_bytes(id);
  const size_t consumed = append_utf8_lossy(pending_bytes_, /*final=*/false, out);
  pending_bytes_.erase(0, consumed);
  return out;
}

std::string StreamDecoder::push(const std::vector<int32_t>& ids) {
  std::string out;
  for (int32_t id : ids) out += push(id);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out;
  append_utf8_lossy(pending_bytes_, /*final=*/true, out);
  pending_bytes_.clear();
  return out;
}

}  // namespace m3
