#pragma once

// A simulated SGLang worker speaking the subset of the native API the gateway uses: /generate
// and the OpenAI-compatible completions (streaming and not), /abort_request by rid, with a
// per-worker LRU prefix cache over token ids, pause/continue and update_weights_from_disk in place,
// deterministic routed experts, and injectable failures.

#include <httplib.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "gateway/radix_cache.h"
#include "gateway/routed_experts.h"

namespace bragg::gateway {

struct SimWorkerOptions {
  std::string host = "127.0.0.1";
  int port = 0;                           // 0: any free port
  size_t cache_tokens = size_t{1} << 22;  // prefix cache capacity in tokens (LRU beyond)
  uint64_t seed = 0;                      // output tokens depend on (seed, prompt, step) only
  double prefill_us_per_token = 0;        // cost model: sleep per uncached prompt token
  double decode_us_per_token = 0;         // and per output token
  MoeShape moe;
  std::string model_path = "sim-model";
  std::string weight_version = "0";
  int vocab = 32000;
  size_t max_threads = 8192;
  // Answer every /generate at once with a fixed body (a no-op worker for overhead benchmarks).
  bool noop = false;
  // When not empty, every call but /health, /health_generate and the /sim/ test knobs needs
  // "Authorization: Bearer <api_key>" (401 otherwise), as SGLang's --api-key.
  std::string api_key;
};

// Owns an HTTP server on its own thread. Start/Stop from one thread; handlers are thread-safe.
class SimWorker {
 public:
  explicit SimWorker(SimWorkerOptions options);
  ~SimWorker();
  SimWorker(const SimWorker&) = delete;
  SimWorker& operator=(const SimWorker&) = delete;

  // Binds and serves in a background thread. Unavailable if the port cannot be bound.
  Status Start();
  // Serves on the calling thread until Stop (from a signal thread) or an error.
  Status Run();
  void Stop();
  int port() const { return port_; }
  std::string url() const;

 private:
  struct GenerateJob;
  void Register();
  void HandleGenerate(const httplib::Request& req, httplib::Response& res);
  // Runs one generation; `emit` sees each step's cumulative output (return false to abort).
  nlohmann::json Generate(GenerateJob& job, const std::function<bool(const nlohmann::json&)>& emit);
  std::string VersionName(uint32_t id);

  SimWorkerOptions options_;
  httplib::Server server_;
  std::thread thread_;
  int port_ = 0;

  std::mutex mu_;
  std::condition_variable resumed_;
  RadixCache cache_;
  bool paused_ = false;
  std::string version_;
  std::string model_path_;
  std::unordered_map<uint32_t, std::string> version_names_;  // VersionId -> name, for spans
  std::set<std::string> aborted_;
  // The rids /abort_request named, oldest first (the last kAbortedRidsKept), for tests.
  static constexpr size_t kAbortedRidsKept = 1024;
  std::deque<std::string> aborted_rids_;
  std::mt19937_64 rng_;
  double error_rate_ = 0;
  bool fail_update_ = false;
  int fail_update_after_ = -1;   // loads that still succeed before every later one fails; -1: off
  bool fail_continue_ = false;   // continue_generation answers 500 and the worker stays paused
  int update_delay_ms_ = 0;      // update_weights_from_disk takes this long
  int drop_update_replies_ = 0;  // loads that apply but whose answer is cut off
  bool healthy_ = true;
  int health_delay_ms_ = 0;  // /health answers after this long
  uint64_t requests_ = 0;
  uint64_t aborts_ = 0;
  uint64_t updates_ = 0;
  uint64_t flushes_ = 0;
  uint64_t unauthorized_ = 0;       // calls refused for a missing or wrong API key
  std::string last_authorization_;  // the Authorization header of the last authorized call
  nlohmann::json last_request_;
  std::atomic<uint64_t> rid_counter_{0};
};

}  // namespace bragg::gateway
