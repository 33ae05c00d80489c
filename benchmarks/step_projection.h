#pragma once
// A measured decode step of an m3-layers:N checkpoint (M3's full widths, fewer layers) carried to
// MiniMax-M3's own layer list: every layer of the target costs the mean eager time of the measured
// layers of its kind (attention dense or MSA, MLP dense or MoE), plus the embedding and the head;
// the graph step scales by the same factor as the eager one. An estimate, always labelled so.
#include <map>
#include <string>
#include <vector>

#include "model/minimax_m3/config.h"

namespace m3::bench {

// "dense+mlp", "msa+moe", ...: what a layer's time depends on besides the shared widths.
inline std::string layer_kind(const MiniMaxM3Config& c, int layer) {
  return std::string(c.is_sparse_layer(layer) ? "msa" : "dense") + (c.is_moe_layer(layer) ? "+moe" : "+mlp");
}

struct StepProjection {
  bool ok = false;
  std::string missing;     // a kind of the target that was not measured
  int layers = 0;          // of the target
  double eager_ms = 0.0;   // embedding + every target layer at its kind's mean + head
  double graph_ms = 0.0;   // the measured graph step times eager_ms / the measured eager step
};

// measured: the checkpoint's config and its eager per-layer times (ms, layer order); embed_ms and
// head_ms as measured; graph_ms the measured graph step of the same batch.
inline StepProjection project_step(const MiniMaxM3Config& target, const MiniMaxM3Config& measured,
                                   const std::vector<double>& layer_ms, double embed_ms, double head_ms,
                                   double graph_ms) {
  StepProjection p;
  p.layers = target.num_hidden_layers;
  std::map<std::string, std::pair<double, int>> by_kind;  // sum, count
  double eager = embed_ms + head_ms;
  for (int l = 0; l < measured.num_hidden_layers && size_t(l) < layer_ms.size(); ++l) {
    auto& k = by_kind[layer_kind(measured, l)];
    k.first += layer_ms[size_t(l)];
    k.second += 1;
    eager += layer_ms[size_t(l)];
  }
  double total = embed_ms + head_ms;
  for (int l = 0; l < target.num_hidden_layers; ++l) {
    const std::string kind = layer_kind(target, l);
    auto it = by_kind.find(kind);
    if (it == by_kind.end()) {
      p.missing = kind;
      return p;
    }
    total += it->second.first / it->second.second;
  }
  p.ok = eager > 0.0;
  p.eager_ms = total;
  p.graph_ms = p.ok ? graph_ms * total / eager : 0.0;
  return p;
}

}  // namespace m3::bench
