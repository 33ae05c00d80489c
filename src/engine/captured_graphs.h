#pragma once
// Work replayed as backend graphs, keyed by its shape (batch bucket, tokens per sequence, ...):
// the first run of a key is eager and is then captured (not run) for later runs of that key, the
// eager run's dispatch selections standing for the graph's in the dispatch counts.
#include <functional>
#include <map>
#include <utility>
#include <vector>

#include "ops/ops.h"
#include "ops/runtime.h"

namespace m3 {

template <class Key>
class CapturedGraphs {
 public:
  // pass(ctx) eagerly when `graph` is false; else key's graph replayed, or pass run eagerly and
  // captured when the key is new. Everything pass issues must read and write fixed addresses.
  void run(ops::BackendRuntime* rt, const ops::OpContext& ctx, bool graph, const Key& key,
           const std::function<void(const ops::OpContext&)>& pass) {
    auto it = graph ? graphs_.find(key) : graphs_.end();
    if (it != graphs_.end()) {
      if (ctx.stats) ctx.stats->replay(it->second.selections);
      rt->replay(it->second.id);
      return;
    }
    if (graph && ctx.stats) ctx.stats->begin_recording();
    pass(ctx);
    if (!graph) return;
    Graph g;
    if (ctx.stats) g.selections = ctx.stats->end_recording();
    ops::OpContext quiet = ctx;
    quiet.stats = nullptr;
    g.id = rt->capture([&] { pass(quiet); });
    graphs_.emplace(key, std::move(g));
  }

 private:
  struct Graph {
    int id = -1;
    std::vector<ops::DispatchStats::Selection> selections;
  };
  std::map<Key, Graph> graphs_;
};

}  // namespace m3
