#pragma once

// bragg-gateway: an HTTP front for a pool of SGLang workers. Routes /generate (and the
// OpenAI-compatible endpoints) by policy, keeps rollouts sticky, pairs prefill and decode workers,
// runs fleet-wide in-place weight updates, and exports Prometheus metrics.

#include <httplib.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "gateway/async_http.h"
#include "gateway/http_util.h"
#include "gateway/router.h"

namespace bragg::gateway {

struct GatewayOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: any free port
  // Regular workers ("http://127.0.0.1:PORT"); more can be registered with POST /workers.
  std::vector<std::string> workers;
  // Prefill/decode disaggregation: when both are given, every /generate goes to one pair.
  std::vector<std::string> prefill_workers;
  std::vector<std::string> decode_workers;
  int bootstrap_port = 8998;  // the prefill workers' KV bootstrap port
  // Data-parallel-attention ranks per worker; above 1, every request of a rollout carries the
  // same routed_dp_rank (unless the client set one).
  int dp_size = 1;
  RouterOptions router;
  int health_interval_ms = 1000;
  // Consecutive failed health checks before a worker is taken out of rotation: one slow answer
  // from a loaded worker must not move its rollouts. A refused connection on a request still
  // takes it out at once.
  int health_failures = 3;
  // Event-loop threads serving clients and proxying to workers; 0: one per core.
  int io_threads = 0;
  // Threads for handlers that block (weight updates), grown on demand up to this.
  size_t max_threads = 16384;
  // Largest request body accepted (413 beyond it); the body is held and parsed in memory.
  size_t max_body_bytes = size_t{64} << 20;
  // Largest buffered worker response (502 beyond it); streamed bodies pass through unbuffered.
  size_t max_upstream_response_bytes = size_t{1} << 30;
  // Pooled keep-alive worker connections idle longer than this are closed, not reused: well
  // below the workers' own keep-alive timeout (uvicorn's default is 5 s), so that a worker never
  // closes one just as it is reused.
  int upstream_idle_ms = 2000;
};

// Per-worker outcome of a fleet weight update.
struct WorkerUpdate {
  std::string url;
  std::string previous_version;
  bool paused = false;
  bool loaded = false;
  bool rolled_back = false;
  bool continued = false;
  // Taken out of rotation (quarantined): could not be brought back to the fleet's version, or
  // may still be paused. Only the health loop brings it back, once /get_model_info reports the
  // fleet's version and continue_generation succeeded.
  bool removed = false;
  std::string version_after;  // /get_model_info's weight_version after a failed update
  std::string error;
};

struct WeightUpdateReport {
  bool success = false;
  std::string weight_version;
  std::vector<WorkerUpdate> workers;
  nlohmann::json ToJson() const;
};

// Owns its event-driven HTTP server (async_http.h) and a health-check thread. Start/Stop from one
// thread; the handlers and UpdateWeights are thread-safe (updates are serialized).
class Gateway {
 public:
  explicit Gateway(GatewayOptions options);
  ~Gateway();
  Gateway(const Gateway&) = delete;
  Gateway& operator=(const Gateway&) = delete;

  // Binds and serves on background threads. InvalidArgument for a bad worker URL, Unavailable
  // if the port cannot be bound.
  Status Start();
  void Stop();
  int port() const { return port_; }
  // Event-loop threads serving clients (valid after Start).
  int io_threads() const;

  // Pauses every healthy worker in place, loads `model_path` as `version` without flushing the
  // KV cache, and continues them. New rollouts are salted with `version` from the moment every
  // worker is paused. If any pause or load fails, the workers that loaded (or may have) go back
  // to their previous weights and all continue on the old version (success false). success is
  // also false when a worker could not be continued. After any failure every worker's
  // /get_model_info is read again, and those not on the fleet's version are quarantined.
  WeightUpdateReport UpdateWeights(const std::string& model_path, const std::string& version);

 private:
  struct Pool {
    explicit Pool(std::string n, RouterOptions o) : name(std::move(n)), router(std::move(o)) {}
    std::string name;
    Router router;
    std::mutex mu;
    std::deque<std::unique_ptr<ClientPool>> clients;  // by worker index
    std::deque<std::string> urls;
    std::deque<std::string> versions;  // last known weight version per worker
    std::deque<int> health_failures;   // consecutive failed health checks per worker
    // Taken out by a weight update or a version check: the health loop admits it only after
    // a version check (and a continue_generation when it may be paused).
    std::deque<bool> quarantined;
    std::deque<bool> needs_continue;  // may still be paused by a failed update
  };
  struct Upstream {
    httplib::Error error = httplib::Error::Success;
    int status = 0;
    std::string body;
  };
  struct Target {
    Pool* pool;
    int worker;
    std::string url;
  };

  Status AddWorker(Pool& pool, const std::string& url, bool healthy);
  ClientPool* Client(Pool& pool, int worker);
  Upstream Post(Pool& pool, int worker, const std::string& path, const std::string& body);
  void MarkDown(Pool& pool, int worker, std::string_view why);
  // Takes `worker` out until the health loop admits it again (see Admit).
  void Quarantine(Pool& pool, int worker, std::string_view why, bool needs_continue);
  // Health loop: continues a worker that may be paused, then checks that /get_model_info
  // reports the fleet's version (the first version read becomes the fleet's when none is known
  // yet). True when the worker may serve; clears its quarantine then.
  bool Admit(Pool& pool, int worker, httplib::Client& c);
  // Reads the fleet's weight version from the workers at startup; those on another version are
  // quarantined.
  void ReadFleetVersion();
  std::vector<Target> HealthyTargets();
  void Register();
  struct Generate;   // one /generate or OpenAI request being routed
  struct PdPrefill;  // the prefill half of a prefill/decode pair
  Action HandleGenerate(HttpRequest& req);
  // Routes `g` (to the decode pool for a pair) and forwards it; after a refused connection,
  // routes it again.
  Action RouteAndForward(std::shared_ptr<Generate> g);
  // Forwards `g` to the worker `d` chose; the completion accounts the request, aborts it on
  // every worker after a hang-up, and routes it again after a refused connection.
  Action ForwardTo(std::shared_ptr<Generate> g, const RouteDecision& d);
  // Routes a prefill/decode pair, sends the prefill half, forwards the decode half.
  Action StartPd(std::shared_ptr<Generate> g);
  // Asks every worker `g` was sent to and that may still work on it to drop it (by its rid).
  void AbortUpstream(const Generate& g, const HostPort& target);
  Action HandleOpenAi(HttpRequest& req);
  std::string NewRid();
  std::string Metrics();
  void HealthLoop();

  GatewayOptions options_;
  std::unique_ptr<AsyncHttpServer> server_;
  std::thread health_thread_;
  int port_ = 0;
  std::unique_ptr<Pool> main_;
  std::unique_ptr<Pool> prefill_;
  std::unique_ptr<Pool> decode_;

  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stopping_ = false;

  std::mutex update_mu_;  // one fleet update at a time
  std::mutex rng_mu_;
  std::mt19937_64 rng_;
  // Request ids the gateway gives requests without one: "gw-<instance>-<n>", the instance
  // random per process so that a restarted gateway does not reuse ids workers may still hold.
  uint64_t rid_instance_ = 0;
  std::atomic<uint64_t> rid_counter_{0};
  std::atomic<uint64_t> client_aborts_{0};
  std::atomic<uint64_t> upstream_errors_{0};
  std::atomic<uint64_t> weight_updates_ok_{0};
  std::atomic<uint64_t> weight_updates_failed_{0};
  std::mutex version_mu_;
  std::string fleet_version_;  // the version every worker in rotation must report
  std::string salt_version_;   // the version new rollouts are salted with; under update_mu_
};

}  // namespace bragg::gateway
