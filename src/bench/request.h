#pragma once
// Sends one OpenAI request and measures it: TTFT, inter-chunk latencies, end-to-end latency.
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "bench/http_client.h"
#include "bench/openai_stream.h"

namespace m3::bench {

using Clock = std::chrono::steady_clock;

struct RequestOutcome {
  bool success = false;
  std::string error;         // short reason; failures are grouped by it
  std::string error_detail;  // first part of the server's body, for the log
  double start_s = 0.0;      // when it was sent, seconds after the run started
  double ttft_s = 0.0;       // first chunk with text (non-streamed: whole latency)
  double latency_s = 0.0;    // end to end
  std::vector<double> itl_s;  // gaps between successive text chunks
  std::string text;
  std::string finish_reason;
  int64_t prompt_len = 0;      // client-side count of prompt tokens
  int64_t output_tokens = -1;  // filled by resolve_output_tokens()
  int64_t num_text_chunks = 0;
  Usage usage;                 // as the server reported it (-1 where absent)
};

RequestOutcome send_request(HttpClient& client, const std::string& path, const RequestSpec& spec,
                            const RequestOptions& options, Clock::time_point run_start);

}  // namespace m3::bench
