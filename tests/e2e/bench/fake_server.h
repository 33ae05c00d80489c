#pragma once
// Starts tests/e2e/bench/fake_openai_server.py (stdlib Python) on a free port for the
// bench clients' end-to-end tests, and stops it (by its pid) when destroyed.
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

namespace m3::bench::testing {

class FakeOpenAiServer {
 public:
  // nullptr when python3 or the script is unavailable (the caller skips).
  static std::unique_ptr<FakeOpenAiServer> start(const std::string& answers_jsonl) {
    const char* src = std::getenv("M3_SOURCE_DIR");
    const std::string script = std::string(src ? src : ".") + "/tests/e2e/bench/fake_openai_server.py";
    if (!std::ifstream(script)) return nullptr;
    int fds[2];
    if (pipe(fds) != 0) return nullptr;
    const pid_t pid = fork();
    if (pid < 0) return nullptr;
    if (pid == 0) {
      dup2(fds[1], STDOUT_FILENO);
      close(fds[0]);
      close(fds[1]);
      execlp("python3", "python3", script.c_str(), answers_jsonl.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    close(fds[1]);
    std::unique_ptr<FakeOpenAiServer> server(new FakeOpenAiServer(pid));
    FILE* out = fdopen(fds[0], "r");
    char line[64] = {0};
    const bool got = out != nullptr && std::fgets(line, sizeof(line), out) != nullptr;
    if (out != nullptr) std::fclose(out);
    if (!got || std::atoi(line) <= 0) return nullptr;  // destructor reaps the child
    server->port_ = std::atoi(line);
    return server;
  }
  ~FakeOpenAiServer() {
    kill(pid_, SIGTERM);
    waitpid(pid_, nullptr, 0);
  }
  int port() const { return port_; }
  std::string base_url() const { return "http://127.0.0.1:" + std::to_string(port_); }

 private:
  explicit FakeOpenAiServer(pid_t pid) : pid_(pid) {}
  pid_t pid_;
  int port_ = 0;
};

// A small GSM8K-format data dir: 6 train and 5 test examples.
inline std::string write_mini_gsm8k(const std::string& dir) {
  std::system(("mkdir -p '" + dir + "'").c_str());
  std::ofstream train(dir + "/train.jsonl");
  for (int i = 0; i < 6; ++i) {
    train << "{\"question\": \"Train question " << i << "?\", \"answer\": \"It is " << i << ".\\n#### " << i << "\"}\n";
  }
  std::ofstream test(dir + "/test.jsonl");
  const int answers[] = {72, 10, 1234, 5, 0};
  for (int i = 0; i < 5; ++i) {
    test << "{\"question\": \"How many apples in basket " << i << "?\", \"answer\": \"Count them.\\n#### "
         << (answers[i] == 1234 ? std::string("1,234") : std::to_string(answers[i])) << "\"}\n";
  }
  return dir + "/test.jsonl";
}

// A tiny agentic trace: 64-token blocks, one sub-agent; 900 input tokens of which 384
// are prefix hits for an infinite cache serving in order.
inline std::string write_mini_trace(const std::string& path) {
  std::ofstream(path) << R"({"id": "mini", "block_size": 64, "hash_id_scope": "local", "requests": [
    {"t": 0.0, "type": "n", "in": 200, "out": 3, "hash_ids": [1, 2, 3]},
    {"t": 0.01, "type": "n", "in": 300, "out": 3, "hash_ids": [1, 2, 3, 4]},
    {"t": 0.02, "type": "subagent", "agent_id": "a1", "requests": [
      {"t": 0.0, "type": "n", "in": 140, "out": 2, "hash_ids": [1, 9]}]},
    {"t": 0.05, "type": "n", "in": 260, "out": 3, "hash_ids": [1, 2, 5, 6]}]})";
  return path;
}

}  // namespace m3::bench::testing
