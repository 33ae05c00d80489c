// Training data for an EAGLE-3 draft of a target model: for windows of corpus text, the target's
// residual stream entering each aux layer (what the engine captures for the draft) and its greedy
// prediction at every position. tools/train_eagle3.py trains the draft on them.
//   eagle3_data --model DIR [--tokenizer DIR] --corpus FILE[,FILE...] [--fraction 0.7] [--window 256]
//               [--windows 384] [--aux-layers 1,3,5] [--generate N] --out DIR
// Windows are spread evenly over the first `fraction` of each corpus (the rest stays held out).
// --generate N: the last N tokens of each window are the target's own greedy continuation of the
// first window - N (what the draft sees when serving: the target's output, not the corpus).
// Writes DIR/tokens.i32 [N, W], DIR/greedy.i32 [N, W] (the target's argmax after each position),
// DIR/aux.f32 [N, A, W, hidden] and DIR/meta.json.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/cpu/cpu_backend.h"
#include "engine/step_buffers.h"
#include "m3serve/engine.h"
#include "model/minimax_m3/model.h"
#include "ops/host_runtime.h"
#include "tokenizer/tokenizer.h"

namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> v;
  for (size_t p = 0; p <= s.size();) {
    const size_t q = std::min(s.find(',', p), s.size());
    if (q > p) v.push_back(s.substr(p, q - p));
    p = q + 1;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace m3;
  std::string model_dir, tokenizer_dir, corpora, out_dir, aux_list = "1,3,5";
  double fraction = 0.7;
  int window = 256, windows = 384, generate = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--model") model_dir = v;
    else if (k == "--tokenizer") tokenizer_dir = v;
    else if (k == "--corpus") corpora = v;
    else if (k == "--fraction") fraction = std::stod(v);
    else if (k == "--window") window = std::stoi(v);
    else if (k == "--windows") windows = std::stoi(v);
    else if (k == "--aux-layers") aux_list = v;
    else if (k == "--out") out_dir = v;
    else if (k == "--generate") generate = std::stoi(v);
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  if (model_dir.empty() || corpora.empty() || out_dir.empty()) {
    std::fprintf(stderr, "usage: eagle3_data --model DIR --corpus FILE[,FILE] --out DIR [options]\n");
    return 2;
  }
  auto tok = Tokenizer::from_dir(tokenizer_dir.empty() ? model_dir : tokenizer_dir);
  if (!tok) {
    std::fprintf(stderr, "tokenizer: %s\n", tok.error().c_str());
    return 1;
  }
  auto model = MiniMaxM3Model::load(model_dir);
  if (!model) {
    std::fprintf(stderr, "%s\n", model.error().c_str());
    return 1;
  }
  const MiniMaxM3Config& c = (*model)->config();
  std::vector<int> aux;
  for (const auto& s : split(aux_list)) aux.push_back(std::stoi(s));
  // Windows per corpus in proportion to its training part.
  std::vector<std::vector<int32_t>> texts;
  size_t total = 0;
  for (const auto& path : split(corpora)) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "corpus %s not found\n", path.c_str());
      return 1;
    }
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::vector<int32_t> ids = (*tok)->encode(text, false);
    ids.resize(size_t(double(ids.size()) * fraction));
    total += ids.size();
    texts.push_back(std::move(ids));
  }
  std::vector<std::pair<size_t, size_t>> starts;  // (corpus, offset)
  for (size_t t = 0; t < texts.size(); ++t) {
    const int n = std::max(1, int(double(windows) * double(texts[t].size()) / double(total)));
    const size_t span = texts[t].size() - size_t(window);
    for (int w = 0; w < n; ++w) starts.emplace_back(t, span * size_t(w) / size_t(n));
  }
  // The windows' tokens: corpus text, or a corpus prefix and the target's greedy continuation.
  std::vector<std::vector<int32_t>> wins;
  for (const auto& [t, off] : starts)
    wins.emplace_back(texts[t].begin() + long(off), texts[t].begin() + long(off) + window);
  if (generate > 0) {
    EngineConfig ec;
    ec.model_dir = model_dir;
    ec.device = "cpu";
    ec.max_num_seqs = 64;
    ec.max_num_batched_tokens = 4096;
    ec.num_kv_blocks = 64 * ((window + c.index_block_size - 1) / c.index_block_size + 1);
    auto engine = Engine::create(ec);
    if (!engine) {
      std::fprintf(stderr, "%s\n", engine.error().c_str());
      return 1;
    }
    std::map<RequestId, size_t> which;
    for (size_t w = 0; w < wins.size(); ++w) {
      GenerationRequest r;
      r.prompt_token_ids.assign(wins[w].begin(), wins[w].end() - generate);
      r.sampling.temperature = 0.0f;
      r.sampling.max_tokens = generate;
      r.sampling.ignore_eos = true;
      auto id = (*engine)->submit(std::move(r));
      if (!id) {
        std::fprintf(stderr, "%s\n", id.error().c_str());
        return 1;
      }
      which[*id] = w;
      wins[w].resize(size_t(window - generate));
    }
    while ((*engine)->has_unfinished_requests())
      for (auto& ev : (*engine)->step(nullptr))
        for (auto& t : ev.new_tokens) wins[which[ev.request_id]].push_back(t.token);
    std::fprintf(stderr, "generated %d tokens for each of %zu windows\n", generate, wins.size());
  }
  ops::KernelTable table;
  cpu::register_cpu_kernels(table);
  const ops::OpContext ctx{&table, nullptr, Device::kCpu, true, nullptr};
  ops::BackendRuntime* rt = ops::host_runtime();
  const int bs = c.index_block_size, blocks = (window + bs - 1) / bs;
  auto kv = BackendKvCache::allocate(rt, c, blocks, bs);
  auto ws = (*model)->make_workspace(window, window);
  StepBuffers sb(rt, window, 1, window, blocks);
  std::vector<int32_t> table_ids(static_cast<size_t>(blocks)), rows(static_cast<size_t>(window));
  for (int b = 0; b < blocks; ++b) table_ids[size_t(b)] = b;
  for (int r = 0; r < window; ++r) rows[size_t(r)] = r;
  const int64_t H = c.hidden_size;
  std::vector<std::vector<float>> cap(aux.size(), std::vector<float>(size_t(window * H)));
  std::ofstream f_tok(out_dir + "/tokens.i32", std::ios::binary), f_greedy(out_dir + "/greedy.i32", std::ios::binary),
      f_aux(out_dir + "/aux.f32", std::ios::binary);
  if (!f_tok || !f_greedy || !f_aux) {
    std::fprintf(stderr, "cannot write into %s (does it exist?)\n", out_dir.c_str());
    return 1;
  }
  for (size_t w = 0; w < starts.size(); ++w) {
    const std::vector<int32_t>& win = wins[w];
    sb.begin();
    sb.add_sequence(win, 0, table_ids, bs);
    sb.set_logits_rows(rows);
    sb.upload();
    ForwardBatch fb;
    fb.token_ids = sb.device_tokens();
    fb.meta = sb.metadata(bs);
    fb.logits_rows = rows;
    for (size_t a = 0; a < aux.size(); ++a) fb.captures.emplace_back(aux[a], cap[a].data());
    (*model)->forward(ctx, fb, kv.views(Device::kCpu), *ws);
    std::vector<int32_t> greedy(static_cast<size_t>(window));
    for (int r = 0; r < window; ++r) {
      const float* l = ws->logits.as<float>() + int64_t(r) * c.vocab_size;
      greedy[size_t(r)] = int32_t(std::max_element(l, l + c.vocab_size) - l);
    }
    f_tok.write(reinterpret_cast<const char*>(win.data()), std::streamsize(win.size() * 4));
    f_greedy.write(reinterpret_cast<const char*>(greedy.data()), std::streamsize(greedy.size() * 4));
    for (const auto& a : cap) f_aux.write(reinterpret_cast<const char*>(a.data()), std::streamsize(a.size() * 4));
    if ((w + 1) % 32 == 0) std::fprintf(stderr, "%zu / %zu windows\n", w + 1, starts.size());
  }
  nlohmann::json meta = {{"model", model_dir},   {"windows", starts.size()}, {"window", window},
                         {"hidden_size", H},     {"vocab_size", c.vocab_size}, {"aux_layer_ids", aux},
                         {"num_hidden_layers", c.num_hidden_layers}, {"rms_norm_eps", c.rms_norm_eps},
                         {"max_position_embeddings", c.max_position_embeddings}, {"head_dim", c.head_dim},
                         {"generated_tokens_per_window", generate}};
  std::ofstream(out_dir + "/meta.json") << meta.dump(2) << "\n";
  std::printf("wrote %zu windows of %d tokens to %s\n", starts.size(), window, out_dir.c_str());
  return 0;
}
