#pragma once

// bragg-gateway: an HTTP front for a pool of SGLang workers. Routes /generate (and the
// OpenAI-compatible endpoints) by policy, keeps rollouts sticky, pairs prefill and decode workers,
// runs fleet-wide in-place weight updates, and exports Prometheus metrics.

#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "gateway/async_http.h"
#include "gateway/fleet.h"
#include "gateway/health.h"
#include "gateway/proxy.h"
#include "gateway/request.h"
#include "gateway/router.h"
#include "gateway/weights.h"

namespace bragg::gateway {

struct GatewayOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0: any free port
  // Regular workers ("http://127.0.0.1:PORT"); more can be registered with POST /workers.
  std::vector<std::string> workers;
  // Prefill/decode disaggregation: when both are given, every /generate goes to one pair.
  std::vector<std::string> prefill_workers;
  // KV bootstrap port per prefill worker, in order (sgl-router's `--prefill URL PORT`); missing
  // or -1: `bootstrap_port`.
  std::vector<int> prefill_bootstrap_ports;
  std::vector<std::string> decode_workers;
  // Prefill/decode mode even with no worker given at start (they come with POST /add_worker).
  bool pd_disaggregation = false;
  int bootstrap_port = 8998;  // the prefill workers' KV bootstrap port
  // When not empty, every request but /health, /metrics and the read-only worker queries
  // (/v1/models, /get_model_info, /get_server_info) must carry "Authorization: Bearer
  // <api_key>" (401 otherwise).
  std::string api_key;
  // Sent to every worker as "Authorization: Bearer <worker_api_key>" when not empty.
  std::string worker_api_key;
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

  // The fleet-wide in-place weight update (WeightUpdater::Update). Blocks.
  WeightUpdateReport UpdateWeights(const std::string& model_path, const std::string& version);

 private:
  // /generate and the OpenAI endpoints: parsed (400 when malformed), then routed and forwarded.
  Action Handle(Endpoint endpoint, HttpRequest& req);
  void Register();
  // sgl-router's worker management and fan-out calls (docs/gateway.md, "Drop-in for
  // sgl-router").
  void RegisterSglRouter();
  // Serves `method` `path`; unless `open`, only with the API key (when one is set).
  void Route(const std::string& method, const std::string& path, Handler handler,
             bool open = false);
  // Serves `method` on every path under `prefix` (AsyncHttpServer::RoutePrefix), with the API
  // key (when one is set).
  void RoutePrefix(const std::string& method, const std::string& prefix, Handler handler);
  // `handler`, behind the API key check unless `open` or no key is set.
  Handler Guard(Handler handler, bool open);
  // Every member worker as GET /workers lists it: sgl-router's WorkerInfo fields (id, url,
  // model_id, priority, cost, worker_type, is_healthy, load, connection_mode[, bootstrap_port])
  // and Bragg's (pool, healthy, in_flight, rollouts, requests, weight_version), pool by pool.
  nlohmann::json WorkerInfos();
  // The member whose id (as WorkerInfos gives it) or url (canonicalized) is `id_or_url`.
  std::optional<nlohmann::json> FindWorker(const std::string& id_or_url);
  // Registers `url` in the pool of `worker_type` ("", "regular", "prefill", "decode") at run
  // time, out of rotation until the health loop admits it. Returns whether it is new (false: a
  // member already). InvalidArgument for a bad url, type or port, or a type this mode lacks.
  Result<bool> AddWorker(const std::string& url, const std::string& worker_type,
                         int bootstrap_port);
  bool disaggregated() const;

  GatewayOptions options_;
  std::unique_ptr<AsyncHttpServer> server_;
  Fleet fleet_;
  WeightUpdater weights_;
  Proxy proxy_;
  HealthChecker health_;
  int port_ = 0;
};

}  // namespace bragg::gateway
