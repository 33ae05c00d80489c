#pragma once
// The public engine API: submit token-id requests, step the engine, read per-request
// outputs and per-step stats, abort. Everything else in m3serve is private.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "disagg/kv_blocks.h"
#include "exec/ngram_proposer.h"
#include "exec/sampler.h"
#include "ops/dispatch.h"
#include "ops/ops.h"
#include "sched/request.h"
#include "sched/schedule_plan.h"

namespace m3 {

struct EngineConfig {
  std::string model_dir;
  int32_t max_num_batched_tokens = 2048;  // token budget per step (chunked prefill beyond it)
  int32_t max_num_seqs = 64;
  int32_t max_model_len = 0;              // 0 = the model's max_position_embeddings, capped by the pool
  int32_t num_kv_blocks = 0;              // 0 = derived from kv_cache_memory_bytes
  int64_t kv_cache_memory_bytes = int64_t(1) << 30;
  // Host-memory KV tier (vLLM's --kv-offloading-size): blocks evicted from the KV cache are kept
  // in this many bytes of host memory and copied back on a prefix hit instead of recomputed.
  // 0 = off; needs prefix caching.
  int64_t kv_offload_bytes = 0;
  bool enable_prefix_caching = true;
  uint64_t prefix_hash_seed = 0;          // same on every process that shares KV
  bool trace_dispatch = false;            // log first use of each (op, kernel, shape class)
  bool check_invariants = false;          // run the KV/scheduler invariant checker every step (tests)
  // Kernels whose per-token results do not depend on batching or chunking: prefix hits and
  // chunked prefill give bit-identical logits to a cold single-sequence run.
  bool batch_invariant = true;
  std::function<void(size_t done_bytes, size_t total_bytes)> on_load_progress;  // weight loading progress
  // "auto": CUDA when this build has it and a GPU is present, else the CPU; "cpu"; "cuda".
  std::string device = "auto";
  int32_t device_id = 0;
  // Decode steps replay a CUDA graph captured per batch-size bucket (--enforce-eager: off).
  bool cuda_graphs = true;
  // CUDA: MXFP8 linears stay fp8 + e8m0 in device memory (kernels dequantise in registers);
  // true dequantises them to BF16 at load (exact, twice the bytes).
  bool dequantize_mxfp8 = false;
  // KV cache element type (K, V, and the MSA index keys unless index_cache_dtype says
  // otherwise): "auto" (bf16 on CUDA, f32 on the CPU), "f32" or "bf16" (rounded to nearest even
  // when written).
  std::string kv_cache_dtype = "auto";
  // Element type of the MSA index-key cache: "auto" (the KV cache's), "f32", "bf16", or "fp8"
  // (e4m3, rounded to nearest even and saturated at +-448 when written). fp8 halves the bytes the
  // indexer scans per cached token against bf16; with 3 mantissa bits its block scores are
  // coarser, so a selection can differ from a bf16 cache's where two blocks score close.
  std::string index_cache_dtype = "auto";
  // "fcfs" (arrival order) or "priority" (GenerationRequest::priority, lower first; vLLM's).
  std::string scheduling_policy = "fcfs";
  // vLLM's --long-prefill-token-threshold: most tokens one request's prefill takes per step
  // (0: the whole budget), so long prompts leave room for other requests' decode steps.
  int32_t long_prefill_token_threshold = 0;
  // vLLM's --seed: requests without a seed draw theirs from a stream seeded with it, so a run
  // repeats given the same requests in the same order. Unset: from the OS's randomness.
  std::optional<uint64_t> seed;
  // Speculative decoding (vLLM's --speculative-config): "" (off), "ngram" (prompt lookup,
  // configured by `ngram`) or "eagle3" (the EAGLE-3 draft model in `speculative_model`, which
  // reads the target's hidden states; `ngram`'s num_speculative_tokens and
  // disable_by_batch_size apply to it too). Each decoding request's draft is verified in the
  // next step, the drafts kept up to the first disagreement with the model's own sample: the
  // output is the one decoding without drafts gives (token for token where the kernels are
  // batch-invariant).
  std::string speculative_method;
  NgramConfig ngram;
  std::string speculative_model;  // eagle3: the draft checkpoint's directory
  // Verification steps replay a CUDA graph per (batch bucket, 1 + num_speculative_tokens): every
  // decoding request then verifies a full-length draft (short ones filled with repeats of their
  // last token). Off by default: it verifies more tokens per step, which pays only where a step is
  // bound by weight reads (GPU, small batches).
  bool spec_cuda_graphs = false;
  // MSA index sharing (the seeds' "index reuse across layers"): groups of this many consecutive
  // sparse layers take the first one's block selection; the others skip their indexer and keep
  // no index keys. Changes the model's output (an approximation); 1 = off, the model as trained.
  int32_t msa_index_reuse = 1;
  // Tensor parallelism (vLLM's --tensor-parallel-size): the model's heads and MLP / expert widths
  // split over this many ranks, each with its own slice of the weights and KV cache (threads of
  // this process; on the CPU their all-reduces go through host memory). 1 = off.
  int32_t tensor_parallel_size = 1;
  // Disaggregated prefill between engines of one host (M3CudaIpcConnector): this many bytes of
  // backend memory per rank hold exported pages (GenerationRequest::kv_export) until the decode
  // engine copies them out of it and releases them (release_kv_export); 0 = exports are copied
  // to host memory (KvBlocks::bytes). An export that does not fit goes to host memory too.
  int64_t kv_export_device_bytes = 0;
};

struct GenerationRequest {
  std::vector<int32_t> prompt_token_ids;
  SamplingParams sampling;
  int32_t priority = 0;  // only under the priority policy; must be 0 under fcfs
  // Disaggregated prefill, producer side: when the request finishes, the KV blocks of its prompt
  // (the full blocks a prefix hit may cover) are copied out into its final event's kv_export.
  bool kv_export = false;
};

struct TokenOutput {
  int32_t token = 0;
  float logprob = 0.0f;
  std::vector<TokenLogprob> top_logprobs;
};

// The logprob of prompt token `position` (>= 1) given the tokens before it.
struct PromptLogprob {
  int32_t position = 0;
  int32_t token = 0;
  float logprob = 0.0f;
  int32_t rank = 0;  // 1 + the number of ids with a larger logprob
  std::vector<TokenLogprob> top;
};

struct RequestEvent {
  RequestId request_id = 0;
  // SamplingParams::prompt_logprobs: the prompt positions computed this step, ascending (they
  // come before any new token, and each position once, preemptions included).
  std::vector<PromptLogprob> prompt_logprobs;
  std::vector<TokenOutput> new_tokens;
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  int32_t num_prompt_tokens = 0;
  int32_t num_cached_prompt_tokens = 0;  // prefix-cache hit at (first) admission
  // The final event of a GenerationRequest::kv_export request: its prompt's KV blocks (null on
  // other events; no blocks when prefix caching kept none).
  std::shared_ptr<const KvBlocks> kv_export;
};

// What Engine::import_kv did with a transfer's blocks (in prompt order).
struct KvImportResult {
  int32_t offered = 0;   // blocks in the transfer
  int32_t on_device = 0; // leading blocks the KV cache already holds (nothing to write)
  int32_t present = 0;   // blocks the host tier already holds
  int32_t imported = 0;  // written into host-tier slots
  int32_t dropped = 0;   // not kept: past the prompt's own blocks, the host tier's size, or no free slot
};

struct EngineStepStats {
  StepStats scheduler;                    // scheduled tokens, running/waiting, preemptions, KV use, prefix hits
  std::vector<std::string> kernel_paths;  // "op=entry" for every kernel this step ran
  double step_ms = 0.0;
  double forward_ms = 0.0;
  double draft_ms = 0.0;     // EAGLE-3: the draft model's passes after the step (host wall time)
  int32_t graph_batch = 0;       // > 0: this step replayed (or captured) the graph of that batch bucket
  bool sampled_on_device = false;  // every row sampled by the backend's sample op
  std::vector<RequestId> admitted;  // requests admitted this step (first time, or again after a preemption)
  // Speculative decoding (vLLM's spec_decode counters): requests that verified a draft, draft
  // tokens verified, drafts accepted, and accepted drafts by their position in the draft.
  int32_t spec_num_drafts = 0;
  int32_t spec_num_draft_tokens = 0;
  int32_t spec_num_accepted_tokens = 0;
  std::vector<int32_t> spec_accepted_per_pos;
};

struct ModelSummary {
  int64_t vocab_size = 0;
  int32_t max_model_len = 0;
  int32_t block_size = 0;
  int32_t num_kv_blocks = 0;
  int32_t num_host_kv_blocks = 0;  // host KV tier slots (kv_offload_bytes / bytes per block)
  std::vector<int32_t> eos_token_ids;
  int32_t bos_token_id = 0;
  std::string device;            // the runtime, e.g. "cuda:0 NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)"
  size_t weight_bytes = 0;       // model weights in device memory (all ranks together)
  int32_t tensor_parallel_size = 1;
  std::string kv_cache_dtype;     // as resolved: "f32" or "bf16"
  std::string index_cache_dtype;  // as resolved: "f32", "bf16" or "fp8"
  std::string scheduling_policy;  // "fcfs" or "priority"
  bool enable_prefix_caching = true;
  std::string speculative_method;     // "" = off, "ngram", "eagle3"
  int32_t num_speculative_tokens = 0;
  std::string speculative_model;      // eagle3: the draft's directory
  size_t draft_weight_bytes = 0;      // eagle3: the draft's weights (every rank holds them all)
  int32_t msa_index_reuse = 1;
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> create(const EngineConfig& config);
  virtual ~Engine() = default;

  // Rejects invalid sampling parameters, out-of-vocabulary ids, and prompts that could never
  // fit (max_model_len or the whole KV pool) with a message naming the problem.
  virtual Result<RequestId> submit(GenerationRequest request) = 0;
  // Frees the request's KV blocks immediately; its final event reports kAborted.
  virtual Status abort(RequestId request_id) = 0;
  // One scheduling + forward + sampling step. Returns the events it produced.
  virtual std::vector<RequestEvent> step(EngineStepStats* stats = nullptr) = 0;
  virtual bool has_unfinished_requests() const = 0;
  virtual const ModelSummary& model() const = 0;
  virtual const ops::DispatchStats& dispatch_stats() const = 0;
  // Every dispatch entry with its eligibility rule, in selection order (/debug/kernels).
  virtual std::vector<ops::EntryInfo> kernel_entries() const { return {}; }
  virtual Status check_invariants() const = 0;

  // Disaggregated prefill. The KV layout key (prefix-hash root inputs, page bytes, ranks, draft)
  // two engines must share to exchange KV blocks.
  virtual std::string kv_layout() const { return ""; }
  // Consumer side, between steps: writes the blocks of `prompt` that `blocks` carries into the
  // host KV tier, where the prompt's next submission finds them as a prefix hit (and loads them
  // into the KV cache instead of computing them). Refused with a message naming the mismatch when
  // the blocks come from an engine of another layout or are not this prompt's; needs the host
  // tier (kv_offload_bytes).
  // Blocks left in another engine's device memory (KvBlocks::on_device) are copied from it into
  // fresh KV cache blocks (no host tier needed); the engines must have the same tensor-parallel size.
  virtual Result<KvImportResult> import_kv(const std::vector<int32_t>& prompt, const KvBlocks& blocks) {
    (void)prompt;
    (void)blocks;
    return Status::error("this engine does not import KV blocks");
  }
  // Producer side: frees the device slots of an export on device (after the consumer copied it,
  // or when it expired). Thread-safe.
  virtual void release_kv_export(const std::vector<int32_t>& device_slots) { (void)device_slots; }
};

}  // namespace m3
