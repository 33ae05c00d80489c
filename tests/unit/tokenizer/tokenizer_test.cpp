// Tokenizer tests: UTF-8 helpers, and exact parity with HF `tokenizers` on goldens that
// make_tokenizer_goldens.py writes at test time (fixture unit_tokenizer_goldens_setup).
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace m3 {
namespace {

namespace fs = std::filesystem;

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
  }
  return out;
}

std::string printable(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7F) {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    }
  }
  return out;
}

TEST(Utf8, LossyFollowsMaximalSubpartRule) {
  const std::string fffd = "\xEF\xBF\xBD";
  EXPECT_EQ(sanitize_utf8("abc"), "abc");
  EXPECT_EQ(sanitize_utf8("\xFF"), fffd);
  EXPECT_EQ(sanitize_utf8("\xE4\xBD"), fffd);                 // truncated: one replacement
  EXPECT_EQ(sanitize_utf8("\xED\xA0\x80"), fffd + fffd + fffd);  // surrogate: three
  EXPECT_EQ(sanitize_utf8("\xC0\xAF"), fffd + fffd);           // overlong lead
  EXPECT_EQ(sanitize_utf8("\xF0\x9F\x98x"), fffd + "x");
  std::string out;
  EXPECT_EQ(append_utf8_lossy("ab\xF0\x9F", false, out), 2u);  // held back, not replaced
  EXPECT_EQ(out, "ab");
}

TEST(Utf8, ByteLevelAlphabetRoundTrips) {
  ByteLevelAlphabet alphabet;
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  const std::string mapped = alphabet.encode(all);
  EXPECT_EQ(mapped.find(' '), std::string::npos);
  EXPECT_EQ(alphabet.char_for_byte(' '), "\xC4\xA0");  // 'Ġ'
  std::string back;
  ASSERT_TRUE(alphabet.decode(mapped, back));
  EXPECT_EQ(back, all);
  std::string untouched = "keep";
  EXPECT_FALSE(alphabet.decode("a b", untouched));  // raw space is not in the alphabet
  EXPECT_EQ(untouched, "keep");
}

TEST(Tokenizer, MissingAndMalformedFilesAreErrors) {
  EXPECT_FALSE(Tokenizer::from_dir("/nonexistent/model/dir").is_ok());
  const fs::path dir = fs::temp_directory_path() / "m3_tokenizer_bad";
  fs::create_directories(dir);
  std::ofstream(dir / "tokenizer.json") << "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0},"
                                          " \"merges\": [\"a b\"]}, \"pre_tokenizer\": {\"type\": \"ByteLevel\"}}";
  auto bad_merge = Tokenizer::from_dir(dir.string());
  ASSERT_FALSE(bad_merge.is_ok());
  EXPECT_NE(bad_merge.error().find("merges"), std::string::npos) << bad_merge.error();
  std::ofstream(dir / "tokenizer.json") << "{\"model\": {\"vocab\": {\"a\": 0}, \"merges\": []},"
                                          " \"pre_tokenizer\": {\"type\": \"Whitespace\"}}";
  auto bad_pre = Tokenizer::from_dir(dir.string());
  ASSERT_FALSE(bad_pre.is_ok());
  EXPECT_NE(bad_pre.error().find("Whitespace"), std::string::npos) << bad_pre.error();
  std::ofstream(dir / "tokenizer.json") << "{not json";
  EXPECT_FALSE(Tokenizer::from_dir(dir.string()).is_ok());
  fs::remove_all(dir);
}

TEST(Tokenizer, VocabMergesWithAddedTokensJson) {
  const fs::path dir = fs::temp_directory_path() / "m3_tokenizer_vm";
  fs::remove_all(dir);
  fs::create_directories(dir);
  // "Ġ" is the byte-level spelling of a space.
  std::ofstream(dir / "vocab.json") << R"({"a": 0, "b": 1, "ab": 2, "\u0120": 3, "\u0120ab": 4})";
  std::ofstream(dir / "merges.txt") << "#version: 0.2\na b\n\u0120 ab\n";
  std::ofstream(dir / "added_tokens.json") << R"({"<x>": 5})";
  auto tok = Tokenizer::from_dir(dir.string());
  ASSERT_TRUE(tok.is_ok()) << tok.error();
  EXPECT_EQ((*tok)->encode("ab<x> ab"), (std::vector<int32_t>{2, 5, 4}));
  EXPECT_EQ((*tok)->encode("abc"), (std::vector<int32_t>{2}));  // 'c' is not representable: dropped
  EXPECT_EQ((*tok)->decode({2, 5, 4}), "ab<x> ab");
  EXPECT_EQ((*tok)->vocab_size(), 6);
  EXPECT_FALSE((*tok)->is_special(5));
  EXPECT_EQ((*tok)->token_to_id("<x>"), std::optional<int32_t>(5));
  EXPECT_EQ((*tok)->id_to_token(4), "\u0120ab");
  fs::remove_all(dir);
}

class HfParity : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* env = std::getenv("M3_TOKENIZER_GOLDENS");
    if (env == nullptr) GTEST_SKIP() << "M3_TOKENIZER_GOLDENS not set (run through ctest)";
    dir_ = env;
    if (fs::exists(dir_ / "SKIP")) {
      std::ifstream in(dir_ / "SKIP");
      std::string reason((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      GTEST_SKIP() << "tokenizer goldens were not generated: " << reason;
    }
    if (!fs::exists(dir_ / "goldens.json")) {
      GTEST_SKIP() << "no goldens at " << dir_ << " (fixture unit_tokenizer_goldens_setup)";
    }
    std::ifstream in(dir_ / "goldens.json");
    goldens_ = nlohmann::json::parse(in);
  }

  std::unique_ptr<Tokenizer> load(const std::string& variant) {
    auto tok = Tokenizer::from_dir((dir_ / variant).string());
    EXPECT_TRUE(tok.is_ok()) << tok.error();
    return tok.is_ok() ? std::move(tok.value()) : nullptr;
  }

  // Encodes every case and compares with the field `key`; returns the mismatch count.
  int check_encode(const Tokenizer& tok, const std::string& key, bool allow_special) {
    int mismatches = 0;
    for (const auto& c : goldens_["cases"]) {
      const std::string text = from_hex(c["hex"].get<std::string>());
      const auto expected = c[key].get<std::vector<int32_t>>();
      const auto got = tok.encode(text, allow_special);
      if (got != expected && ++mismatches <= 5) {
        ADD_FAILURE() << key << " mismatch for '" << printable(text) << "': got "
                      << nlohmann::json(got).dump() << " want " << nlohmann::json(expected).dump();
      }
    }
    return mismatches;
  }

  fs::path dir_;
  nlohmann::json goldens_;
};

TEST_F(HfParity, SplitRegexThenByteLevel) {
  auto tok = load("json_split");
  ASSERT_TRUE(tok);
  EXPECT_EQ(check_encode(*tok, "split", true), 0);
}

TEST_F(HfParity, PossessiveCaseClassRegex) {
  auto tok = load("json_o200k");
  ASSERT_TRUE(tok);
  EXPECT_EQ(check_encode(*tok, "o200k", true), 0);
}

TEST_F(HfParity, AddPrefixSpace) {
  auto tok = load("json_prefix_space");
  ASSERT_TRUE(tok);
  EXPECT_EQ(check_encode(*tok, "prefix_space", true), 0);
}

TEST_F(HfParity, IgnoreMerges) {
  auto tok = load("json_ignore_merges");
  ASSERT_TRUE(tok);
  EXPECT_EQ(check_encode(*tok, "ignore_merges", true), 0);
}

TEST_F(HfParity, ByteLevelWithStringMerges) {
  auto tok = load("json_bytelevel");
  ASSERT_TRUE(tok);
  EXPECT_EQ(tok->vocab_size(), goldens_["vocab_size"].get<int32_t>());
  EXPECT_EQ(check_encode(*tok, "bytelevel", true), 0);
  EXPECT_EQ(check_encode(*tok, "bytelevel_no_special", false), 0);
  auto bos = tok->token_to_id("]~b]");
  ASSERT_TRUE(bos.has_value());
  EXPECT_TRUE(tok->is_special(*bos));
  EXPECT_EQ(tok->id_to_token(*bos), "]~b]");
  auto call = tok->token_to_id("<tool_call>");
  ASSERT_TRUE(call.has_value());
  EXPECT_FALSE(tok->is_special(*call));
  EXPECT_EQ(tok->id_to_token(-1), "");
}

TEST_F(HfParity, VocabMergesMatchesTokenizerJson) {
  auto tok = load("vocab_merges");
  ASSERT_TRUE(tok);
  EXPECT_EQ(check_encode(*tok, "bytelevel", true), 0);
}

TEST_F(HfParity, DecodeRoundTripAndRandomIds) {
  auto tok = load("json_bytelevel");
  ASSERT_TRUE(tok);
  int mismatches = 0;
  for (const auto& c : goldens_["cases"]) {
    const std::string text = from_hex(c["hex"].get<std::string>());
    const std::string expected =
        c.contains("decoded_hex") ? from_hex(c["decoded_hex"].get<std::string>()) : sanitize_utf8(text);
    const std::string got = tok->decode(c["bytelevel"].get<std::vector<int32_t>>());
    if (got != expected && ++mismatches <= 5) {
      ADD_FAILURE() << "round trip of '" << printable(text) << "' gave '" << printable(got) << "'";
    }
  }
  EXPECT_EQ(mismatches, 0);

  for (const auto& d : goldens_["decodes"]) {
    const auto ids = d["ids"].get<std::vector<int32_t>>();
    for (bool skip : {false, true}) {
      const std::string expected = from_hex(d[skip ? "text_skip" : "text"].get<std::string>());
      EXPECT_EQ(printable(tok->decode(ids, skip)), printable(expected))
          << nlohmann::json(ids).dump() << " skip_special=" << skip;
      StreamDecoder stream(*tok, skip);
      std::string streamed;
      for (int32_t id : ids) {
        const std::string piece = stream.push(id);
        EXPECT_EQ(sanitize_utf8(piece), piece) << "stream emitted broken UTF-8";
        streamed += piece;
      }
      streamed += stream.flush();
      EXPECT_EQ(printable(streamed), printable(expected)) << nlohmann::json(ids).dump();
    }
  }
}

TEST_F(HfParity, StreamDecoderHoldsBackSplitCharacters) {
  auto tok = load("json_bytelevel");
  ASSERT_TRUE(tok);
  // Byte-level tokens for the 4 bytes of an emoji (each byte alone is a vocab token).
  const std::string emoji = "\xF0\x9F\x98\x80";
  std::vector<int32_t> ids;
  ByteLevelAlphabet alphabet;
  for (char c : emoji) {
    auto id = tok->token_to_id(alphabet.char_for_byte(static_cast<uint8_t>(c)));
    ASSERT_TRUE(id.has_value());
    ids.push_back(*id);
  }
  StreamDecoder stream(*tok);
  EXPECT_EQ(stream.push(ids[0]), "");
  EXPECT_EQ(stream.push(ids[1]), "");
  EXPECT_EQ(stream.push(ids[2]), "");
  EXPECT_EQ(stream.push(ids[3]), emoji);
  EXPECT_EQ(stream.push(ids[0]), "");
  EXPECT_EQ(stream.flush(), "\xEF\xBF\xBD");
}

}  // namespace
}  // namespace m3
