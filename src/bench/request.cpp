#include "bench/request.h"

#include <algorithm>

namespace m3::bench {

namespace {

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

std::string snippet(const std::string& s) {
  std::string out = s.substr(0, 300);
  std::replace(out.begin(), out.end(), '\n', ' ');
  return out;
}

void apply_chunk(const ResponseChunk& chunk, RequestOutcome& out) {
  if (chunk.has_usage) {
    if (chunk.usage.prompt_tokens >= 0) out.usage.prompt_tokens = chunk.usage.prompt_tokens;
    if (chunk.usage.completion_tokens >= 0) out.usage.completion_tokens = chunk.usage.completion_tokens;
    if (chunk.usage.cached_tokens >= 0) out.usage.cached_tokens = chunk.usage.cached_tokens;
  }
  if (!chunk.finish_reason.empty()) out.finish_reason = chunk.finish_reason;
}

// Transport error or non-200 status: recorded in `out`; true when the request failed.
bool record_http_failure(const Result<HttpResponse>& res, RequestOutcome& out) {
  if (!res) {
    out.error = res.error();
    return true;
  }
  if (res->status != 200) {
    out.error = "HTTP " + std::to_string(res->status);
    out.error_detail = snippet(res->body);
    return true;
  }
  return false;
}

}  // namespace

RequestOutcome send_request(HttpClient& client, const std::string& path, const RequestSpec& spec,
                            const RequestOptions& options, Clock::time_point run_start) {
  RequestOutcome out;
  out.prompt_len = spec.prompt_len;
  const std::string body = build_request_body(spec, options);
  const Clock::time_point sent = Clock::now();
  out.start_s = seconds_between(run_start, sent);

  if (!options.stream) {
    auto res = client.post_json(path, body);
    const Clock::time_point done = Clock::now();
    out.latency_s = out.ttft_s = seconds_between(sent, done);
    if (record_http_failure(res, out)) return out;
    auto chunk = parse_response_chunk(res->body, options.api);
    if (!chunk) {
      out.error = "malformed response";
      out.error_detail = chunk.error();
      return out;
    }
    if (!chunk->error.empty()) {
      out.error = "server error";
      out.error_detail = snippet(chunk->error);
      return out;
    }
    out.text = chunk->text;
    out.num_text_chunks = chunk->has_text ? 1 : 0;
    apply_chunk(*chunk, out);
    out.success = true;
    return out;
  }

  SseParser parser;
  Clock::time_point last_text;
  std::string stream_error;
  bool malformed = false;
  Clock::time_point now;
  auto on_event = [&](std::string_view data) {
    auto chunk = parse_response_chunk(data, options.api);
    if (!chunk) {
      malformed = true;
      if (stream_error.empty()) stream_error = chunk.error();
      return;
    }
    if (!chunk->error.empty() && stream_error.empty()) stream_error = chunk->error;
    if (chunk->has_text) {
      if (out.num_text_chunks == 0) {
        out.ttft_s = seconds_between(sent, now);
      } else {
        out.itl_s.push_back(seconds_between(last_text, now));
      }
      last_text = now;
      ++out.num_text_chunks;
      out.text += chunk->text;
    }
    apply_chunk(*chunk, out);
  };
  auto res = client.post_json_stream(path, body, [&](std::string_view bytes) {
    now = Clock::now();  // one timestamp per network read, shared by the events in it
    parser.feed(bytes, on_event);
    return true;
  });
  now = Clock::now();
  parser.finish(on_event);
  out.latency_s = seconds_between(sent, now);
  if (record_http_failure(res, out)) return out;
  if (!stream_error.empty()) {
    out.error = malformed ? "malformed stream chunk" : "server error in stream";
    out.error_detail = snippet(stream_error);
    return out;
  }
  if (out.num_text_chunks == 0 && out.usage.completion_tokens <= 0) {
    out.error = "no tokens received";
    return out;
  }
  out.success = true;
  return out;
}

}  // namespace m3::bench
