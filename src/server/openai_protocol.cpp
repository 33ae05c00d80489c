// Request validation for the OpenAI endpoints. Checks follow the field order of the API
// reference so the first error reported is the one a reader expects.
#include "server/openai_protocol.h"

#include <cmath>

#include "server/tool_choice_mode.h"

namespace m3::server {
namespace {

constexpr int kMaxN = 128;
constexpr int kMaxTopLogprobs = 20;
constexpr size_t kMaxStopStrings = 16;
constexpr size_t kMaxBadWords = 128;
constexpr size_t kMaxChoices = 1024;
constexpr size_t kMaxPatternBytes = 64 * 1024;  // a regex's, or all choices' together

const char* type_name(const OrderedJson& v) {
  switch (v.type()) {
    case OrderedJson::value_t::null: return "null";
    case OrderedJson::value_t::boolean: return "a boolean";
    case OrderedJson::value_t::string: return "a string";
    case OrderedJson::value_t::array: return "an array";
    case OrderedJson::value_t::object: return "an object";
    case OrderedJson::value_t::number_float: return "a number";
    default: return "an integer";
  }
}

// GCC 12 warns (-Wrestrict, a false positive) on "'" + std::string(...); build it in place.
std::string quoted(const std::string& field) {
  std::string out;
  out.reserve(field.size() + 2);
  out += '\'';
  out += field;
  out += '\'';
  return out;
}

ApiError wrong_type(const std::string& field, const char* expected, const OrderedJson& got) {
  return invalid_request("'" + field + "' must be " + expected + ", got " + type_name(got), field);
}

// A present, non-null member, or nullptr.
const OrderedJson* member(const OrderedJson& body, const char* key) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<ApiError> get_bool(const OrderedJson& body, const char* key, bool& out) {
  const OrderedJson* v = member(body, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) return wrong_type(key, "a boolean", *v);
  out = v->get<bool>();
  return std::nullopt;
}

std::optional<ApiError> get_number(const OrderedJson& body, const char* key, std::optional<double>& out) {
  const OrderedJson* v = member(body, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) return wrong_type(key, "a number", *v);
  double d = v->get<double>();
  if (!std::isfinite(d)) return invalid_request(quoted(key) + " must be finite", key);
  out = d;
  return std::nullopt;
}

std::optional<ApiError> get_int(const OrderedJson& body, const char* key, std::optional<int64_t>& out) {
  const OrderedJson* v = member(body, key);
  if (!v) return std::nullopt;
  if (v->is_number_integer() || v->is_number_unsigned()) {
    if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(INT64_MAX))
      return invalid_request(quoted(key) + " is out of range", key);
    out = v->get<int64_t>();
    return std::nullopt;
  }
  if (v->is_number_float()) {  // 2.0 is an integer in JSON Schema terms
    double d = v->get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9e15) {
      out = int64_t(d);
      return std::nullopt;
    }
  }
  return wrong_type(key, "an integer", *v);
}

// An array of token ids (non-negative 32-bit integers); non_empty: at least one.
std::optional<ApiError> get_token_ids(const OrderedJson& body, const char* key, bool non_empty,
                                      std::vector<int32_t>& out) {
  const OrderedJson* v = member(body, key);
  if (!v) return std::nullopt;
  if (!v->is_array()) return wrong_type(key, "an array of token ids", *v);
  if (non_empty && v->empty()) return invalid_request(quoted(key) + " must hold at least one token id", key);
  for (size_t k = 0; k < v->size(); ++k) {
    const auto& t = (*v)[k];
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX)
      return invalid_request(quoted(std::string(key) + "[" + std::to_string(k) + "]") + " must be a non-negative integer",
                             key);
    out.push_back(int32_t(t.get<int64_t>()));
  }
  return std::nullopt;
}

std::optional<ApiError> check_range(const char* key, double value, double lo, double hi, const char* rule) {
  if (value < lo || value > hi) return invalid_request(quoted(key) + " must be " + rule, key);
  return std::nullopt;
}

#define M3_TRY(expr)                          \
  do {                                        \
    if (auto err_ = (expr)) return err_;      \
  } while (0)

// response_format, vLLM's guided_* fields and its structured_outputs object: at most one
// constraint on the output's text.
std::optional<ApiError> parse_structured_output(const OrderedJson& body, CommonRequest& out) {
  std::vector<std::string> given;  // which fields constrain the output, for the one-only rule
  auto schema_from = [&](const OrderedJson& v, const std::string& field) -> std::optional<ApiError> {
    // A schema object, or its JSON text (vLLM accepts both).
    OrderedJson parsed;
    const OrderedJson* schema = &v;
    if (v.is_string()) {
      parsed = OrderedJson::parse(v.get<std::string>(), nullptr, false);
      if (parsed.is_discarded()) return invalid_request(quoted(field) + " is not valid JSON", field);
      schema = &parsed;
    }
    if (!schema->is_object() && !schema->is_boolean()) return wrong_type(field, "a JSON Schema object", *schema);
    auto compiled = JsonSchema::compile(*schema);
    if (!compiled.is_ok()) return invalid_request(quoted(field) + ": " + compiled.error(), field);
    out.json_object = true;
    out.json_schema = *compiled;
    return std::nullopt;
  };
  auto regex_from = [&](const OrderedJson& v, const std::string& field) -> std::optional<ApiError> {
    if (!v.is_string()) return wrong_type(field, "a string", v);
    if (v.get<std::string>().size() > kMaxPatternBytes)
      return invalid_request(quoted(field) + " is longer than " + std::to_string(kMaxPatternBytes) + " bytes", field);
    auto nfa = RegexNfa::compile(v.get<std::string>());
    if (!nfa.is_ok()) return invalid_request(quoted(field) + ": " + nfa.error(), field);
    out.pattern = *nfa;
    return std::nullopt;
  };
  auto choice_from = [&](const OrderedJson& v, const std::string& field) -> std::optional<ApiError> {
    if (!v.is_array() || v.empty()) return invalid_request(quoted(field) + " must be a non-empty array of strings", field);
    if (v.size() > kMaxChoices)
      return invalid_request(quoted(field) + " may hold at most " + std::to_string(kMaxChoices) + " strings", field);
    std::vector<std::string> options;
    size_t bytes = 0;
    for (size_t k = 0; k < v.size(); ++k) {
      if (!v[k].is_string()) return wrong_type(field + "[" + std::to_string(k) + "]", "a string", v[k]);
      options.push_back(v[k].get<std::string>());
      bytes += options.back().size();
    }
    if (bytes > kMaxPatternBytes)
      return invalid_request(quoted(field) + " holds more than " + std::to_string(kMaxPatternBytes) + " bytes", field);
    out.pattern = RegexNfa::choice(options);
    return std::nullopt;
  };

  if (const OrderedJson* v = member(body, "response_format")) {
    if (!v->is_object()) return wrong_type("response_format", "an object", *v);
    const OrderedJson* type = member(*v, "type");
    if (type && !type->is_string()) return wrong_type("response_format.type", "a string", *type);
    const std::string t = type ? type->get<std::string>() : "text";
    if (t == "json_object") {
      out.json_object = true;
      given.push_back("response_format");
    } else if (t == "json_schema") {
      // {"type": "json_schema", "json_schema": {"name", "schema"?, "strict"?}}: no schema = any object.
      const OrderedJson* js = member(*v, "json_schema");
      if (!js || !js->is_object()) return invalid_request("'response_format.json_schema' must be an object", "response_format");
      out.json_object = true;
      given.push_back("response_format");
      if (const OrderedJson* schema = member(*js, "schema")) {
        auto compiled = JsonSchema::compile(*schema);
        if (!compiled.is_ok())
          return invalid_request("'response_format.json_schema.schema': " + compiled.error(), "response_format");
        out.json_schema = *compiled;
      }
    } else if (t != "text") {
      return invalid_request("'response_format' of type '" + t + "' is not supported (text, json_object and "
                             "json_schema are)", "response_format");
    }
  }
  if (const OrderedJson* v = member(body, "guided_json")) {
    given.push_back("guided_json");
    M3_TRY(schema_from(*v, "guided_json"));
  }
  if (const OrderedJson* v = member(body, "guided_regex")) {
    given.push_back("guided_regex");
    M3_TRY(regex_from(*v, "guided_regex"));
  }
  if (const OrderedJson* v = member(body, "guided_choice")) {
    given.push_back("guided_choice");
    M3_TRY(choice_from(*v, "guided_choice"));
  }
  if (member(body, "guided_grammar")) return invalid_request("'guided_grammar' is not supported", "guided_grammar");
  if (member(body, "guided_whitespace_pattern"))
    return invalid_request("'guided_whitespace_pattern' is not supported", "guided_whitespace_pattern");
  if (const OrderedJson* so = member(body, "structured_outputs")) {
    // vLLM's newer form: {"json" | "regex" | "choice" | "json_object": ..., options}.
    if (!so->is_object()) return wrong_type("structured_outputs", "an object", *so);
    for (auto it = so->begin(); it != so->end(); ++it) {
      const std::string key = it.key(), field = "structured_outputs." + key;
      const OrderedJson& v = it.value();
      if (v.is_null()) continue;
      if (key == "json") {
        given.push_back(field);
        M3_TRY(schema_from(v, field));
      } else if (key == "regex") {
        given.push_back(field);
        M3_TRY(regex_from(v, field));
      } else if (key == "choice") {
        given.push_back(field);
        M3_TRY(choice_from(v, field));
      } else if (key == "json_object") {
        if (!v.is_boolean()) return wrong_type(field, "a boolean", v);
        if (v.get<bool>()) {
          given.push_back(field);
          out.json_object = true;
        }
      } else if (key == "disable_fallback" || key == "backend") {
        // Which vLLM backend serves the constraint: one here.
      } else if ((key == "disable_any_whitespace" || key == "disable_additional_properties") && v.is_boolean() &&
                 !v.get<bool>()) {
        // false is what this server does.
      } else {
        return invalid_request(quoted(field) + " is not supported", "structured_outputs");
      }
    }
  }
  if (given.size() > 1)
    return invalid_request("only one output constraint may be given; got " + given[0] + " and " + given[1], given[1]);
  return std::nullopt;
}

std::optional<ApiError> parse_common(const OrderedJson& body, bool chat, CommonRequest& out) {
  if (const OrderedJson* v = member(body, "model")) {
    if (!v->is_string()) return wrong_type("model", "a string", *v);
    out.model = v->get<std::string>();
  }
  std::optional<int64_t> i;
  M3_TRY(get_int(body, "n", i));
  if (i) {
    if (*i < 1 || *i > kMaxN) return invalid_request("'n' must be between 1 and " + std::to_string(kMaxN), "n");
    out.n = int(*i);
  }
  // max_completion_tokens supersedes max_tokens (chat); both must be >= 1.
  for (const char* key : {"max_tokens", "max_completion_tokens"}) {
    if (!chat && std::string(key) == "max_completion_tokens") continue;
    i.reset();
    M3_TRY(get_int(body, key, i));
    if (i) {
      if (*i < 1) return invalid_request(quoted(key) + " must be at least 1", key);
      if (*i > INT32_MAX) return invalid_request(quoted(key) + " is too large", key);
      out.max_tokens = int(*i);
    }
  }
  SamplingParams& s = out.sampling;
  std::optional<double> d;
  M3_TRY(get_number(body, "temperature", d));
  if (d) {
    M3_TRY(check_range("temperature", *d, 0.0, 1e6, ">= 0"));
    s.temperature = float(*d);
  }
  d.reset();
  M3_TRY(get_number(body, "top_p", d));
  if (d) {
    if (*d <= 0.0 || *d > 1.0) return invalid_request("'top_p' must be in (0, 1]", "top_p");
    s.top_p = float(*d);
  }
  i.reset();
  M3_TRY(get_int(body, "top_k", i));
  if (i) {
    if (*i < -1 || *i > INT32_MAX) return invalid_request("'top_k' must be -1 (off), 0 (off) or a positive integer", "top_k");
    s.top_k = int(*i);
  }
  d.reset();
  M3_TRY(get_number(body, "min_p", d));
  if (d) {
    M3_TRY(check_range("min_p", *d, 0.0, 1.0, "in [0, 1]"));
    s.min_p = float(*d);
  }
  d.reset();
  M3_TRY(get_number(body, "presence_penalty", d));
  if (d) {
    M3_TRY(check_range("presence_penalty", *d, -2.0, 2.0, "in [-2, 2]"));
    s.presence_penalty = float(*d);
  }
  d.reset();
  M3_TRY(get_number(body, "frequency_penalty", d));
  if (d) {
    M3_TRY(check_range("frequency_penalty", *d, -2.0, 2.0, "in [-2, 2]"));
    s.frequency_penalty = float(*d);
  }
  d.reset();
  M3_TRY(get_number(body, "repetition_penalty", d));
  if (d) {
    if (*d <= 0.0) return invalid_request("'repetition_penalty' must be > 0", "repetition_penalty");
    s.repetition_penalty = float(*d);
  }
  i.reset();
  M3_TRY(get_int(body, "seed", i));
  if (i) s.seed = *i;
  if (const OrderedJson* v = member(body, "stop")) {
    if (v->is_string()) {
      if (!v->get<std::string>().empty()) out.stop.push_back(v->get<std::string>());
    } else if (v->is_array()) {
      if (v->size() > kMaxStopStrings)
        return invalid_request("'stop' may hold at most " + std::to_string(kMaxStopStrings) + " strings", "stop");
      for (size_t k = 0; k < v->size(); ++k) {
        if (!(*v)[k].is_string()) return wrong_type("stop[" + std::to_string(k) + "]", "a string", (*v)[k]);
        if (!(*v)[k].get<std::string>().empty()) out.stop.push_back((*v)[k].get<std::string>());
      }
    } else {
      return wrong_type("stop", "a string or an array of strings", *v);
    }
  }
  M3_TRY(get_token_ids(body, "stop_token_ids", false, s.stop_token_ids));
  M3_TRY(get_bool(body, "ignore_eos", s.ignore_eos));
  // vLLM's: only these ids may be sampled; the route checks them against the vocabulary.
  M3_TRY(get_token_ids(body, "allowed_token_ids", true, s.allowed_token_ids));
  M3_TRY(get_bool(body, "include_stop_str_in_output", out.include_stop_str_in_output));
  i.reset();
  M3_TRY(get_int(body, "prompt_logprobs", i));  // vLLM's: each prompt token's logprob and the top N
  if (i) {
    if (*i < 0 || *i > kMaxTopLogprobs)
      return invalid_request("'prompt_logprobs' must be between 0 and " + std::to_string(kMaxTopLogprobs),
                             "prompt_logprobs");
    out.prompt_logprobs = int(*i);
  }
  i.reset();
  M3_TRY(get_int(body, "min_tokens", i));  // vLLM's: no EOS, stop id or stop string before this many
  if (i) {
    if (*i < 0 || *i > INT32_MAX) return invalid_request("'min_tokens' must be a non-negative integer", "min_tokens");
    s.min_tokens = int(*i);
  }
  // Constraints the engine cannot honour are refused rather than silently ignored.
  if (const OrderedJson* v = member(body, "logit_bias")) {
    // {"<token id>": bias in [-100, 100]}; the ids are checked against the vocabulary by the route.
    if (!v->is_object()) return wrong_type("logit_bias", "an object mapping token ids to numbers", *v);
    if (v->size() > size_t(kMaxLogitBias))
      return invalid_request("'logit_bias' may hold at most " + std::to_string(kMaxLogitBias) + " tokens", "logit_bias");
    for (auto it = v->begin(); it != v->end(); ++it) {
      const std::string& key = it.key();
      const bool digits = !key.empty() && key.size() <= 10 &&
                          key.find_first_not_of("0123456789") == std::string::npos && std::stoll(key) <= INT32_MAX;
      if (!digits)
        return invalid_request("'logit_bias' keys must be token ids (non-negative integers), got '" + key + "'",
                               "logit_bias");
      if (!it.value().is_number())
        return wrong_type("logit_bias[\"" + key + "\"]", "a number", it.value());
      const double bias = it.value().get<double>();
      if (!(bias >= -100.0 && bias <= 100.0))
        return invalid_request("'logit_bias[\"" + key + "\"]' must be in [-100, 100]", "logit_bias");
      s.logit_bias.emplace_back(int32_t(std::stoll(key)), float(bias));
    }
  }
  M3_TRY(parse_structured_output(body, out));
  i.reset();
  M3_TRY(get_int(body, "truncate_prompt_tokens", i));  // vLLM's: keep the prompt's last N tokens
  if (i) {
    if (*i < -1 || *i == 0 || *i > INT32_MAX)
      return invalid_request("'truncate_prompt_tokens' must be a positive integer or -1 (the model's context length)",
                             "truncate_prompt_tokens");
    out.truncate_prompt_tokens = int(*i);
  }
  if (const OrderedJson* v = member(body, "request_id")) {
    if (!v->is_string() || v->get<std::string>().empty() || v->get<std::string>().size() > 256)
      return invalid_request("'request_id' must be a non-empty string of at most 256 bytes", "request_id");
    out.request_id = v->get<std::string>();
  }
  M3_TRY(get_bool(body, "return_token_ids", out.return_token_ids));
  if (const OrderedJson* v = member(body, "kv_transfer_params"); v && !v->is_null()) {
    if (!v->is_object()) return wrong_type("kv_transfer_params", "an object", *v);
    CommonRequest::KvTransferParams kv;
    M3_TRY(get_bool(*v, "do_remote_decode", kv.do_remote_decode));
    M3_TRY(get_bool(*v, "do_remote_prefill", kv.do_remote_prefill));
    for (const char* key : {"remote_url", "transfer_id"}) {
      if (const OrderedJson* f = member(*v, key); f && !f->is_null()) {
        if (!f->is_string() || f->get<std::string>().empty() || f->get<std::string>().size() > 1024)
          return invalid_request(std::string("'kv_transfer_params.") + key + "' must be a non-empty string",
                                 "kv_transfer_params");
        (std::string(key) == "remote_url" ? kv.remote_url : kv.transfer_id) = f->get<std::string>();
      }
    }
    if (kv.do_remote_decode && kv.do_remote_prefill)
      return invalid_request("'kv_transfer_params' may ask for do_remote_decode or do_remote_prefill, not both",
                             "kv_transfer_params");
    if (kv.do_remote_prefill && (kv.remote_url.empty() || kv.transfer_id.empty()))
      return invalid_request("'kv_transfer_params.do_remote_prefill' needs 'remote_url' and 'transfer_id' (the prefill "
                             "server's answer)",
                             "kv_transfer_params");
    out.kv_transfer = std::move(kv);
  }
  i.reset();
  M3_TRY(get_int(body, "priority", i));  // vLLM's: lower is sooner, with --scheduling-policy priority
  if (i) {
    if (*i < INT32_MIN || *i > INT32_MAX) return invalid_request("'priority' is out of range", "priority");
    out.priority = int32_t(*i);
  }
  if (const OrderedJson* v = member(body, "bad_words")) {
    if (!v->is_array()) return wrong_type("bad_words", "an array of strings", *v);
    if (v->size() > kMaxBadWords)
      return invalid_request("'bad_words' may hold at most " + std::to_string(kMaxBadWords) + " strings", "bad_words");
    for (size_t k = 0; k < v->size(); ++k) {
      if (!(*v)[k].is_string()) return wrong_type("bad_words[" + std::to_string(k) + "]", "a string", (*v)[k]);
      const std::string w = (*v)[k].get<std::string>();
      if (w.find_first_not_of(" ") == std::string::npos)
        return invalid_request("'bad_words[" + std::to_string(k) + "]' must hold a word", "bad_words");
      out.bad_words.push_back(w);
    }
  }
  if (member(body, "use_beam_search")) {
    bool beam = false;
    M3_TRY(get_bool(body, "use_beam_search", beam));
    if (beam) return invalid_request("'use_beam_search' is not supported", "use_beam_search");
  }
  i.reset();
  M3_TRY(get_int(body, "best_of", i));
  if (i && *i != out.n && *i != 1) return invalid_request("'best_of' is not supported", "best_of");
  M3_TRY(get_bool(body, "stream", out.stream));
  if (const OrderedJson* v = member(body, "stream_options")) {
    if (!v->is_object()) return wrong_type("stream_options", "an object", *v);
    if (!out.stream) return invalid_request("'stream_options' is only allowed when 'stream' is true", "stream_options");
    if (const OrderedJson* iu = member(*v, "include_usage")) {
      if (!iu->is_boolean()) return wrong_type("stream_options.include_usage", "a boolean", *iu);
      out.include_usage = iu->get<bool>();
    }
    if (const OrderedJson* cu = member(*v, "continuous_usage_stats")) {
      if (!cu->is_boolean()) return wrong_type("stream_options.continuous_usage_stats", "a boolean", *cu);
      out.continuous_usage = out.include_usage && cu->get<bool>();
    }
  }
  if (chat) {
    bool logprobs = false;
    M3_TRY(get_bool(body, "logprobs", logprobs));
    i.reset();
    M3_TRY(get_int(body, "top_logprobs", i));
    if (i) {
      if (*i < 0 || *i > kMaxTopLogprobs)
        return invalid_request("'top_logprobs' must be between 0 and " + std::to_string(kMaxTopLogprobs), "top_logprobs");
      if (!logprobs) return invalid_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs");
    }
    if (logprobs) out.logprobs = i ? int(*i) : 0;
  } else {
    i.reset();
    M3_TRY(get_int(body, "logprobs", i));
    if (i) {
      if (*i < 0 || *i > kMaxTopLogprobs)
        return invalid_request("'logprobs' must be between 0 and " + std::to_string(kMaxTopLogprobs), "logprobs");
      out.logprobs = int(*i);
    }
  }
  return std::nullopt;
}

const char* const kRoles[] = {"root", "system", "developer", "user", "assistant", "tool"};

std::optional<ApiError> check_messages(const OrderedJson& messages) {
  if (!messages.is_array()) return wrong_type("messages", "an array", messages);
  if (messages.empty()) return invalid_request("'messages' must contain at least one message", "messages");
  for (size_t k = 0; k < messages.size(); ++k) {
    const std::string where = "messages[" + std::to_string(k) + "]";
    const auto& m = messages[k];
    if (!m.is_object()) return wrong_type(where, "an object", m);
    auto role = m.find("role");
    if (role == m.end()) return invalid_request("'" + where + ".role' is required", where + ".role");
    if (!role->is_string()) return wrong_type(where + ".role", "a string", *role);
    bool known = false;
    for (const char* r : kRoles) known = known || *role == r;
    if (!known)
      return invalid_request("'" + where + ".role' is '" + role->get<std::string>() +
                                 "'; expected one of system, developer, user, assistant, tool",
                             where + ".role");
    auto content = m.find("content");
    if (content != m.end() && !content->is_null() && !content->is_string() && !content->is_array())
      return wrong_type(where + ".content", "a string or an array of content parts", *content);
  }
  return std::nullopt;
}

}  // namespace

OrderedJson ApiError::to_json() const {
  OrderedJson err = OrderedJson::object();
  err["message"] = message;
  err["type"] = type;
  err["param"] = param.empty() ? OrderedJson() : OrderedJson(param);
  err["code"] = code.empty() ? OrderedJson(http_status) : OrderedJson(code);
  return OrderedJson{{"error", err}};
}

std::string dump_json(const OrderedJson& value) {
  return value.dump(-1, ' ', false, OrderedJson::error_handler_t::replace);
}

std::optional<ApiError> validate_tools(const OrderedJson& tools) {
  if (tools.is_null()) return std::nullopt;
  if (!tools.is_array()) return wrong_type("tools", "an array", tools);
  for (size_t k = 0; k < tools.size(); ++k) {
    const std::string where = "tools[" + std::to_string(k) + "]";
    const auto& t = tools[k];
    if (!t.is_object()) return wrong_type(where, "an object", t);
    auto type = t.find("type");
    if (type == t.end() || *type != "function")
      return invalid_request("'" + where + ".type' must be \"function\"", where + ".type");
    auto fn = t.find("function");
    if (fn == t.end() || !fn->is_object())
      return invalid_request("'" + where + ".function' must be an object", where + ".function");
    auto name = fn->find("name");
    if (name == fn->end() || !name->is_string() || name->get<std::string>().empty())
      return invalid_request("'" + where + ".function.name' must be a non-empty string", where + ".function.name");
    auto params = fn->find("parameters");
    if (params != fn->end() && !params->is_null()) {
      if (!params->is_object())
        return invalid_request("'" + where + ".function.parameters' must be a JSON Schema object",
                               where + ".function.parameters");
      auto ptype = params->find("type");
      if (ptype != params->end() && !ptype->is_string() && !ptype->is_array())
        return invalid_request("'" + where + ".function.parameters.type' must be a string",
                               where + ".function.parameters");
      auto props = params->find("properties");
      if (props != params->end() && !props->is_object())
        return invalid_request("'" + where + ".function.parameters.properties' must be an object",
                               where + ".function.parameters");
    }
  }
  return std::nullopt;
}

namespace {

// The fields each endpoint reads, and those that change nothing here (OpenAI bookkeeping, vLLM
// detokenizer options whose defaults this server follows); anything else is reported as ignored.
const char* const kCommonFields[] = {
    "model", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logit_bias", "allowed_token_ids",
    "include_stop_str_in_output", "min_tokens", "prompt_logprobs", "response_format", "best_of", "stream", "stream_options",
    "guided_json", "guided_regex", "guided_choice", "structured_outputs", "guided_decoding_backend",
    "truncate_prompt_tokens", "bad_words", "use_beam_search",
    "logprobs", "user", "metadata", "store", "service_tier", "request_id", "priority", "skip_special_tokens",
    "spaces_between_special_tokens", "return_token_ids", "kv_transfer_params"};
const char* const kCompletionFields[] = {"prompt", "echo", "suffix"};
const char* const kChatFields[] = {"messages", "tools", "tool_choice", "chat_template_kwargs", "add_generation_prompt",
                                   "max_completion_tokens", "top_logprobs", "parallel_tool_calls",
                                   "continue_final_message"};

template <size_t N>
bool listed(const std::string& key, const char* const (&fields)[N]) {
  for (const char* f : fields)
    if (key == f) return true;
  return false;
}

void note_ignored(const OrderedJson& body, bool chat, CommonRequest& out) {
  for (auto it = body.begin(); it != body.end(); ++it) {
    const std::string& key = it.key();
    if (!listed(key, kCommonFields) && !(chat ? listed(key, kChatFields) : listed(key, kCompletionFields)))
      out.ignored_fields.push_back(key);
  }
}

}  // namespace

std::optional<ApiError> parse_completion_request(const OrderedJson& body, CompletionRequest& out) {
  if (!body.is_object()) return invalid_request("the request body must be a JSON object");
  M3_TRY(parse_common(body, false, out.common));
  note_ignored(body, false, out.common);
  const OrderedJson* p = member(body, "prompt");
  if (!p) return invalid_request("'prompt' is required", "prompt");
  auto as_ids = [](const OrderedJson& arr, std::vector<int32_t>& ids) {
    for (const auto& t : arr) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX) return false;
      ids.push_back(int32_t(t.get<int64_t>()));
    }
    return true;
  };
  if (p->is_string()) {
    out.prompts.emplace_back(p->get<std::string>());
  } else if (p->is_array() && !p->empty() && (*p)[0].is_number()) {
    std::vector<int32_t> ids;
    if (!as_ids(*p, ids)) return invalid_request("'prompt' token ids must be non-negative integers", "prompt");
    out.prompts.emplace_back(std::move(ids));
  } else if (p->is_array() && !p->empty()) {
    for (size_t k = 0; k < p->size(); ++k) {
      const auto& item = (*p)[k];
      if (item.is_string()) {
        out.prompts.emplace_back(item.get<std::string>());
      } else if (item.is_array()) {
        std::vector<int32_t> ids;
        if (!as_ids(item, ids))
          return invalid_request("'prompt[" + std::to_string(k) + "]' token ids must be non-negative integers", "prompt");
        out.prompts.emplace_back(std::move(ids));
      } else {
        return wrong_type("prompt[" + std::to_string(k) + "]", "a string or an array of token ids", item);
      }
    }
  } else {
    return invalid_request("'prompt' must be a string, an array of strings or an array of token ids", "prompt");
  }
  M3_TRY(get_bool(body, "echo", out.echo));
  if (const OrderedJson* v = member(body, "suffix"); v && !(v->is_string() && v->get<std::string>().empty()))
    return invalid_request("'suffix' is not supported", "suffix");
  return std::nullopt;
}

std::optional<ApiError> parse_chat_request(const OrderedJson& body, ChatRequest& out) {
  if (!body.is_object()) return invalid_request("the request body must be a JSON object");
  M3_TRY(parse_common(body, true, out.common));
  note_ignored(body, true, out.common);
  const OrderedJson* messages = member(body, "messages");
  if (!messages) return invalid_request("'messages' is required", "messages");
  M3_TRY(check_messages(*messages));
  out.messages = *messages;
  // An assistant turn's reasoning under vLLM's current name feeds the template's reasoning_content.
  for (auto& m : out.messages) {
    auto r = m.find("reasoning");
    if (r != m.end() && r->is_string() && !m.contains("reasoning_content")) m["reasoning_content"] = *r;
  }
  if (const OrderedJson* tools = member(body, "tools")) {
    M3_TRY(validate_tools(*tools));
    if (!tools->empty()) out.tools = *tools;
  }
  if (const OrderedJson* tc = member(body, "tool_choice")) {
    if (tc->is_string()) {
      const std::string v = tc->get<std::string>();
      if (v == "auto") out.tool_choice = ToolChoice::kAuto;
      else if (v == "none") out.tool_choice = ToolChoice::kNone;
      else if (v == "required") out.tool_choice = ToolChoice::kRequired;
      else return invalid_request("'tool_choice' must be \"auto\", \"none\", \"required\" or a function object", "tool_choice");
    } else if (tc->is_object()) {
      auto fn = tc->find("function");
      if (fn == tc->end() || !fn->is_object() || !fn->contains("name") || !(*fn)["name"].is_string())
        return invalid_request("'tool_choice.function.name' must be a string", "tool_choice");
      out.tool_choice = ToolChoice::kNamed;
      out.tool_choice_name = (*fn)["name"].get<std::string>();
    } else {
      return wrong_type("tool_choice", "a string or an object", *tc);
    }
    if (out.tool_choice != ToolChoice::kNone && out.tool_choice != ToolChoice::kAuto && out.tools.is_null())
      return invalid_request("'tool_choice' requires 'tools'", "tool_choice");
    if (out.tool_choice == ToolChoice::kNamed) {
      bool found = false;
      for (const auto& t : out.tools) found = found || t["function"]["name"] == out.tool_choice_name;
      if (!found)
        return invalid_request("'tool_choice' names function '" + out.tool_choice_name + "', which is not in 'tools'",
                               "tool_choice");
    }
    // required / named: the output must be a call (of that function), enforced like guided_regex.
    if (out.tool_choice == ToolChoice::kRequired || out.tool_choice == ToolChoice::kNamed) {
      if (out.common.pattern || out.common.json_object)
        return invalid_request("'tool_choice' \"required\" or a named function cannot be combined with another output "
                               "constraint (response_format, guided_*, structured_outputs)", "tool_choice");
      auto pattern = tool_call_pattern(out.tools, out.tool_choice == ToolChoice::kNamed
                                                      ? std::optional<std::string>(out.tool_choice_name)
                                                      : std::nullopt);
      if (!pattern.is_ok()) return invalid_request("'tool_choice': " + pattern.error(), "tool_choice");
      auto nfa = RegexNfa::compile(*pattern);
      if (!nfa.is_ok()) return invalid_request("'tool_choice': the tools' call syntax: " + nfa.error(), "tool_choice");
      out.common.pattern = *nfa;
    }
  }
  if (const OrderedJson* kw = member(body, "chat_template_kwargs")) {
    if (!kw->is_object()) return wrong_type("chat_template_kwargs", "an object", *kw);
    if (const OrderedJson* tm = member(*kw, "thinking_mode")) {
      if (!tm->is_string()) return wrong_type("chat_template_kwargs.thinking_mode", "a string", *tm);
      auto mode = parse_thinking_mode(tm->get<std::string>());
      if (!mode)
        return invalid_request("'chat_template_kwargs.thinking_mode' must be \"enabled\", \"disabled\" or \"adaptive\"",
                               "chat_template_kwargs.thinking_mode");
      out.thinking_mode = *mode;
    } else if (const OrderedJson* et = member(*kw, "enable_thinking")) {
      if (!et->is_boolean()) return wrong_type("chat_template_kwargs.enable_thinking", "a boolean", *et);
      out.thinking_mode = et->get<bool>() ? ThinkingMode::kEnabled : ThinkingMode::kDisabled;
    }
    if (const OrderedJson* mi = member(*kw, "model_identity")) {
      if (!mi->is_string()) return wrong_type("chat_template_kwargs.model_identity", "a string", *mi);
      out.model_identity = mi->get<std::string>();
    }
    // The M3 template reads no other variable: anything else would change nothing, so say so.
    for (auto it = kw->begin(); it != kw->end(); ++it)
      if (it.key() != "thinking_mode" && it.key() != "enable_thinking" && it.key() != "model_identity")
        out.common.ignored_fields.push_back("chat_template_kwargs." + it.key());
  }
  M3_TRY(get_bool(body, "parallel_tool_calls", out.parallel_tool_calls));
  M3_TRY(get_bool(body, "continue_final_message", out.continue_final_message));
  // Continuing the last message implies no new turn; asking for both is a contradiction (as in vLLM).
  if (out.continue_final_message) out.add_generation_prompt = false;
  M3_TRY(get_bool(body, "add_generation_prompt", out.add_generation_prompt));
  if (out.continue_final_message) {
    if (out.add_generation_prompt)
      return invalid_request("'continue_final_message' and 'add_generation_prompt' cannot both be true",
                             "continue_final_message");
    const OrderedJson& last = out.messages.back();
    if (last.value("role", "") != "assistant" || (last.contains("tool_calls") && !last["tool_calls"].is_null() &&
                                                  !last["tool_calls"].empty()))
      return invalid_request("'continue_final_message' needs the last message to be an assistant message without "
                             "tool calls", "messages");
    if (out.common.pattern || out.common.json_object)
      return invalid_request("'continue_final_message' cannot be combined with an output constraint (response_format, "
                             "guided_*, structured_outputs, tool_choice \"required\" or named)", "continue_final_message");
  }
  return std::nullopt;
}

}  // namespace m3::server
