#pragma once
// Per-request sampling on host logits: a constraint (structured output), allowed ids, bad words, min_tokens, logit
// bias, penalties, temperature, top-k, top-p, min-p, a seeded
// generator per request, and top-N logprobs. Greedy (temperature 0) is deterministic argmax
// with ties to the lower token id.
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"

namespace m3 {

inline constexpr int kMaxLogitBias = 1024;  // logit_bias entries per request

// A stateful per-request logits processor (structured output, e.g. JSON mode): sets to -inf the
// logits of the tokens that may not follow `output_ids`. Called once per sampled token, in order,
// with the request's whole output so far; it owns whatever state it keeps between calls.
class LogitsConstraint {
 public:
  virtual ~LogitsConstraint() = default;
  virtual void apply(const std::vector<int32_t>& output_ids, float* logits, int64_t vocab) = 0;
};

struct SamplingParams {
  float temperature = 1.0f;  // 0 = greedy
  float top_p = 1.0f;
  int top_k = 0;             // 0 or -1 = off
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;  // > 1 discourages tokens already in prompt or output
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  int64_t seed = -1;          // -1 = nondeterministic
  int max_tokens = 16;
  int min_tokens = 0;         // the stop ids (EOS included) are banned until this many tokens exist
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  int logprobs = -1;          // -1 = none; N >= 0 = the sampled token's plus the top N
  int prompt_logprobs = -1;   // -1 = none; N >= 0 = each prompt token's (after the first) plus the top N
  // OpenAI logit_bias: (token id, bias in [-100, 100]) added to the logits before the penalties
  // and the sampling (vLLM's order); reported logprobs stay those of the unmodified distribution.
  std::vector<std::pair<int32_t, float>> logit_bias;
  // vLLM's allowed_token_ids: when non-empty, only these ids can be sampled (applied first).
  std::vector<int32_t> allowed_token_ids;
  // vLLM's bad_words as token sequences: the last token of each is banned whenever the output
  // ends with the others (a one-token word always).
  std::vector<std::vector<int32_t>> bad_words;
  // Applied first of all (one instance per request: it keeps state); null = none.
  std::shared_ptr<LogitsConstraint> constraint;

  // Every problem at once, phrased for an API error ("temperature must be >= 0"), each starting
  // with the parameter's name; vocab_size > 0 also checks the token ids against the vocabulary.
  std::vector<std::string> validate(int64_t vocab_size = 0) const;
};

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
};

struct SampleResult {
  int32_t token = 0;
  float logprob = 0.0f;              // of the sampled token under the unmodified distribution
  std::vector<TokenLogprob> top;     // top-N by logprob (unmodified distribution)
};

// log-softmax of raw logits (double sums), as every reported logprob is computed.
void log_softmax(const float* logits, int64_t vocab, std::vector<float>& out);
// The n largest of a logprob row, ties to the lower id.
std::vector<TokenLogprob> top_logprobs(const std::vector<float>& logp, int n);

class Sampler {
 public:
  // stop_ids: the ids that end the request (its stop_token_ids and, unless ignore_eos, the EOS
  // ids), which min_tokens bans.
  explicit Sampler(const SamplingParams& params, std::vector<int32_t> stop_ids = {});
  // logits: [vocab]; prompt/output ids feed the penalties. `logits` is modified in place.
  SampleResult sample(float* logits, int64_t vocab, const std::vector<int32_t>& prompt_ids,
                      const std::vector<int32_t>& output_ids);
  // Whether `token` ends the request (one of the stop ids given at construction).
  bool is_stop(int32_t token) const;

 private:
  SamplingParams params_;
  std::vector<int32_t> stop_ids_;
  std::mt19937_64 rng_;
};

}  // namespace m3
