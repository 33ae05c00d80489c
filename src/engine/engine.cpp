// The engine: owns the model, the backend's KV storage, the scheduler and per-request
// samplers, and runs the step loop. It holds no scheduling or kernel logic of its own.
#include "m3serve/engine.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "core/hash128.h"

#include "backend/cpu/cpu_backend.h"
#include "model/minimax_m3/model.h"
#include "sched/scheduler.h"

namespace m3 {
namespace {

struct RequestState {
  std::vector<int32_t> prompt;
  std::vector<int32_t> output;
  SamplingParams sampling;
  std::unique_ptr<Sampler> sampler;
  int32_t num_cached_prompt_tokens = -1;  // set at first admission
};

class EngineImpl final : public Engine {
 public:
  EngineImpl(const EngineConfig& config, std::unique_ptr<MiniMaxM3Model> model, HostKvCache cache, Scheduler scheduler,
             ModelSummary summary)
      : config_(config),
        model_(std::move(model)),
        cache_(std::move(cache)),
        cache_views_(cache_.views()),
        scheduler_(std::move(scheduler)),
        summary_(std::move(summary)),
        stats_(config.trace_dispatch) {
    cpu::register_cpu_kernels(kernels_);
    ctx_ = ops::OpContext{&kernels_, &stats_, Device::kCpu, config.batch_invariant};
  }

  Result<RequestId> submit(GenerationRequest request) override {
    auto problems = request.sampling.validate();
    if (!problems.empty()) return Status::error(problems[0]);
    if (request.prompt_token_ids.empty()) return Status::error("prompt must contain at least one token");
    for (int32_t id : request.prompt_token_ids) {
      if (id < 0 || id >= summary_.vocab_size)
        return Status::error("prompt token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                             std::to_string(summary_.vocab_size) + ")");
    }
    const RequestId id = next_id_++;
    RequestSpec spec;
    spec.request_id = id;
    spec.prompt_token_ids = request.prompt_token_ids;
    spec.max_tokens = request.sampling.max_tokens;
    spec.stop_token_ids = request.sampling.stop_token_ids;
    if (!request.sampling.ignore_eos)
      spec.stop_token_ids.insert(spec.stop_token_ids.end(), summary_.eos_token_ids.begin(), summary_.eos_token_ids.end());
    Status st = scheduler_.submit(std::move(spec));
    if (!st.is_ok()) return st;
    RequestState state;
    state.prompt = std::move(request.prompt_token_ids);
    state.sampling = request.sampling;
    state.sampler = std::make_unique<Sampler>(request.sampling);
    requests_.emplace(id, std::move(state));
    return id;
  }

  Status abort(RequestId request_id) override {
    auto it = requests_.find(request_id);
    if (it == requests_.end()) return Status::error("unknown request " + std::to_string(request_id));
    Status st = scheduler_.abort(request_id);
    if (!st.is_ok()) return st;
    RequestEvent ev;
    ev.request_id = request_id;
    ev.finished = true;
    ev.finish_reason = FinishReason::kAborted;
    ev.num_prompt_tokens = int32_t(it->second.prompt.size());
    ev.num_cached_prompt_tokens = std::max(0, it->second.num_cached_prompt_tokens);
    pending_events_.push_back(std::move(ev));
    requests_.erase(it);
    return Status::ok();
  }

  std::vector<RequestEvent> step(EngineStepStats* out_stats) override {
    auto t0 = std::chrono::steady_clock::now();
    std::vector<RequestEvent> events = std::move(pending_events_);
    pending_events_.clear();
    SchedulePlan plan = scheduler_.schedule();
    EngineStepStats stats;
    stats.scheduler = plan.stats;
    if (!plan.empty()) run_plan(plan, events, stats);
    stats.kernel_paths = stats_.take_step_paths();
    stats.step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (out_stats) *out_stats = std::move(stats);
    return events;
  }

  bool has_unfinished_requests() const override { return scheduler_.has_unfinished_requests(); }
  const ModelSummary& model() const override { return summary_; }
  const ops::DispatchStats& dispatch_stats() const override { return stats_; }
  std::vector<ops::EntryInfo> kernel_entries() const override { return kernels_.describe(); }
  Status check_invariants() const override { return scheduler_.check_invariants(); }

 private:
  void run_plan(const SchedulePlan& plan, std::vector<RequestEvent>& events, EngineStepStats& stats) {
    // Flatten the plan into one ragged batch; every KV access goes through its page tables.
    std::vector<int32_t> tokens, positions = plan.positions(), query_start = plan.query_start_offsets();
    std::vector<int64_t> slots = plan.slot_mapping();
    std::vector<int32_t> seq_lens;
    size_t max_blocks = 1;
    for (const auto& s : plan.scheduled) max_blocks = std::max(max_blocks, s.block_table.size());
    std::vector<int32_t> tables(plan.scheduled.size() * max_blocks, 0);
    ForwardBatch batch;
    for (size_t i = 0; i < plan.scheduled.size(); ++i) {
      const auto& s = plan.scheduled[i];
      tokens.insert(tokens.end(), s.token_ids.begin(), s.token_ids.end());
      seq_lens.push_back(s.end_pos);
      std::copy(s.block_table.begin(), s.block_table.end(), tables.begin() + std::ptrdiff_t(i * max_blocks));
      if (s.samples) batch.logits_rows.push_back(query_start[i + 1] - 1);
      auto it = requests_.find(s.request_id);
      if (it != requests_.end() && s.is_new_admission && it->second.num_cached_prompt_tokens < 0)
        it->second.num_cached_prompt_tokens = s.num_prefix_hit_tokens;
    }
    batch.token_ids = tokens.data();
    auto& m = batch.meta;
    m.num_seqs = int(plan.scheduled.size());
    m.num_tokens = int(tokens.size());
    m.query_start = query_start.data();
    m.positions = positions.data();
    m.seq_lens = seq_lens.data();
    m.block_tables = tables.data();
    m.max_blocks_per_seq = int(max_blocks);
    m.block_size = plan.block_size_tokens;
    m.slot_mapping = slots.data();
    const int64_t vocab = summary_.vocab_size;
    std::vector<float> logits(batch.logits_rows.size() * size_t(vocab));
    auto tf = std::chrono::steady_clock::now();
    model_->forward(ctx_, batch, cache_views_, logits.data());
    stats.forward_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - tf).count();

    std::vector<SampledTokens> sampled;
    std::map<RequestId, SampleResult> results;
    size_t row = 0;
    for (const auto& s : plan.scheduled) {
      if (!s.samples) continue;
      float* lg = logits.data() + row++ * size_t(vocab);
      auto it = requests_.find(s.request_id);
      if (it == requests_.end()) continue;  // aborted while in flight
      RequestState& r = it->second;
      SampleResult res = r.sampler->sample(lg, vocab, r.prompt, r.output);
      sampled.push_back(SampledTokens{s.request_id, {res.token}, false});
      results[s.request_id] = std::move(res);
    }
    auto outputs = scheduler_.update(plan, sampled);
    if (!outputs) throw std::runtime_error("engine: scheduler rejected the step's results: " + outputs.error());
    for (const auto& out : *outputs) {
      auto it = requests_.find(out.request_id);
      if (it == requests_.end()) continue;
      RequestState& r = it->second;
      RequestEvent ev;
      ev.request_id = out.request_id;
      ev.num_prompt_tokens = int32_t(r.prompt.size());
      ev.num_cached_prompt_tokens = std::max(0, r.num_cached_prompt_tokens);
      for (int32_t tok : out.new_token_ids) {
        r.output.push_back(tok);
        TokenOutput to;
        to.token = tok;
        auto res = results.find(out.request_id);
        if (res != results.end() && res->second.token == tok) {
          to.logprob = res->second.logprob;
          to.top_logprobs = res->second.top;
        }
        ev.new_tokens.push_back(std::move(to));
      }
      ev.finished = out.finished;
      ev.finish_reason = out.finish_reason;
      if (out.finished) requests_.erase(it);
      events.push_back(std::move(ev));
    }
    if (config_.check_invariants) {
      Status st = scheduler_.check_invariants();
      if (!st.is_ok()) throw std::runtime_error("engine invariant violated: " + st.message());
    }
  }

  EngineConfig config_;
  std::unique_ptr<MiniMaxM3Model> model_;
  HostKvCache cache_;
  KvCacheTensors cache_views_;
  Scheduler scheduler_;
  ModelSummary summary_;
  ops::KernelTable kernels_;
  ops::DispatchStats stats_;
  ops::OpContext ctx_;
  std::map<RequestId, RequestState> requests_;
  std::vector<RequestEvent> pending_events_;
  RequestId next_id_ = 1;
};

std::string model_fingerprint(const std::string& model_dir) {
  std::ifstream in(model_dir + "/config.json", std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  uint64_t weight_bytes = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(model_dir, ec))
    if (entry.path().extension() == ".safetensors") weight_bytes += entry.file_size(ec);
  return hash128(text.str() + "/" + std::to_string(weight_bytes), 0).to_hex();
}

}  // namespace

Result<std::unique_ptr<Engine>> Engine::create(const EngineConfig& config) {
  LoadProgress progress;
  progress.on_progress = config.on_load_progress;
  auto model = MiniMaxM3Model::load(config.model_dir, progress);
  if (!model) return model.status();
  const MiniMaxM3Config& c = (*model)->config();
  const int32_t bs = c.index_block_size;
  // Bytes one KV page costs across all layers (K, V everywhere; index-K on sparse layers).
  int64_t page_bytes = 0;
  for (int l = 0; l < c.num_hidden_layers; ++l)
    page_bytes += int64_t(bs) * 4 * (2 * c.num_key_value_heads * c.head_dim + (c.is_sparse_layer(l) ? c.index_head_dim : 0));
  int32_t num_blocks = config.num_kv_blocks > 0 ? config.num_kv_blocks : int32_t(config.kv_cache_memory_bytes / page_bytes);
  if (num_blocks < 1) return Status::error("KV cache budget too small for one page (" + std::to_string(page_bytes) + " bytes)");
  int32_t max_len = config.max_model_len > 0 ? config.max_model_len
                                             : int32_t(std::min<int64_t>(c.max_position_embeddings, int64_t(num_blocks) * bs));
  if (max_len > c.max_position_embeddings)
    return Status::error("max_model_len " + std::to_string(max_len) + " exceeds the model's max_position_embeddings " +
                         std::to_string(c.max_position_embeddings));
  SchedulerConfig sc;
  sc.max_num_batched_tokens = config.max_num_batched_tokens;
  sc.max_num_seqs = config.max_num_seqs;
  sc.max_model_len = max_len;
  KvCacheConfig kc;
  kc.num_blocks = num_blocks;
  kc.block_size_tokens = bs;
  kc.enable_prefix_caching = config.enable_prefix_caching;
  kc.hash_seed = config.prefix_hash_seed;
  // The cache key covers what changes a cached block: the model's identity (its config.json
  // content and total weight bytes, not its path, so two processes serving the same checkpoint
  // agree) and the KV dtype. Block size and seed are in the hasher's root already.
  kc.hash_extra_keys = {"model=" + model_fingerprint(config.model_dir), "kv_dtype=f32"};
  auto scheduler = Scheduler::create(sc, kc);
  if (!scheduler) return scheduler.status();
  ModelSummary summary;
  summary.vocab_size = c.vocab_size;
  summary.max_model_len = max_len;
  summary.block_size = bs;
  summary.num_kv_blocks = num_blocks;
  summary.eos_token_ids = c.eos_token_ids;
  summary.bos_token_id = c.bos_token_id;
  HostKvCache cache = HostKvCache::allocate(c, num_blocks, bs);
  return std::unique_ptr<Engine>(new EngineImpl(config, std::move(*model), std::move(cache), std::move(*scheduler), summary));
}

}  // namespace m3
