#include "backend/cpu/cpu_parallel.h"

#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace m3::cpu {
namespace {

std::atomic<int> g_override{0};

int default_threads() {
  static const int n = [] {
    if (const char* env = std::getenv("M3_CPU_THREADS")) {
      const int v = std::atoi(env);
      if (v > 0) return v;
    }
    return std::max(1, int(std::thread::hardware_concurrency()));
  }();
  return n;
}

thread_local bool t_in_body = false;  // a body's own calls must not wait on the pool that runs it

void run_body(const std::function<void()>& body) {
  const bool was = t_in_body;
  t_in_body = true;
  body();
  t_in_body = was;
}

// Workers sleep on a condition variable between calls; a call publishes its body under a new
// generation number, wakes them, runs the body itself and waits until the helpers it asked for
// are done. Idle workers cost nothing but their stacks.
class Pool {
 public:
  static Pool& instance() {
    static Pool* pool = new Pool;  // never destroyed: workers may still sleep at exit
    return *pool;
  }

  // False when another caller holds the pool.
  bool try_run(int threads, const std::function<void()>& body) {
    std::unique_lock<std::mutex> owner(owner_, std::try_to_lock);
    if (!owner.owns_lock()) return false;
    const int helpers = threads - 1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (; workers_ < helpers; ++workers_) std::thread([this, index = workers_] { work(index); }).detach();
      body_ = &body;
      helpers_ = helpers;
      pending_ = helpers;
      ++generation_;
    }
    wake_.notify_all();
    run_body(body);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return pending_ == 0; });
    body_ = nullptr;
    return true;
  }

 private:
  void work(int index) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      wake_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (index >= helpers_) continue;  // not asked this time
      const std::function<void()>* body = body_;
      lock.unlock();
      run_body(*body);
      lock.lock();
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex owner_;  // one caller at a time
  std::mutex mu_;
  std::condition_variable wake_, done_;
  int workers_ = 0;  // started so far (detached: they sleep between calls and live until exit)
  const std::function<void()>* body_ = nullptr;
  uint64_t generation_ = 0;
  int helpers_ = 0, pending_ = 0;
};

}  // namespace

int cpu_threads() {
  const int o = g_override.load(std::memory_order_relaxed);
  return o > 0 ? o : default_threads();
}

void set_cpu_threads(int n) { g_override.store(n > 0 ? n : 0, std::memory_order_relaxed); }

void run_on_threads(int threads, const std::function<void()>& body) {
  if (threads <= 1) return body();
  if (!t_in_body && Pool::instance().try_run(threads, body)) return;
  std::vector<std::thread> own;
  own.reserve(size_t(threads - 1));
  for (int t = 1; t < threads; ++t) own.emplace_back([&body] { run_body(body); });
  run_body(body);
  for (auto& th : own) th.join();
}

}  // namespace m3::cpu
