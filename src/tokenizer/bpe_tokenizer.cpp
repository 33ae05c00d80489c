#include "tokenizer/bpe_tokenizer.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <queue>

namespace m3 {
namespace {

constexpr size_t kMaxCachedWordBytes = 256;
constexpr size_t kMaxCacheEntries = 1 << 18;

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

// Unicode White_Space (what Rust's char::is_whitespace tests).
bool is_whitespace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// Code point ending just before byte offset `end`.
uint32_t code_point_before(std::string_view text, size_t end, size_t& begin) {
  begin = end - 1;
  while (begin > 0 && (static_cast<uint8_t>(text[begin]) & 0xC0) == 0x80) --begin;
  size_t pos = begin;
  return next_code_point(text, pos);
}

bool is_word_char(uint32_t cp) {
  if (cp < 0x80) return std::isalnum(static_cast<int>(cp)) || cp == '_';
  return !is_whitespace(cp);  // approximation of Unicode alphanumeric outside ASCII
}

}  // namespace

Result<std::unique_ptr<BpeTokenizer>> BpeTokenizer::build(BpeSpec spec) {
  std::unique_ptr<BpeTokenizer> tok(new BpeTokenizer());
  tok->pre_tokenizer_ = std::move(spec.pre_tokenizer);
  tok->ignore_merges_ = spec.ignore_merges;

  int32_t max_id = -1;
  for (const auto& [token, id] : spec.vocab) {
    if (id < 0) return Status::error("vocab: negative id for token '" + token + "'");
    max_id = std::max(max_id, id);
  }
  for (const auto& added : spec.added_tokens) {
    if (added.id < 0) return Status::error("added_tokens: negative id for '" + added.content + "'");
    if (added.content.empty()) return Status::error("added_tokens: empty content");
    max_id = std::max(max_id, added.id);
  }
  if (max_id < 0) return Status::error("vocab: empty");
  tok->id_to_token_.resize(max_id + 1);
  tok->id_bytes_.resize(max_id + 1);
  tok->special_.assign(max_id + 1, 0);

  // HF's ByteLevel decoder maps a token char by char when every char is in the byte
  // alphabet and otherwise passes the token's own UTF-8 through.
  auto token_bytes_of = [&](const std::string& token) {
    std::string bytes;
    if (!tok->alphabet_.decode(token, bytes)) bytes = token;
    return bytes;
  };

  tok->token_to_id_.reserve(spec.vocab.size() + spec.added_tokens.size());
  tok->bytes_to_id_.reserve(spec.vocab.size());
  for (const auto& [token, id] : spec.vocab) {
    tok->token_to_id_[token] = id;
    tok->id_to_token_[id] = token;
    tok->id_bytes_[id] = token_bytes_of(token);
    std::string raw;
    if (tok->alphabet_.decode(token, raw)) tok->bytes_to_id_.emplace(std::move(raw), id);
  }
  for (int b = 0; b < 256; ++b) {
    auto it = tok->token_to_id_.find(tok->alphabet_.char_for_byte(static_cast<uint8_t>(b)));
    tok->byte_id_[b] = it == tok->token_to_id_.end() ? -1 : it->second;
  }
  if (spec.unk_token) {
    auto it = tok->token_to_id_.find(*spec.unk_token);
    if (it == tok->token_to_id_.end()) {
      return Status::error("model.unk_token: '" + *spec.unk_token + "' is not in the vocab");
    }
    tok->unk_id_ = it->second;
  }

  tok->merges_.reserve(spec.merges.size());
  int32_t rank = 0;
  for (const auto& [left, right] : spec.merges) {
    auto l = tok->token_to_id_.find(left);
    auto r = tok->token_to_id_.find(right);
    auto m = tok->token_to_id_.find(left + right);
    if (l == tok->token_to_id_.end() || r == tok->token_to_id_.end() ||
        m == tok->token_to_id_.end()) {
      return Status::error("merges: rank " + std::to_string(rank) + " ('" + left + "' '" + right +
                           "') uses a token that is not in the vocab");
    }
    // Only the first (lowest-rank) occurrence of a pair counts, as in HF.
    tok->merges_.emplace(pair_key(l->second, r->second), Merge{rank, m->second});
    ++rank;
  }

  for (auto& added : spec.added_tokens) {
    tok->token_to_id_[added.content] = added.id;
    tok->id_to_token_[added.id] = added.content;
    tok->id_bytes_[added.id] = token_bytes_of(added.content);
    tok->special_[added.id] = added.special ? 1 : 0;
    tok->added_.push_back(added);
  }
  std::stable_sort(tok->added_.begin(), tok->added_.end(),
                   [](const AddedToken& a, const AddedToken& b) {
                     return a.content.size() > b.content.size();
                   });
  for (size_t i = 0; i < tok->added_.size(); ++i) {
    tok->added_by_first_byte_[static_cast<uint8_t>(tok->added_[i].content[0])].push_back(
        static_cast<int32_t>(i));
  }
  return tok;
}

void BpeTokenizer::split_added(std::vector<Segment>& segments, bool normalized_pass,
                               bool allow_special) const {
  std::vector<Segment> out;
  for (const Segment& segment : segments) {
    if (segment.added_id >= 0) {
      out.push_back(segment);
      continue;
    }
    const std::string_view text = segment.text;
    size_t emitted = 0;  // end of the last match (text before it is already handled)
    size_t pos = 0;
    while (pos < text.size()) {
      const AddedToken* found = nullptr;
      for (int32_t index : added_by_first_byte_[static_cast<uint8_t>(text[pos])]) {
        const AddedToken& token = added_[index];
        if (token.normalized != normalized_pass) continue;
        if (token.special && !allow_special) continue;
        if (text.size() - pos < token.content.size()) continue;
        if (std::memcmp(text.data() + pos, token.content.data(), token.content.size()) != 0) {
          continue;
        }
        size_t end = pos + token.content.size();
        if (token.single_word) {
          size_t before_begin = 0;
          if (pos > 0 && is_word_char(code_point_before(text, pos, before_begin))) continue;
          size_t after = end;
          if (end < text.size() && is_word_char(next_code_point(text, after))) continue;
        }
        found = &token;  // longest first, so the first hit is the longest
        break;
      }
      if (found == nullptr) {
        ++pos;
        continue;
      }
      size_t begin = pos;
      size_t end = pos + found->content.size();
      if (found->lstrip) {
        while (begin > emitted) {
          size_t prev = 0;
          if (!is_whitespace(code_point_before(text, begin, prev))) break;
          begin = prev;
        }
      }
      if (found->rstrip) {
        while (end < text.size()) {
          size_t next = end;
          if (!is_whitespace(next_code_point(text, next))) break;
          end = next;
        }
      }
      if (begin > emitted) out.push_back({text.substr(emitted, begin - emitted), -1});
      out.push_back({text.substr(begin, end - begin), found->id});
      emitted = end;
      pos = end;
    }
    if (emitted < text.size()) out.push_back({text.substr(emitted), -1});
  }
  segments = std::move(out);
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text, bool allow_special) const {
  // Invalid input bytes become U+FFFD, as they would in the Python str HF sees.
  const std::string clean = sanitize_utf8(text);
  text = clean;
  std::vector<Segment> segments{{text, -1}};
  split_added(segments, false, allow_special);
  split_added(segments, true, allow_special);

  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  std::vector<std::string_view> words;
  std::deque<std::string> arena;
  for (const Segment& segment : segments) {
    if (segment.added_id >= 0) {
      ids.push_back(segment.added_id);
      continue;
    }
    words.clear();
    pre_tokenizer_.split(segment.text, words, arena);
    for (std::string_view word : words) bpe_word(word, ids);
  }
  return ids;
}

void BpeTokenizer::bpe_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.size() > kMaxCachedWordBytes) {
    bpe_uncached(word, out);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    auto it = cache_.find(word);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> ids;
  bpe_uncached(word, ids);
  out.insert(out.end(), ids.begin(), ids.end());
  std::lock_guard<std::mutex> lock(cache_mutex_);
  if (cache_.size() >= kMaxCacheEntries) cache_.clear();
  cache_.emplace(std::string(word), std::move(ids));
}

void BpeTokenizer::bpe_uncached(std::string_view word, std::vector<int32_t>& out) const {
  if (ignore_merges_) {
    auto it = bytes_to_id_.find(std::string(word));
    if (it != bytes_to_id_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  for (char c : word) {
    int32_t id = byte_id_[static_cast<uint8_t>(c)];
    if (id < 0) {
      if (unk_id_ < 0) continue;  // HF drops characters it cannot represent
      id = unk_id_;
    }
    const auto index = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, index - 1, index + 1});
  }
  if (symbols.empty()) return;
  symbols.back().next = -1;

  // Lowest rank first; among equal ranks the leftmost pair, like HF's merge queue.
  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t merged_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  auto consider = [&](int32_t pos) {
    const int32_t next = symbols[pos].next;
    if (next < 0) return;
    auto it = merges_.find(pair_key(symbols[pos].id, symbols[next].id));
    if (it != merges_.end()) queue.push({it->second.rank, pos, it->second.merged_id});
  };
  for (int32_t pos = 0; pos + 1 < static_cast<int32_t>(symbols.size()); ++pos) consider(pos);

  std::vector<uint8_t> dead(symbols.size(), 0);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (dead[top.pos] || left.next < 0) continue;
    // Stale entry: the pair at this position changed since it was queued.
    auto it = merges_.find(pair_key(left.id, symbols[left.next].id));
    if (it == merges_.end() || it->second.rank != top.rank || it->second.merged_id != top.merged_id) {
      continue;
    }
    const int32_t right = left.next;
    left.id = top.merged_id;
    left.next = symbols[right].next;
    if (left.next >= 0) symbols[left.next].prev = top.pos;
    dead[right] = 1;
    if (left.prev >= 0) consider(left.prev);
    consider(top.pos);
  }
  for (int32_t pos = 0; pos >= 0; pos = symbols[pos].next) out.push_back(symbols[pos].id);
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string bytes;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size()) continue;
    if (skip_special && special_[id]) continue;
    bytes += id_bytes_[id];
  }
  return sanitize_utf8(bytes);
}

std::optional<int32_t> BpeTokenizer::token_to_id(std::string_view token) const {
  auto it = token_to_id_.find(std::string(token));
  if (it == token_to_id_.end()) return std::nullopt;
  return it->second;
}

std::string BpeTokenizer::id_to_token(int32_t id) const {
  if (id < 0 || id >= vocab_size()) return {};
  return id_to_token_[id];
}

bool BpeTokenizer::is_special(int32_t id) const {
  return id >= 0 && id < vocab_size() && special_[id] != 0;
}

std::string_view BpeTokenizer::token_bytes(int32_t id) const {
  if (id < 0 || id >= vocab_size()) return {};
  return id_bytes_[id];
}

}  // namespace m3
