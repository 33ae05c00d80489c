// The engine: owns the model, the backend's KV storage, the scheduler and per-request
// samplers, and runs the step loop. It holds no scheduling or kernel logic of its own.
#include "m3serve/engine.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <sstream>

#include "core/hash128.h"

#include "backend/cpu/cpu_backend.h"
#include "dist/in_process_group.h"
#include "dist/rank_threads.h"
#include "engine/captured_graphs.h"
#include "engine/eagle3_drafter.h"
#include "engine/step_buffers.h"
#include "model/eagle3/model.h"
#include "model/minimax_m3/model.h"
#include "ops/host_runtime.h"
#include "sched/scheduler.h"
#if M3_HAVE_CUDA_BACKEND
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/nccl_group.h"
#endif

namespace m3 {
namespace {

struct RequestState {
  std::vector<int32_t> prompt;
  std::vector<int32_t> output;
  SamplingParams sampling;
  std::unique_ptr<Sampler> sampler;
  uint64_t device_seed = 0;               // key of the on-device sampler's generator
  bool device_sampling = false;           // the backend's sample op can serve these params
  int32_t num_cached_prompt_tokens = -1;  // set at first admission
  int32_t prompt_logprobs_next = 1;       // the first prompt position whose logprob is still to come
  bool kv_export = false;                 // copy the prompt's KV blocks out when it finishes
};

// What the on-device sample op implements; everything else goes to the host Sampler.
bool device_samplable(const SamplingParams& p) {
  return p.repetition_penalty == 1.0f && p.presence_penalty == 0.0f && p.frequency_penalty == 0.0f &&
         p.top_p >= 1.0f && p.top_k <= 0 && p.min_p <= 0.0f && p.logprobs <= ops::kMaxTopLogprobs &&
         p.logit_bias.empty() && p.min_tokens == 0 && p.allowed_token_ids.empty() && p.bad_words.empty() &&
         !p.constraint;
}

// Decode batches are padded up to one of these sizes so a few graphs cover every batch.
int graph_bucket(int n, int max_seqs) {
  static const int kBuckets[] = {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512};
  for (int b : kBuckets)
    if (b >= n) return b <= max_seqs ? b : (n <= max_seqs ? max_seqs : 0);
  return 0;
}

// One tensor-parallel rank's part of the engine (the whole engine's at size 1): its runtime
// (device), its slice of the model, its KV pages (the scheduler's block ids index every rank's
// pool alike), activations, step buffers and captured graphs.
struct Rank {
  std::unique_ptr<ops::BackendRuntime> owned_runtime;  // declared first: outlives every buffer
  ops::BackendRuntime* rt = nullptr;
  std::unique_ptr<MiniMaxM3Model> model;
  BackendKvCache cache;
  ops::HostStaging host_kv;  // the host KV tier's slots, page_bytes each
  ops::DeviceBuffer kv_export;  // device slots of KV exports (kv_export_device_bytes), page_bytes each
  KvCacheTensors cache_views;
  std::unique_ptr<ops::Communicator> comm;
  ops::KernelTable kernels;
  ops::OpContext ctx;
  std::unique_ptr<ForwardWorkspace> ws;
  std::unique_ptr<StepBuffers> step;
  CapturedGraphs<std::pair<int, int>> graphs;  // (batch bucket, tokens per request) -> captured step
  DraftRank draft;  // EAGLE-3: this rank's draft (draft.model null without one)
};

class EngineImpl final : public Engine {
 public:
  EngineImpl(const EngineConfig& config, std::shared_ptr<void> group, std::vector<std::unique_ptr<Rank>> ranks,
             int64_t page_bytes, int64_t target_page_bytes, Scheduler scheduler, ModelSummary summary,
             std::string kv_layout)
      : config_(config),
        group_(std::move(group)),
        ranks_(std::move(ranks)),
        threads_(int(ranks_.size())),
        page_bytes_(page_bytes),
        target_page_bytes_(target_page_bytes),
        scheduler_(std::move(scheduler)),
        summary_(std::move(summary)),
        kv_layout_(std::move(kv_layout)),
        stats_(config.trace_dispatch) {
    const int max_tokens = config.max_num_batched_tokens, max_seqs = config.max_num_seqs;
    max_blocks_per_seq_ = (summary_.max_model_len + summary_.block_size - 1) / summary_.block_size;
    speculate_ = !config.speculative_method.empty() && config.ngram.num_speculative_tokens > 0;
    eagle3_ = config.speculative_method == "eagle3";
    // Logits rows: one per sequence, 1 + the draft length per speculating one (within the budget).
    const int max_rows =
        std::max(max_seqs, speculate_ ? std::min(max_tokens, max_seqs * (1 + config.ngram.num_speculative_tokens)) : 0);
    for (size_t r = 0; r < ranks_.size(); ++r) {
      Rank& k = *ranks_[r];
      k.rt->activate();  // a rank's buffers on its own device
#if M3_HAVE_CUDA_BACKEND
      if (k.rt->device() == Device::kCuda) cuda::register_cuda_kernels(k.kernels);
#endif
      cpu::register_cpu_kernels(k.kernels);
      // Rank 0's choices are the engine's dispatch trace; the others run the same entries.
      k.ctx = ops::OpContext{&k.kernels, r == 0 ? &stats_ : nullptr, k.rt->device(), config.batch_invariant, k.comm.get()};
      k.cache_views = k.cache.views(k.rt->device());
      k.ws = k.model->make_workspace(max_tokens, max_rows);
      k.step = std::make_unique<StepBuffers>(k.rt, max_tokens, max_seqs, max_rows, max_blocks_per_seq_);
      if (eagle3_) {
        DraftRank& d = k.draft;
        d.rt = k.rt;
        d.ctx = k.ctx;
        d.ws = d.model->make_workspace(max_tokens, max_seqs);
        d.step = std::make_unique<StepBuffers>(k.rt, max_tokens, max_seqs, max_seqs, max_blocks_per_seq_);
        for (int j = 1; j < config.ngram.num_speculative_tokens; ++j)
          d.chain.push_back(std::make_unique<StepBuffers>(k.rt, max_seqs, max_seqs, max_seqs, max_blocks_per_seq_));
        d.max_seqs = max_seqs;
        d.h_hidden_rows = ops::HostStaging(k.rt, size_t(2 * max_seqs) * 4);
        d.d_hidden_rows = ops::DeviceBuffer(k.rt, size_t(2 * max_seqs) * 4);
      }
    }
    // Exports left in device memory: every rank's slot s is the same block's page.
    const int64_t export_slots = config.kv_export_device_bytes / page_bytes_;
    if (config.kv_export_device_bytes > 0) {
      if (export_slots < 1)
        throw std::runtime_error("kv_export_device_bytes " + std::to_string(config.kv_export_device_bytes) +
                                 " holds no KV page (" + std::to_string(page_bytes_) + " bytes each)");
      for (auto& k : ranks_) {
        k->rt->activate();
        k->kv_export = ops::DeviceBuffer(k->rt, size_t(export_slots) * size_t(page_bytes_));
        std::string error;
        export_memory_.push_back(k->rt->export_memory(k->kv_export.data(), &error));
        if (export_memory_.back().empty()) throw std::runtime_error("KV export memory: " + error);
      }
      for (int64_t i = export_slots - 1; i >= 0; --i) export_free_.push_back(int32_t(i));
    }
    if (eagle3_) {
      std::vector<DraftRank*> drafts;
      for (auto& k : ranks_) drafts.push_back(&k->draft);
      // Chained draft passes replay graphs per batch bucket where the target's steps do.
      std::function<int(int)> bucket;
      if (config.cuda_graphs && ranks_[0]->rt->supports_graphs())
        bucket = [max_seqs](int n) { return graph_bucket(n, max_seqs); };
      drafter_ = std::make_unique<Eagle3Drafter>(std::move(drafts), block_size(), summary_.num_kv_blocks,
                                                 [this](const std::function<void(int)>& fn) { run_ranks(fn); },
                                                 std::move(bucket));
    }
    ranks_[0]->rt->activate();
  }

  Result<RequestId> submit(GenerationRequest request) override {
    auto problems = request.sampling.validate(summary_.vocab_size);
    if (!problems.empty()) return Status::error(problems[0]);
    if (request.prompt_token_ids.empty()) return Status::error("prompt must contain at least one token");
    for (int32_t id : request.prompt_token_ids) {
      if (id < 0 || id >= summary_.vocab_size)
        return Status::error("prompt token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                             std::to_string(summary_.vocab_size) + ")");
    }
    if (request.kv_export && !summary_.enable_prefix_caching)
      return Status::error("kv_export needs prefix caching (the exported blocks are the prompt's cached blocks)");
    if (request.priority != 0 && summary_.scheduling_policy != "priority")
      return Status::error("priority " + std::to_string(request.priority) +
                           " needs the priority scheduling policy (--scheduling-policy priority)");
    const RequestId id = next_id_++;
    RequestSpec spec;
    spec.request_id = id;
    spec.prompt_token_ids = request.prompt_token_ids;
    spec.max_tokens = request.sampling.max_tokens;
    spec.stop_token_ids = request.sampling.stop_token_ids;
    if (!request.sampling.ignore_eos)
      spec.stop_token_ids.insert(spec.stop_token_ids.end(), summary_.eos_token_ids.begin(), summary_.eos_token_ids.end());
    spec.skip_prefix_cache = request.sampling.prompt_logprobs >= 0;  // every position's logits
    spec.priority = request.priority;
    std::vector<int32_t> stop_ids = spec.stop_token_ids;  // what min_tokens bans
    Status st = scheduler_.submit(std::move(spec));
    if (!st.is_ok()) return st;
    // With --seed, an unseeded request takes the next seed of the engine's stream.
    if (request.sampling.seed < 0 && config_.seed) request.sampling.seed = int64_t(seed_source_() >> 1);
    RequestState state;
    state.prompt = std::move(request.prompt_token_ids);
    state.sampling = request.sampling;
    state.sampler = std::make_unique<Sampler>(request.sampling, std::move(stop_ids));
    state.device_sampling = ranks_[0]->rt->device() != Device::kCpu && device_samplable(request.sampling);
    state.device_seed = request.sampling.seed >= 0 ? uint64_t(request.sampling.seed) : seed_source_();
    state.kv_export = request.kv_export;
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
    for (const ScheduledRequest& e : plan.scheduled)
      if (e.is_new_admission) stats.admitted.push_back(e.request_id);
    if (!plan.empty()) run_plan(plan, events, stats);
    stats.kernel_paths = stats_.take_step_paths();
    stats.step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (out_stats) *out_stats = std::move(stats);
    return events;
  }

  bool has_unfinished_requests() const override { return scheduler_.has_unfinished_requests(); }
  const ModelSummary& model() const override { return summary_; }
  const ops::DispatchStats& dispatch_stats() const override { return stats_; }
  std::vector<ops::EntryInfo> kernel_entries() const override { return ranks_[0]->kernels.describe(); }
  Status check_invariants() const override { return scheduler_.check_invariants(); }
  std::string kv_layout() const override { return kv_layout_; }

  void release_kv_export(const std::vector<int32_t>& device_slots) override {
    std::lock_guard<std::mutex> lock(export_mu_);
    export_free_.insert(export_free_.end(), device_slots.begin(), device_slots.end());
  }

  Result<KvImportResult> import_kv(const std::vector<int32_t>& prompt, const KvBlocks& blocks) override {
    M3_RETURN_IF_ERROR(blocks.validate());
    if (blocks.on_device()) return import_kv_from_device(prompt, blocks);
    auto checked = transfer_hashes(prompt, blocks);
    if (!checked) return checked.status();
    if (summary_.num_host_kv_blocks == 0)
      return Status::error("importing KV blocks needs the host KV tier (kv_offload_bytes, --kv-offloading-size)");
    // Pages of another tensor-parallel size: each of this engine's ranks takes its KV heads from
    // the producer ranks' pages that hold them (the index keys are every rank's).
    auto heads = producer_heads(blocks);
    if (!heads) return heads.status();
    const std::vector<std::pair<int, int>>& src_heads = *heads;
    const DType kv_dtype = kv_cache_dtype(), index_dtype = index_cache_dtype();
    const KvCacheManager& kv = scheduler_.kv();
    const int32_t n = int32_t(checked->size());
    KvImportResult res;
    res.offered = blocks.num_blocks();
    const PrefixMatch on_device = kv.find_cached_prefix(prompt);
    res.on_device = std::min<int32_t>(n, int32_t(on_device.block_ids.size()));
    // A hit is the leading run of blocks on the device, then on the host tier: the blocks after
    // the device's run go to the tier, at most as many as it holds (each store evicts the least
    // recently used slot, so more would push out this transfer's own first blocks).
    const int32_t last = std::min(n, res.on_device + summary_.num_host_kv_blocks);
    int32_t i = res.on_device;
    for (; i < last; ++i) {
      const KvCacheManager::HostStore st = scheduler_.store_host_block(blocks.hashes[size_t(i)]);
      if (st.present) {
        ++res.present;
        continue;
      }
      if (st.slot < 0) break;
      for (size_t r = 0; r < ranks_.size(); ++r) {
        char* dst = ranks_[r]->host_kv.as<char>() + int64_t(st.slot) * page_bytes_;
        if (src_heads.empty()) {
          std::memcpy(dst, blocks.page(i, int32_t(r)), size_t(page_bytes_));
          continue;
        }
        const MiniMaxM3Config& c = ranks_[r]->model->config();
        for (size_t p = 0; p < src_heads.size(); ++p)
          BackendKvCache::copy_page_heads(c, block_size(), kv_dtype, index_dtype, blocks.page(i, int32_t(p)),
                                          src_heads[p].first, src_heads[p].second, dst, c.kv_head_offset,
                                          c.num_key_value_heads);
      }
      ++res.imported;
    }
    res.dropped = res.offered - res.on_device - res.present - res.imported;
    return res;
  }

 private:
  void run_plan(const SchedulePlan& plan, std::vector<RequestEvent>& events, EngineStepStats& stats) {
    // Flatten the plan into one ragged batch; every KV access goes through its page tables.
    // A step where every request decodes the same q tokens (1, or its last token + the same
    // number of drafts) can replay a CUDA graph of its batch bucket.
    const int n = int(plan.scheduled.size());
    int q = 0;
    bool uniform = true;
    for (const auto& s : plan.scheduled) {
      const int len = int(s.token_ids.size());
      uniform = uniform && s.samples && len == 1 + s.num_spec_tokens && (q == 0 || len == q);
      q = len;
    }
    const bool graphable = uniform && (q == 1 || config_.spec_cuda_graphs) && config_.cuda_graphs &&
                           ranks_[0]->rt->supports_graphs();
    const int bucket =
        graphable ? graph_bucket(n, std::min(config_.max_num_seqs, config_.max_num_batched_tokens / std::max(1, q))) : 0;
    // Batch rows: each sequence's tokens in plan order, then (graph steps) padding sequences of q
    // tokens whose logits rows are ignored.
    std::vector<int32_t> logits_rows, first_row(static_cast<size_t>(n), 0);  // each sequence's first batch row
    int32_t num_tokens = 0;
    for (int i = 0; i < n; ++i) {
      const auto& s = plan.scheduled[size_t(i)];
      first_row[size_t(i)] = num_tokens;
      num_tokens += int32_t(s.token_ids.size());
      if (s.samples)
        for (int32_t j = s.num_spec_tokens; j >= 0; --j) logits_rows.push_back(num_tokens - 1 - j);
      auto it = requests_.find(s.request_id);
      if (it != requests_.end() && s.is_new_admission && it->second.num_cached_prompt_tokens < 0)
        it->second.num_cached_prompt_tokens = s.num_prefix_hit_tokens;
    }
    for (int i = n; i < bucket; ++i) {
      num_tokens += q;
      for (int j = q - 1; j >= 0; --j) logits_rows.push_back(num_tokens - 1 - j);
    }

    // Sampling: rows the backend's sample op can serve are sampled where the logits are; the
    // rest (penalties, top-k/p, min-p) download their logits for the host Sampler. A request
    // verifying k drafts has k + 1 rows, row j sampled as output token output.size() + j.
    const int64_t vocab = summary_.vocab_size;
    const int rows = int(logits_rows.size());
    bool any_device = false, all_device = true;
    std::vector<ops::SampleRowParams> params(static_cast<size_t>(rows));
    {
      size_t row = 0;
      for (const auto& s : plan.scheduled) {
        if (!s.samples) continue;
        auto it = requests_.find(s.request_id);
        const RequestState* r = it == requests_.end() ? nullptr : &it->second;
        const bool d = r && r->device_sampling;
        any_device = any_device || d;
        all_device = all_device && (d || !r);
        for (int32_t j = 0; j <= s.num_spec_tokens; ++j, ++row) {
          if (!d) continue;
          params[row].temperature = r->sampling.temperature;
          params[row].top_n = std::max(0, r->sampling.logprobs);
          params[row].seed = r->device_seed;
          params[row].step = uint64_t(r->output.size()) + uint64_t(j);
        }
      }
    }

    // Every rank runs the same batch on its slice of the model; the ranks' all-reduces meet
    // inside the forward, so every rank ends with the same logits (rank 0's are sampled).
    auto tf = std::chrono::steady_clock::now();
    run_ranks([&](int r) {
      Rank& k = *ranks_[size_t(r)];
      k.rt->activate();
      // Host KV tier: evicted blocks out (their KV is intact until this step writes), then hits in.
      char* host = k.host_kv.as<char>();
      // (A page's draft K/V, EAGLE-3, follows the target's in the same host slot.)
      for (const KvTransfer& t : plan.kv_offloads) {
        k.cache.save_block(k.rt, t.device_block, host + t.host_slot * page_bytes_);
        if (eagle3_) k.draft.cache.save_block(k.rt, t.device_block, host + t.host_slot * page_bytes_ + target_page_bytes_);
      }
      for (const KvTransfer& t : plan.kv_loads) {
        k.cache.load_block(k.rt, t.device_block, host + t.host_slot * page_bytes_);
        if (eagle3_) k.draft.cache.load_block(k.rt, t.device_block, host + t.host_slot * page_bytes_ + target_page_bytes_);
      }
      StepBuffers& sb = *k.step;
      sb.begin();
      for (const auto& s : plan.scheduled)
        sb.add_sequence(s.token_ids, s.end_pos - int32_t(s.token_ids.size()), s.block_table, block_size());
      // Graph steps run a fixed batch: padding sequences of q tokens write no KV (slot -1) and
      // read positions 0.. of page 0.
      for (int i = n; i < bucket; ++i) sb.add_padding_sequence(q);
      sb.set_logits_rows(logits_rows);
      sb.upload();
      ForwardBatch batch;
      batch.logits_rows = logits_rows;
      batch.token_ids = sb.device_tokens();
      batch.meta = sb.metadata(block_size());
      batch.logits_rows_ptr = sb.device_logits_rows();
      if (eagle3_) {  // the draft's inputs: the residual stream entering its aux layers
        const auto& ids = k.draft.model->config().aux_layer_ids;
        for (size_t i = 0; i < ids.size(); ++i) batch.captures.emplace_back(ids[i], k.draft.ws->aux[i].data());
      }
      // (Rank 0's context carries the engine's dispatch counts; the others' none.)
      k.graphs.run(k.rt, k.ctx, bucket > 0, {bucket, q},
                   [&](const ops::OpContext& ctx) { k.model->forward(ctx, batch, k.cache_views, *k.ws); });
      if (r == 0 && any_device) sb.sample(k.ctx, k.ws->logits_view(rows, vocab), params);
      k.rt->synchronize();
    });
    if (bucket > 0) stats.graph_batch = bucket;
    stats.forward_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - tf).count();
    stats.sampled_on_device = any_device && all_device;
    Rank& r0 = *ranks_[0];
    StepBuffers& sb = *r0.step;

    std::vector<SampledTokens> sampled;
    std::map<RequestId, std::vector<SampleResult>> results;
    std::vector<float> host_logits;
    size_t row = 0;
    for (const auto& s : plan.scheduled) {
      if (!s.samples) continue;
      const size_t first = row;
      row += size_t(s.num_spec_tokens) + 1;
      auto it = requests_.find(s.request_id);
      if (it == requests_.end()) continue;  // aborted while in flight
      RequestState& r = it->second;
      // Drafts are kept while the model's sample at the position before agrees with them; the
      // first disagreeing sample is kept too. Sampling stops there, so the host sampler's
      // generator and a constraint's state advance exactly as without drafts.
      const int32_t k = s.num_spec_tokens;
      const int32_t* draft = s.token_ids.data() + (s.token_ids.size() - size_t(k));
      std::vector<int32_t> tokens;
      std::vector<SampleResult>& res_list = results[s.request_id];
      std::vector<int32_t> grown;  // the output with the accepted drafts (host penalties)
      if (k > 0 && !r.device_sampling) grown = r.output;
      for (int32_t j = 0; j <= k; ++j) {
        SampleResult res;
        if (r.device_sampling) {
          res = sb.sampled(int(first) + j, r.sampling.logprobs);
        } else {
          host_logits.resize(size_t(vocab));
          r0.rt->download(host_logits.data(), r0.ws->logits.as<float>() + (first + size_t(j)) * size_t(vocab),
                          size_t(vocab) * 4);
          res = r.sampler->sample(host_logits.data(), vocab, r.prompt, k > 0 ? grown : r.output);
        }
        tokens.push_back(res.token);
        res_list.push_back(std::move(res));
        if (j == k || tokens.back() != draft[j] || r.sampler->is_stop(tokens.back())) break;
        if (!r.device_sampling) grown.push_back(tokens.back());
      }
      if (k > 0) {
        const int32_t accepted = int32_t(tokens.size()) - 1;
        ++stats.spec_num_drafts;
        stats.spec_num_draft_tokens += k;
        stats.spec_num_accepted_tokens += accepted;
        if (int32_t(stats.spec_accepted_per_pos.size()) < k) stats.spec_accepted_per_pos.resize(size_t(k), 0);
        for (int32_t p = 0; p < accepted; ++p) ++stats.spec_accepted_per_pos[size_t(p)];
      }
      sampled.push_back(SampledTokens{s.request_id, std::move(tokens), false});
    }
    std::map<RequestId, std::vector<PromptLogprob>> prompt_lps = prompt_logprobs(plan, first_row);
    auto outputs = scheduler_.update(plan, sampled);
    if (!outputs) throw std::runtime_error("engine: scheduler rejected the step's results: " + outputs.error());
    const int32_t cap = config_.ngram.disable_by_batch_size;
    const bool drafting =
        speculate_ && (cap == 0 || scheduler_.num_running() + scheduler_.num_waiting() <= cap);
    std::map<RequestId, std::vector<int32_t>> eagle_drafts;
    if (eagle3_) eagle_drafts = draft_eagle3(plan, sampled, *outputs, drafting, bucket, q, stats);
    for (const auto& out : *outputs) {
      auto it = requests_.find(out.request_id);
      if (it == requests_.end()) continue;
      RequestState& r = it->second;
      RequestEvent ev;
      ev.request_id = out.request_id;
      if (auto lp = prompt_lps.find(out.request_id); lp != prompt_lps.end()) {
        ev.prompt_logprobs = std::move(lp->second);
        prompt_lps.erase(lp);
      }
      ev.num_prompt_tokens = int32_t(r.prompt.size());
      ev.num_cached_prompt_tokens = std::max(0, r.num_cached_prompt_tokens);
      auto res = results.find(out.request_id);
      for (size_t t = 0; t < out.new_token_ids.size(); ++t) {
        const int32_t tok = out.new_token_ids[t];
        r.output.push_back(tok);
        TokenOutput to;
        to.token = tok;
        if (res != results.end() && t < res->second.size() && res->second[t].token == tok) {
          to.logprob = res->second[t].logprob;
          to.top_logprobs = std::move(res->second[t].top);
        }
        ev.new_tokens.push_back(std::move(to));
      }
      ev.finished = out.finished;
      ev.finish_reason = out.finish_reason;
      // Its blocks were freed by the update above but keep their KV until the next step allocates.
      if (out.finished && r.kv_export) ev.kv_export = export_kv(r.prompt);
      if (out.finished) requests_.erase(it);
      else if (drafting && !out.new_token_ids.empty()) propose(out.request_id, r, eagle_drafts);
      events.push_back(std::move(ev));
    }
    for (auto& [id, lps] : prompt_lps) {  // non-final prefill chunks: no token, an event all the same
      auto it = requests_.find(id);
      if (it == requests_.end() || lps.empty()) continue;
      RequestEvent ev;
      ev.request_id = id;
      ev.num_prompt_tokens = int32_t(it->second.prompt.size());
      ev.num_cached_prompt_tokens = std::max(0, it->second.num_cached_prompt_tokens);
      ev.prompt_logprobs = std::move(lps);
      events.push_back(std::move(ev));
    }
    if (config_.check_invariants) {
      Status st = scheduler_.check_invariants();
      if (!st.is_ok()) throw std::runtime_error("engine invariant violated: " + st.message());
    }
  }

  int block_size() const { return summary_.block_size; }

  DType kv_cache_dtype() const { return summary_.kv_cache_dtype == "bf16" ? DType::kBF16 : DType::kF32; }
  DType index_cache_dtype() const {
    return summary_.index_cache_dtype == "fp8" ? DType::kF8E4M3 : summary_.index_cache_dtype == "bf16" ? DType::kBF16 : DType::kF32;
  }

  // The global KV heads (first, count) of each producer rank's page when the transfer comes from
  // another tensor-parallel size (empty for this engine's size), its pages' size checked.
  Result<std::vector<std::pair<int, int>>> producer_heads(const KvBlocks& blocks) const {
    std::vector<std::pair<int, int>> out;
    const int tp = int(ranks_.size());
    if (blocks.tp == tp) {
      if (blocks.page_bytes != page_bytes_)
        return Status::error("the KV blocks' pages are " + std::to_string(blocks.page_bytes) + " bytes per rank, this "
                             "engine's " + std::to_string(page_bytes_));
      return out;
    }
    if (eagle3_)
      return Status::error("KV blocks of tensor-parallel size " + std::to_string(blocks.tp) + " for an engine of size " +
                           std::to_string(tp) + ": pages with an EAGLE-3 draft's K/V move between equal sizes only");
    const MiniMaxM3Config& last = ranks_.back()->model->config();
    const int heads = last.kv_head_offset + last.num_key_value_heads;  // global KV heads
    const int ptp = blocks.tp;
    if (!(ptp <= heads ? heads % ptp == 0 : ptp % heads == 0))
      return Status::error("KV blocks of tensor-parallel size " + std::to_string(ptp) + ": the model's " +
                           std::to_string(heads) + " KV heads do not split over it");
    const MiniMaxM3Config& c = ranks_[0]->model->config();
    int64_t want = 0;  // a producer rank's page
    const int per_rank = ptp <= heads ? heads / ptp : 1;
    for (int l = 0; l < c.num_hidden_layers; ++l)
      want += int64_t(block_size()) * (2 * int64_t(per_rank) * c.head_dim * int64_t(dtype_size_bytes(kv_cache_dtype())) +
                                       (c.computes_index(l) ? int64_t(c.index_head_dim) * int64_t(dtype_size_bytes(index_cache_dtype())) : 0));
    if (blocks.page_bytes != want)
      return Status::error("the KV blocks' pages are " + std::to_string(blocks.page_bytes) + " bytes per rank, " +
                           std::to_string(want) + " expected for tensor-parallel size " + std::to_string(ptp));
    for (int r = 0; r < ptp; ++r) out.emplace_back(ptp <= heads ? r * per_rank : r / (ptp / heads), per_rank);
    return out;
  }

  // The hashes of `prompt`'s blocks the transfer may fill, checked against the transfer's.
  Result<std::vector<Hash128>> transfer_hashes(const std::vector<int32_t>& prompt, const KvBlocks& blocks) const {
    if (blocks.layout != kv_layout_)
      return Status::error("the KV blocks come from an engine with another KV layout (theirs: " + blocks.layout +
                           "; this engine's: " + kv_layout_ +
                           "): both need the same model, KV and index-key dtypes, draft model and --prefix-hash-seed");
    std::vector<Hash128> want = scheduler_.kv().prefix_block_hashes(prompt);
    want.resize(std::min(want.size(), blocks.hashes.size()));
    for (size_t i = 0; i < want.size(); ++i) {
      if (blocks.hashes[i] != want[i])
        return Status::error("KV block " + std::to_string(i) + " of the transfer is not block " + std::to_string(i) +
                             " of this prompt (its prefix hash differs): the producer computed other tokens");
    }
    return want;
  }

  // Pages in another engine's device memory, mapped into each rank and copied into fresh KV cache
  // blocks (after the host-tier copies of the blocks their allocation evicted).
  Result<KvImportResult> import_kv_from_device(const std::vector<int32_t>& prompt, const KvBlocks& blocks) {
    const int tp = int(ranks_.size());
    auto want = transfer_hashes(prompt, blocks);
    if (!want) return want.status();
    auto heads = producer_heads(blocks);
    if (!heads) return heads.status();
    const std::vector<std::pair<int, int>>& src_heads = *heads;
    // Each rank maps the producer ranks it reads: its own at the same size, every one across sizes.
    const int ptp = blocks.tp;
    std::vector<std::vector<const char*>> src(size_t(tp), std::vector<const char*>(size_t(ptp), nullptr));
    std::vector<std::string> errors(static_cast<size_t>(tp));
    run_ranks([&](int r) {
      ranks_[size_t(r)]->rt->activate();
      for (int p = 0; p < ptp; ++p) {
        if (src_heads.empty() && p != r) continue;
        src[size_t(r)][size_t(p)] =
            static_cast<const char*>(ranks_[size_t(r)]->rt->import_memory(blocks.device_memory[size_t(p)], &errors[size_t(r)]));
        if (!src[size_t(r)][size_t(p)]) return;
      }
    });
    for (int r = 0; r < tp; ++r)
      if (!errors[size_t(r)].empty())
        return Status::error("mapping the producer's KV memory (rank " + std::to_string(r) + "): " + errors[size_t(r)]);
    KvImportResult res;
    res.offered = blocks.num_blocks();
    const KvCacheManager::Adoption adoption = scheduler_.adopt_blocks(*want);
    const auto& adopted = adoption.blocks;
    const std::vector<KvTransfer> offloads = scheduler_.take_offloads();
    run_ranks([&](int r) {
      Rank& k = *ranks_[size_t(r)];
      k.rt->activate();
      char* host = k.host_kv.as<char>();
      for (const KvTransfer& t : offloads) {  // evicted blocks' KV, intact until written below
        k.cache.save_block(k.rt, t.device_block, host + t.host_slot * page_bytes_);
        if (eagle3_) k.draft.cache.save_block(k.rt, t.device_block, host + t.host_slot * page_bytes_ + target_page_bytes_);
      }
      std::vector<ops::BackendRuntime::CopyPiece> pieces;  // one launch for every block's tensors
      const MiniMaxM3Config& c = k.model->config();
      for (const auto& [i, b] : adopted) {
        const int64_t at = int64_t(blocks.device_slots[size_t(i)]) * blocks.page_bytes;
        if (src_heads.empty()) {
          char* page = const_cast<char*>(src[size_t(r)][size_t(r)]) + at;
          k.cache.page_pieces(b, page, false, pieces);
          if (eagle3_) k.draft.cache.page_pieces(b, page + target_page_bytes_, false, pieces);
          continue;
        }
        // Across sizes: the rank's heads of the block from the producer ranks' pages that hold them.
        for (size_t p = 0; p < src_heads.size(); ++p)
          k.cache.block_head_pieces(c, b, src[size_t(r)][p] + at, src_heads[p].first, src_heads[p].second, pieces);
      }
      k.rt->copy_batch(pieces);
      k.rt->synchronize();
    });
    res.imported = int32_t(adopted.size());
    res.on_device = adoption.chain - res.imported;
    res.dropped = res.offered - adoption.chain;
    return res;
  }

  // The KV blocks of `prompt` a prefix hit may cover, from the KV cache or the host tier, each
  // rank's page (with the draft's K/V after the target's, as the host tier keeps them).
  std::shared_ptr<const KvBlocks> export_kv(const std::vector<int32_t>& prompt) {
    const KvCacheManager& kv = scheduler_.kv();
    const PrefixMatch m = kv.find_cached_prefix(prompt);
    auto b = std::make_shared<KvBlocks>();
    b->layout = kv_layout_;
    b->block_size = block_size();
    b->tp = int32_t(ranks_.size());
    b->page_bytes = page_bytes_;
    b->hashes = kv.prefix_block_hashes(prompt);
    b->hashes.resize(size_t(m.num_blocks()));
    const int32_t nd = int32_t(m.block_ids.size());
    if (b->hashes.empty()) return b;
    // Into device slots where they fit (the consumer copies from there), else host memory.
    {
      std::lock_guard<std::mutex> lock(export_mu_);
      if (!export_free_.empty() && export_free_.size() >= b->hashes.size()) {
        b->device_slots.assign(export_free_.end() - std::ptrdiff_t(b->hashes.size()), export_free_.end());
        export_free_.resize(export_free_.size() - b->hashes.size());
      }
    }
    if (!b->device_slots.empty()) {
      b->device_memory = export_memory_;
      run_ranks([&](int r) {
        Rank& k = *ranks_[size_t(r)];
        k.rt->activate();
        std::vector<ops::BackendRuntime::CopyPiece> pieces;  // one launch for every block's tensors
        for (int32_t i = 0; i < b->num_blocks(); ++i) {
          char* dst = k.kv_export.as<char>() + int64_t(b->device_slots[size_t(i)]) * page_bytes_;
          if (i < nd) {
            k.cache.page_pieces(m.block_ids[size_t(i)], dst, true, pieces);
            if (eagle3_) k.draft.cache.page_pieces(m.block_ids[size_t(i)], dst + target_page_bytes_, true, pieces);
          } else {
            k.rt->upload(dst, k.host_kv.as<char>() + int64_t(m.host_slots[size_t(i - nd)]) * page_bytes_, size_t(page_bytes_));
          }
        }
        k.rt->copy_batch(pieces);
        k.rt->synchronize();
      });
      return b;
    }
    b->bytes.resize(b->hashes.size() * ranks_.size() * size_t(page_bytes_));
    run_ranks([&](int r) {
      Rank& k = *ranks_[size_t(r)];
      k.rt->activate();
      if (nd > 0) {
        ops::HostStaging stage(k.rt, size_t(nd) * size_t(page_bytes_));  // pinned: what save_block copies into
        for (int32_t i = 0; i < nd; ++i) {
          char* dst = stage.as<char>() + int64_t(i) * page_bytes_;
          k.cache.save_block(k.rt, m.block_ids[size_t(i)], dst);
          if (eagle3_) k.draft.cache.save_block(k.rt, m.block_ids[size_t(i)], dst + target_page_bytes_);
        }
        k.rt->synchronize();
        for (int32_t i = 0; i < nd; ++i)
          std::memcpy(b->page(i, r), stage.as<char>() + int64_t(i) * page_bytes_, size_t(page_bytes_));
      }
      for (size_t j = 0; j < m.host_slots.size(); ++j)
        std::memcpy(b->page(nd + int32_t(j), r), k.host_kv.as<char>() + int64_t(m.host_slots[j]) * page_bytes_,
                    size_t(page_bytes_));
    });
    return b;
  }

  // fn on every rank at once. A rank that throws aborts the group first, so the others leave
  // their collectives with an error instead of waiting for it; the exception reaches the caller.
  void run_ranks(const std::function<void(int)>& fn) {
    threads_.run([&](int r) {
      try {
        fn(r);
      } catch (...) {
        if (ranks_[size_t(r)]->comm) ranks_[size_t(r)]->comm->abort();
        throw;
      }
    });
  }

  // The next step's draft for a request that just sampled (so it decodes): prompt lookup over
  // its tokens, no longer than the output it may still produce after the verified token.
  void propose(RequestId id, const RequestState& r, std::map<RequestId, std::vector<int32_t>>& eagle_drafts) {
    const int32_t room = r.sampling.max_tokens - int32_t(r.output.size()) - 1;
    std::vector<int32_t> draft;
    if (!eagle3_) draft = propose_ngram(r.prompt, r.output, config_.ngram, room);
    else if (auto it = eagle_drafts.find(id); it != eagle_drafts.end()) draft = std::move(it->second);
    // Graph-replayed verification needs every request at the full draft length: a short or
    // missing draft is filled with repeats of its last token (rejected unless the model agrees).
    if (config_.spec_cuda_graphs) {
      const int32_t full = std::min(config_.ngram.num_speculative_tokens, room);
      const int32_t fill = draft.empty() ? r.output.back() : draft.back();
      while (int32_t(draft.size()) < full) draft.push_back(fill);
    }
    if (draft.empty()) return;
    Status st = scheduler_.set_spec_tokens(id, std::move(draft));
    if (!st.is_ok()) throw std::runtime_error("engine: " + st.message());
  }

  // EAGLE-3: the draft runs over every token this step computed (in the target batch's order, so
  // its rows of the captured hidden states line up), then chains drafts for the requests that go
  // on decoding. Runs while drafting is off too, so the draft's K/V never misses a position.
  std::map<RequestId, std::vector<int32_t>> draft_eagle3(const SchedulePlan& plan,
                                                         const std::vector<SampledTokens>& sampled,
                                                         const std::vector<RequestOutput>& outputs, bool drafting,
                                                         int step_bucket, int tokens_per_seq, EngineStepStats& stats) {
    std::map<RequestId, const std::vector<int32_t>*> accepted;  // this step's tokens per sampling request
    for (const SampledTokens& st : sampled) accepted[st.request_id] = &st.token_ids;
    std::map<RequestId, const RequestOutput*> outs;
    for (const RequestOutput& o : outputs) outs[o.request_id] = &o;
    std::vector<DraftSequence> seqs;
    std::vector<RequestId> ids;
    for (const auto& s : plan.scheduled) {
      DraftSequence d;
      const int32_t n = int32_t(s.token_ids.size()), k = s.num_spec_tokens;
      d.start_pos = s.start_pos;
      d.block_table = s.block_table;
      d.inputs.resize(size_t(n));
      for (int32_t i = 0; i + 1 < n; ++i) d.inputs[size_t(i)] = s.token_ids[size_t(i) + 1];
      d.inputs.back() = s.token_ids.back();  // replaced below where the next token is known
      auto req = requests_.find(s.request_id);
      auto acc = accepted.find(s.request_id);
      if (acc != accepted.end()) {
        // Sample j was taken at row n - 1 - k + j: it is the token after that row's position.
        const std::vector<int32_t>& t = *acc->second;
        for (size_t j = 0; j < t.size(); ++j) d.inputs[size_t(n - 1 - k) + j] = t[j];
        auto o = outs.find(s.request_id);
        if (drafting && req != requests_.end() && o != outs.end() && !o->second->finished &&
            o->second->new_token_ids.size() == t.size()) {
          d.propose_row = n - 1 - k + int32_t(t.size()) - 1;
          const int32_t room = req->second.sampling.max_tokens - int32_t(req->second.output.size() + t.size()) - 1;
          d.num_draft = std::max(0, std::min(config_.ngram.num_speculative_tokens, room));
        }
      } else if (!s.samples && req != requests_.end()) {  // a prompt chunk: the token after it is known
        const RequestState& r = req->second;
        const size_t p = size_t(s.end_pos);
        if (p < r.prompt.size()) d.inputs.back() = r.prompt[p];
        else if (p - r.prompt.size() < r.output.size()) d.inputs.back() = r.output[p - r.prompt.size()];
      }
      seqs.push_back(std::move(d));
      ids.push_back(s.request_id);
    }
    auto t0 = std::chrono::steady_clock::now();
    std::vector<std::vector<int32_t>> drafts = drafter_->run(seqs, step_bucket, tokens_per_seq);
    stats.draft_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::map<RequestId, std::vector<int32_t>> out;
    for (size_t i = 0; i < seqs.size(); ++i)
      if (!drafts[i].empty()) out[ids[i]] = std::move(drafts[i]);
    return out;
  }

  // Prompt logprobs of the requests that asked for them: position p + 1's from the logits at row
  // p of this step's chunk (the final hidden states the forward left in the workspace), through
  // the LM head again in pieces of the logits buffer's rows, after the step's sampling is done.
  std::map<RequestId, std::vector<PromptLogprob>> prompt_logprobs(const SchedulePlan& plan,
                                                                  const std::vector<int32_t>& first_row) {
    struct Need {
      RequestId id;
      int32_t position, row, token, top;
    };
    std::vector<Need> needs;
    for (size_t i = 0; i < plan.scheduled.size(); ++i) {
      const auto& s = plan.scheduled[i];
      auto it = requests_.find(s.request_id);
      if (it == requests_.end() || it->second.sampling.prompt_logprobs < 0) continue;
      RequestState& r = it->second;
      const int32_t num_prompt = int32_t(r.prompt.size());
      const int32_t from = std::max(s.start_pos, r.prompt_logprobs_next - 1), to = std::min(s.end_pos, num_prompt - 1);
      for (int32_t p = from; p < to; ++p) {
        needs.push_back({s.request_id, p + 1, first_row[i] + (p - s.start_pos), r.prompt[size_t(p) + 1],
                         r.sampling.prompt_logprobs});
      }
      r.prompt_logprobs_next = std::max(r.prompt_logprobs_next, to + 1);
    }
    std::map<RequestId, std::vector<PromptLogprob>> out;
    if (needs.empty()) return out;
    const int64_t vocab = summary_.vocab_size;
    // Every rank (a vocab-parallel LM head gathers its logits); rank 0's are read.
    const size_t cap = size_t(std::min<int64_t>(ranks_[0]->step->max_rows(), ranks_[0]->ws->max_logit_rows));
    std::vector<float> logits, logp;
    for (size_t b = 0; b < needs.size(); b += cap) {
      const size_t R = std::min(cap, needs.size() - b);
      std::vector<int32_t> rows(R);
      for (size_t j = 0; j < R; ++j) rows[j] = needs[b + j].row;
      logits.resize(R * size_t(vocab));
      run_ranks([&](int r) {
        Rank& k = *ranks_[size_t(r)];
        k.rt->activate();
        k.model->logits_of_rows(k.ctx, k.step->upload_rows(rows), int64_t(R), k.step->num_tokens(), *k.ws);
        if (r == 0) k.rt->download(logits.data(), k.ws->logits.data(), logits.size() * 4);
        else k.rt->synchronize();
      });
      for (size_t j = 0; j < R; ++j) {
        const Need& nd = needs[b + j];
        log_softmax(logits.data() + j * size_t(vocab), vocab, logp);
        PromptLogprob e;
        e.position = nd.position;
        e.token = nd.token;
        e.logprob = logp[size_t(nd.token)];
        e.rank = 1 + int32_t(std::count_if(logp.begin(), logp.end(), [&](float v) { return v > e.logprob; }));
        e.top = top_logprobs(logp, nd.top);
        out[nd.id].push_back(std::move(e));
      }
    }
    return out;
  }

  EngineConfig config_;
  std::shared_ptr<void> group_;  // tensor parallelism: the ranks' group (in-process or NCCL); outlives the ranks
  std::vector<std::unique_ptr<Rank>> ranks_;     // one (the whole model) without tensor parallelism
  dist::RankThreads threads_;
  int64_t page_bytes_ = 0;  // one KV page on one rank
  int64_t target_page_bytes_ = 0;  // of page_bytes_: the target's share (EAGLE-3's draft K/V follows it)
  Scheduler scheduler_;
  ModelSummary summary_;
  std::string kv_layout_;
  // Exports in device memory (kv_export_device_bytes): free slots (HTTP threads release them) and
  // each rank's export memory handle.
  std::mutex export_mu_;
  std::vector<int32_t> export_free_;
  std::vector<std::string> export_memory_;
  ops::DispatchStats stats_;
  std::map<RequestId, RequestState> requests_;
  std::vector<RequestEvent> pending_events_;
  RequestId next_id_ = 1;
  int max_blocks_per_seq_ = 1;
  bool speculate_ = false;       // drafts (ngram or EAGLE-3) are proposed after each sampled token
  bool eagle3_ = false;          // the EAGLE-3 draft model runs after every step
  std::unique_ptr<Eagle3Drafter> drafter_;
  std::mt19937_64 seed_source_{config_.seed ? *config_.seed : std::random_device{}()};
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
  // The runtime: CUDA when asked for (or "auto" with a GPU present), else host memory.
  std::unique_ptr<ops::BackendRuntime> owned;
  ops::BackendRuntime* rt = ops::host_runtime();
  if (config.device != "auto" && config.device != "cpu" && config.device != "cuda")
    return Status::error("device must be auto, cpu or cuda, got '" + config.device + "'");
#if M3_HAVE_CUDA_BACKEND
  if (config.device == "cuda" || (config.device == "auto" && cuda::device_count() > 0)) {
    try {
      owned = cuda::make_cuda_runtime(config.device_id);
    } catch (const std::exception& e) {
      return Status::error(std::string("cannot use the CUDA device: ") + e.what());
    }
    rt = owned.get();
  }
#else
  if (config.device == "cuda") return Status::error("this m3serve was built without the CUDA backend (no nvcc at build time)");
#endif
  // Serving options are checked before the weights load (minutes for M3).
  const int tp = config.tensor_parallel_size;
  if (tp < 1 || tp > 64) return Status::error("tensor_parallel_size must be in [1, 64], got " + std::to_string(tp));
  if (config.msa_index_reuse < 1 || config.msa_index_reuse > 64)
    return Status::error("msa_index_reuse must be in [1, 64], got " + std::to_string(config.msa_index_reuse));
  if (config.kv_offload_bytes < 0) return Status::error("kv_offload_bytes must be >= 0");
  if (config.speculative_method != "" && config.speculative_method != "ngram" && config.speculative_method != "eagle3")
    return Status::error("speculative method must be ngram (prompt lookup) or eagle3 (an EAGLE-3 draft model), got '" +
                         config.speculative_method + "' (eagle, mtp and draft_model are not supported)");
  if (!config.speculative_method.empty()) {
    Status st = config.ngram.validate();
    if (!st.is_ok()) return Status::error("speculative config: " + st.message());
  }
  const bool eagle3 = config.speculative_method == "eagle3";
  if (eagle3 && config.speculative_model.empty())
    return Status::error("speculative method eagle3 needs the draft model's directory (speculative_model)");
  std::unique_ptr<ModelDir> draft_dir;
  if (eagle3) {
    auto d = ModelDir::open(config.speculative_model);
    if (!d) return Status::error("speculative model: " + d.error());
    draft_dir = std::move(*d);
  }
  LoadProgress progress;
  progress.on_progress = config.on_load_progress;
  auto dir = ModelDir::open(config.model_dir);
  if (!dir) return dir.status();
  // The ranks' group, after the cheap checks (NCCL initialises every device): NCCL over devices
  // device_id .. device_id + tp - 1, or host memory.
  std::shared_ptr<void> group;
  std::vector<std::unique_ptr<ops::Communicator>> comms;
  if (tp > 1 && rt->device() == Device::kCpu) {
    auto g = std::make_shared<dist::InProcessGroup>(tp);
    for (int r = 0; r < tp; ++r) comms.push_back(g->communicator(r));
    group = g;
  }
#if M3_HAVE_CUDA_BACKEND
  if (tp > 1 && rt->device() == Device::kCuda) {
    std::vector<int> devices;
    for (int r = 0; r < tp; ++r) devices.push_back(config.device_id + r);
    auto g = cuda::NcclGroup::create(devices);
    if (!g) return Status::error("tensor_parallel_size " + std::to_string(tp) + ": " + g.error());
    std::shared_ptr<cuda::NcclGroup> shared = std::move(*g);
    for (int r = 0; r < tp; ++r) comms.push_back(shared->communicator(r, config.batch_invariant));
    group = shared;
  }
#endif
  // Each rank loads its slice (tensor parallelism; the whole model at size 1).
  std::vector<std::unique_ptr<Rank>> ranks;
  for (int r = 0; r < tp; ++r) {
    auto k = std::make_unique<Rank>();
    k->owned_runtime = r == 0 ? std::move(owned) : nullptr;
    k->rt = rt;  // the CPU's host memory is every rank's
#if M3_HAVE_CUDA_BACKEND
    if (r > 0 && rt->device() == Device::kCuda) {  // rank r on device device_id + r
      try {
        k->owned_runtime = cuda::make_cuda_runtime(config.device_id + r);
      } catch (const std::exception& e) {
        return Status::error("tensor parallel rank " + std::to_string(r) + ": cannot use CUDA device " +
                             std::to_string(config.device_id + r) + ": " + e.what());
      }
      k->rt = k->owned_runtime.get();
    }
#endif
    if (r < int(comms.size())) k->comm = std::move(comms[size_t(r)]);
    ranks.push_back(std::move(k));
  }
  // The ranks load at once, each on its own thread and device (rank 0 reports the progress).
  std::vector<Status> loaded(static_cast<size_t>(tp), Status::ok());
  dist::RankThreads(tp).run([&](int r) {
    Rank& k = *ranks[size_t(r)];
    k.rt->activate();  // weights go to the rank's device
    LoadOptions load =
        engine_load_options(k.rt, rt->device() == Device::kCpu, config.dequantize_mxfp8, config.batch_invariant);
    load.tp_size = tp;
    load.tp_rank = r;
    Result<std::unique_ptr<MiniMaxM3Model>> model = Status::error("not loaded");
    try {
      model = MiniMaxM3Model::load(**dir, r == 0 ? progress : LoadProgress{}, load);
    } catch (const std::exception& e) {
      loaded[size_t(r)] =
          Status::error(config.model_dir + ": loading weights into " + k.rt->describe() + " failed: " + e.what());
      return;
    }
    if (!model) {
      loaded[size_t(r)] = model.status();
      return;
    }
    (*model)->set_msa_index_reuse(config.msa_index_reuse);
    k.model = std::move(*model);
    if (!draft_dir) return;
    // The draft, whole on every rank (its linears in the dense linears' format, BF16 on a GPU).
    try {
      auto draft = Eagle3Model::load(*draft_dir, *k.model, load);
      if (!draft) loaded[size_t(r)] = draft.status();
      else k.draft.model = std::move(*draft);
    } catch (const std::exception& e) {
      loaded[size_t(r)] = Status::error(config.speculative_model + ": loading the draft into " + k.rt->describe() +
                                        " failed: " + e.what());
    }
  });
  for (const Status& st : loaded)
    if (!st.is_ok()) return st;
  rt->activate();
  const MiniMaxM3Config& c = ranks[0]->model->config();  // one rank's shapes (KV pages are per rank)
  const int32_t bs = c.index_block_size;
  // KV element type: BF16 on CUDA by default (what the tuned MSA kernels read), F32 on the CPU.
  std::string kv_dtype_name = config.kv_cache_dtype;
  if (kv_dtype_name == "auto") kv_dtype_name = rt->device() == Device::kCuda ? "bf16" : "f32";
  if (kv_dtype_name != "f32" && kv_dtype_name != "bf16")
    return Status::error("kv_cache_dtype must be auto, f32 or bf16, got " + config.kv_cache_dtype);
  const DType kv_dtype = kv_dtype_name == "bf16" ? DType::kBF16 : DType::kF32;
  // Index keys: the KV cache's type unless asked otherwise (fp8: e4m3, half of bf16's bytes).
  const std::string index_dtype_name = config.index_cache_dtype == "auto" ? kv_dtype_name : config.index_cache_dtype;
  if (index_dtype_name != "f32" && index_dtype_name != "bf16" && index_dtype_name != "fp8")
    return Status::error("index_cache_dtype must be auto, f32, bf16 or fp8, got " + config.index_cache_dtype);
  const DType index_dtype = index_dtype_name == "fp8"    ? DType::kF8E4M3
                            : index_dtype_name == "bf16" ? DType::kBF16
                                                         : DType::kF32;
  // Bytes one KV page costs across all layers (K, V everywhere; index-K on sparse layers).
  const int64_t target_page_bytes = BackendKvCache::bytes_per_block(c, bs, kv_dtype, index_dtype);
  // EAGLE-3: the draft layer's K/V of a page, kept beside the target's (same block ids).
  const int64_t page_bytes =
      target_page_bytes + (eagle3 ? Eagle3KvCache::bytes_per_block(ranks[0]->draft.model->config(), bs, kv_dtype) : 0);
  const int64_t blocks_wanted = config.num_kv_blocks > 0 ? config.num_kv_blocks : config.kv_cache_memory_bytes / page_bytes;
  if (blocks_wanted > INT32_MAX)
    return Status::error("a KV cache of " + std::to_string(config.kv_cache_memory_bytes) + " bytes is " +
                         std::to_string(blocks_wanted) + " blocks, more than 2^31 - 1: lower --kv-cache-memory");
  int32_t num_blocks = int32_t(blocks_wanted);
  if (num_blocks < 1) return Status::error("KV cache budget too small for one page (" + std::to_string(page_bytes) + " bytes)");
  int32_t max_len = config.max_model_len > 0 ? config.max_model_len
                                             : int32_t(std::min<int64_t>(c.max_position_embeddings, int64_t(num_blocks) * bs));
  if (max_len > c.max_position_embeddings)
    return Status::error("max_model_len " + std::to_string(max_len) + " exceeds the model's max_position_embeddings " +
                         std::to_string(c.max_position_embeddings));
  SchedulerConfig sc;
  sc.max_num_batched_tokens = config.max_num_batched_tokens;
  sc.max_num_seqs = config.max_num_seqs;
  sc.max_chunk_tokens = config.long_prefill_token_threshold;
  sc.max_model_len = max_len;
  if (config.scheduling_policy != "fcfs" && config.scheduling_policy != "priority")
    return Status::error("scheduling_policy must be fcfs or priority, got '" + config.scheduling_policy + "'");
  sc.policy = config.scheduling_policy == "priority" ? SchedulingPolicy::kPriority : SchedulingPolicy::kFcfs;
  KvCacheConfig kc;
  kc.num_blocks = num_blocks;
  kc.block_size_tokens = bs;
  kc.enable_prefix_caching = config.enable_prefix_caching;
  kc.hash_seed = config.prefix_hash_seed;
  // (KvCacheConfig::validate refuses a host tier without prefix caching.)
  kc.num_host_blocks = int32_t(std::min<int64_t>(config.kv_offload_bytes / page_bytes, INT32_MAX));
  if (config.kv_offload_bytes > 0 && kc.num_host_blocks < 1)
    return Status::error("kv_offload_bytes " + std::to_string(config.kv_offload_bytes) + " holds no KV block (" +
                         std::to_string(page_bytes) + " bytes each)");
  // The cache key covers what changes a cached block: the model's identity (its config.json
  // content and total weight bytes, not its path, so two processes serving the same checkpoint
  // agree) and the KV and index-key dtypes. Block size and seed are in the hasher's root already.
  kc.hash_extra_keys = {"model=" + model_fingerprint(config.model_dir), "kv_dtype=" + kv_dtype_name,
                        "index_dtype=" + index_dtype_name};
  // Index sharing changes every later layer's K and V for the same tokens.
  if (config.msa_index_reuse > 1) kc.hash_extra_keys.push_back("msa_index_reuse=" + std::to_string(config.msa_index_reuse));
  // (Not the tensor-parallel size: a block's hash names its tokens' KV whatever slice of the heads
  // a rank's page holds; KV transfers between sizes map the pages, Engine::import_kv.)
  auto scheduler = Scheduler::create(sc, kc);
  if (!scheduler) return scheduler.status();
  // What a page is, for KV transfers between engines: the prefix hashes' inputs (a block's hash
  // then names the same tokens under the same model and dtypes) and the draft whose K/V follow.
  // The tensor-parallel size travels beside it (KvBlocks::tp): pages of another size are mapped.
  std::string kv_layout = "m3kv/1 seed=" + std::to_string(kc.hash_seed) + " block=" + std::to_string(bs) + " keys=";
  for (const std::string& key : kc.hash_extra_keys) kv_layout += key + ";";
  if (eagle3) kv_layout += " draft=" + model_fingerprint(config.speculative_model);
  ModelSummary summary;
  summary.vocab_size = c.vocab_size;
  summary.max_model_len = max_len;
  summary.block_size = bs;
  summary.num_kv_blocks = num_blocks;
  summary.num_host_kv_blocks = kc.num_host_blocks;
  summary.msa_index_reuse = config.msa_index_reuse;
  summary.eos_token_ids = c.eos_token_ids;
  summary.bos_token_id = c.bos_token_id;
  summary.device = rt->describe();
  for (const auto& k : ranks) summary.weight_bytes += k->model->weight_bytes();
  summary.tensor_parallel_size = tp;
  summary.kv_cache_dtype = kv_dtype_name;
  summary.index_cache_dtype = index_dtype_name;
  summary.scheduling_policy = config.scheduling_policy;
  summary.enable_prefix_caching = config.enable_prefix_caching;
  if (!config.speculative_method.empty()) {
    summary.speculative_method = config.speculative_method;
    summary.num_speculative_tokens = config.ngram.num_speculative_tokens;
    summary.speculative_model = config.speculative_model;
    if (eagle3) summary.draft_weight_bytes = ranks[0]->draft.model->weight_bytes();
    if (config.spec_cuda_graphs && config.ngram.num_speculative_tokens + 1 > bs)
      return Status::error("spec_cuda_graphs needs 1 + num_speculative_tokens <= the block size (" + std::to_string(bs) + ")");
  }
  if (config.max_num_batched_tokens < 1 || config.max_num_seqs < 1)
    return Status::error("max_num_batched_tokens and max_num_seqs must be >= 1");
  // Host memory is mapped lazily (pages appear as they are written), so a CPU KV cache larger than
  // the memory the host has would be killed mid-run, not at start: refuse it here, naming the flags.
  if (rt->device() == Device::kCpu) {
    const double pool = double(num_blocks) * double(page_bytes) * tp, tier = double(kc.num_host_blocks) * double(page_bytes) * tp;
    const double avail = double(rt->free_memory_bytes());
    if (pool + tier > avail) {
      auto gib = [](double b) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.2f GiB", b / double(1 << 30));
        return std::string(buf);
      };
      return Status::error("the KV cache (" + std::to_string(num_blocks) + " blocks of " + std::to_string(page_bytes) +
                           " bytes" + (tp > 1 ? " on each of " + std::to_string(tp) + " ranks" : std::string()) + ": " +
                           gib(pool) + (tier > 0 ? ", + " + gib(tier) + " of KV offloading" : std::string()) +
                           ") does not fit the host's available memory (" + gib(avail) +
                           "): lower --kv-cache-memory (or --num-gpu-blocks-override, --kv-offloading-size)");
    }
  }
  try {
    for (int r = 0; r < tp; ++r) {
      Rank& k = *ranks[size_t(r)];
      k.rt->activate();
      k.cache = BackendKvCache::allocate(k.rt, k.model->config(), num_blocks, bs, kv_dtype, index_dtype);
      // Scratch pages past the pool: one per sequence, for drafts chained past the target's pages.
      if (eagle3)
        k.draft.cache = Eagle3KvCache::allocate(k.rt, k.draft.model->config(), int64_t(num_blocks) + config.max_num_seqs,
                                                bs, kv_dtype);
      k.host_kv = ops::HostStaging(k.rt, size_t(kc.num_host_blocks) * size_t(page_bytes));
    }
    return std::unique_ptr<Engine>(new EngineImpl(config, std::move(group), std::move(ranks), page_bytes,
                                                  target_page_bytes, std::move(*scheduler), summary, kv_layout));
  } catch (const std::exception& e) {
    return Status::error(std::string("allocating the KV cache and step buffers failed: ") + e.what());
  }
}

}  // namespace m3
