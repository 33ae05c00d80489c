// Structured output's host cost: the time one decode step spends masking the vocabulary for a
// request with response_format json_object / json_schema, guided_regex or guided_choice
// (server/json_mode.h, server/pattern_mode.h), on a synthetic vocabulary of M3's size (200,064
// ids) shaped like a BPE one: every byte, words and word pieces of an English corpus with and
// without a leading space, numbers, punctuation and JSON fragments. Each case feeds a target
// text token by token (greedy longest match) through a fresh constraint, as one request does,
// and times every step's mask. Prints a table and writes JSON.
//   structured_bench [--corpus FILE] [--vocab N] [--reps R] [--json OUT]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "chat/byte_regex.h"
#include "chat/json_schema.h"
#include "server/json_mode.h"
#include "server/pattern_mode.h"
#include "tokenizer/list_tokenizer.h"

namespace {

using m3::server::ByteConstraint;
using Clock = std::chrono::steady_clock;

// " " + s, built in place (GCC 12's -Wrestrict misreads the operator+ form).
std::string spaced(const std::string& s) {
  std::string out;
  out.reserve(s.size() + 1);
  out += ' ';
  out += s;
  return out;
}

// Every byte, numbers, JSON fragments, then corpus words and word pieces by frequency (the way
// BPE merges grow a vocabulary), random lowercase pieces if the corpus runs out.
m3::ListTokenizer synthetic_vocab(const std::string& corpus, size_t target) {
  std::vector<std::string> items = {"<s>", "</s>", "<mm:think>", "</mm:think>"};
  std::set<std::string> seen(items.begin(), items.end());
  auto add = [&](const std::string& t) {
    if (!t.empty() && seen.insert(t).second) items.push_back(t);
  };
  for (int b = 0; b < 256; ++b) add(std::string(1, char(b)));
  for (int n = 0; n < 1000; ++n) add(std::to_string(n)), add(spaced(std::to_string(n)));
  const char* json_bits[] = {"\":", "\",", "{\"", "\"}", "\": \"", "\", \"", "\n", "\n  ", "\n    ", "  \"", "},",
                             "],", "[\"", "\"]", "\": [", "\": {", "true", "false", "null", " true", " false", " null",
                             "\": ", ", \"", "\\n", "\\\"", "{\n", "}\n", "...", ". ", ", ", "--", "://", ".com"};
  for (const char* b : json_bits) add(b);
  std::unordered_map<std::string, int> counts;
  std::string word;
  auto flush = [&] {
    if (word.empty()) return;
    counts[word] += 3, counts[spaced(word)] += 4;
    for (size_t len = 2; len <= std::min<size_t>(8, word.size()); ++len)
      for (size_t at = 0; at + len <= word.size(); ++at) counts[word.substr(at, len)] += 1;
    word.clear();
  };
  for (char c : corpus) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || uint8_t(c) >= 0x80) word += c;
    else flush();
  }
  flush();
  std::vector<std::pair<int, std::string>> ranked;
  for (auto& [w, n] : counts) ranked.emplace_back(-n, w);
  std::sort(ranked.begin(), ranked.end());
  for (const auto& r : ranked) {
    if (items.size() >= target) break;
    add(r.second);
  }
  std::mt19937 rng(1);
  while (items.size() < target) {
    std::string t;
    if (rng() % 2) t += ' ';
    for (int k = 2 + int(rng() % 7); k > 0; --k) t += char('a' + rng() % 26);
    add(t);
  }
  return m3::ListTokenizer(std::move(items), 4);
}

struct Case {
  std::string name, kind, spec, text;
};

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[std::min(v.size() - 1, size_t(p * double(v.size() - 1) + 0.5))];
}

}  // namespace

int main(int argc, char** argv) {
  std::string corpus_path = std::string(M3_SOURCE_DIR) + "/../shared/data/corpus/pg1184-monte-cristo.txt";
  std::string json_out = "structured_bench.json";
  size_t vocab_size = 200064;
  int reps = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--corpus") corpus_path = argv[i + 1];
    else if (a == "--vocab") vocab_size = size_t(std::stoul(argv[i + 1]));
    else if (a == "--reps") reps = std::stoi(argv[i + 1]);
    else if (a == "--json") json_out = argv[i + 1];
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  std::string corpus;
  if (std::ifstream f(corpus_path); f) {
    std::stringstream ss;
    ss << f.rdbuf();
    corpus = ss.str();
  } else {
    std::printf("corpus %s not found: the vocabulary's words are random letters\n", corpus_path.c_str());
  }
  auto t0 = Clock::now();
  const m3::ListTokenizer vocab = synthetic_vocab(corpus, vocab_size);
  const double vocab_ms = ms_since(t0);
  t0 = Clock::now();
  auto table = std::make_shared<const m3::server::TokenBytes>(vocab);
  const double table_ms = ms_since(t0);
  const int64_t n = vocab.vocab_size();
  std::printf("vocabulary: %lld ids (built in %.0f ms); token table and tries: %.0f ms (once per server), %zu trie "
              "nodes\n", (long long)n, vocab_ms, table_ms, table->all.nodes.size());

  const std::string person =
      R"({"name": "Edmond Dantès", "age": 19, "ship": "Pharaon", "tags": ["sailor", "prisoner"], "free": false})";
  const std::string schema =
      R"({"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"},"ship":{"type":"string"},)"
      R"("tags":{"type":"array","items":{"type":"string"}},"free":{"type":"boolean"}},)"
      R"("required":["name","age","ship","tags","free"],"additionalProperties":false})";
  const std::vector<Case> cases = {
      {"json_object", "json", "", person},
      {"json_schema", "json", schema, person},
      {"json_schema_strings", "json",
       R"({"type":"object","properties":{"name":{"type":"string","pattern":"^[A-Z][a-z]+( [A-Z][a-z]+)*$"},)"
       R"("born":{"type":"string","format":"date"},"mail":{"type":"string","format":"email","maxLength":64}},)"
       R"("required":["name","born","mail"],"additionalProperties":false})",
       R"({"name": "Edmond Dantes", "born": "1796-02-24", "mail": "edmond@chateau-if.fr"})"},
      {"regex_email", "regex", R"([a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,})", "edmond.dantes@chateau-if.fr"},
      {"regex_timestamp", "regex", R"(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z)", "1815-02-24T14:30:00Z"},
      {"regex_sentence", "regex", R"([A-Z][a-z]+( [a-z]+){3,16}\.)", "The prisoner of the castle waited for many long years."},
      {"regex_any_line", "regex", R"([^\n]{1,200})", "Monte Cristo, 1844: a story of patience and of revenge."},
      {"choice_8", "choice", "", "Marseille"},
  };
  const std::vector<std::string> cities = {"Paris", "Marseille", "Rome", "Florence", "Livorno", "Toulon", "Lyon", "Nice"};

  nlohmann::json rows = nlohmann::json::array();
  std::printf("%-20s %6s %10s %10s %10s %10s %9s\n", "case", "steps", "first_ms", "mean_ms", "p50_ms", "max_ms", "dfa");
  for (const Case& c : cases) {
    const std::vector<int32_t> ids = vocab.encode(c.text, false);
    std::vector<double> steps, firsts;
    size_t dfa_states = 0;
    for (int r = 0; r < reps; ++r) {
      std::shared_ptr<m3::LogitsConstraint> con;
      std::shared_ptr<const m3::RegexNfa> nfa;
      if (c.kind == "json") {
        auto sch = c.spec.empty() ? m3::JsonSchema::any_object()
                                  : *m3::JsonSchema::compile(nlohmann::ordered_json::parse(c.spec));
        con = std::make_shared<m3::server::JsonObjectConstraint>(table, std::vector<int32_t>{1},
                                                                 ByteConstraint::Start::kAtOnce, sch);
      } else {
        nfa = c.kind == "regex" ? *m3::RegexNfa::compile(c.spec) : m3::RegexNfa::choice(cities);
        con = std::make_shared<m3::server::PatternConstraint>(table, std::vector<int32_t>{1},
                                                              ByteConstraint::Start::kAtOnce, nfa);
      }
      std::vector<float> logits(static_cast<size_t>(n));
      std::vector<int32_t> out;
      for (size_t s = 0; s <= ids.size(); ++s) {
        std::fill(logits.begin(), logits.end(), 0.0f);
        const auto t = Clock::now();
        con->apply(out, logits.data(), n);
        const double ms = ms_since(t);
        (s == 0 ? firsts : steps).push_back(ms);
        if (s < ids.size()) {
          if (std::isinf(logits[size_t(ids[s])])) {
            std::fprintf(stderr, "%s: the target's token %zu ('%s') was masked\n", c.name.c_str(), s,
                         std::string(vocab.token_bytes(ids[s])).c_str());
            return 1;
          }
          out.push_back(ids[s]);
        } else if (std::isinf(logits[1])) {
          std::fprintf(stderr, "%s: the end was masked after the whole target\n", c.name.c_str());
          return 1;
        }
      }
      if (nfa) {
        m3::LazyDfa probe(nfa);  // the states the target's own bytes need
        int32_t st = probe.start();
        for (char ch : c.text) st = probe.next(st, uint8_t(ch));
        dfa_states = probe.size();
      }
    }
    double sum = 0;
    for (double v : steps) sum += v;
    const double mean = steps.empty() ? 0 : sum / double(steps.size());
    std::printf("%-20s %6zu %10.3f %10.3f %10.3f %10.3f %9s\n", c.name.c_str(), ids.size(), percentile(firsts, 0.5),
                mean, percentile(steps, 0.5), percentile(steps, 1.0),
                c.kind == "json" ? "-" : std::to_string(dfa_states).c_str());
    rows.push_back({{"case", c.name}, {"kind", c.kind}, {"pattern", c.spec}, {"target_tokens", ids.size()},
                    {"first_step_ms", percentile(firsts, 0.5)}, {"mean_step_ms", mean},
                    {"p50_step_ms", percentile(steps, 0.5)}, {"p90_step_ms", percentile(steps, 0.9)},
                    {"max_step_ms", percentile(steps, 1.0)}});
  }
  nlohmann::json doc = {{"vocab_size", n}, {"corpus", corpus.empty() ? "" : corpus_path}, {"reps", reps},
                        {"table_build_ms", table_ms},
                        {"trie_nodes", table->all.nodes.size()}, {"cases", rows}};
  std::ofstream(json_out) << doc.dump(2) << "\n";
  std::printf("wrote %s\n", json_out.c_str());
  return 0;
}
