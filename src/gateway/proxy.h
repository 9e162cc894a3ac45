#pragma once

// Forwarding routed requests to workers: picks the worker with the pool's Router, sends the
// request through the event-driven server (async_http.h), accounts it when it ends, routes it
// again after a refused connection, aborts it on every worker after a client hang-up, and pairs
// prefill and decode workers (docs/gateway.md, "Prefill/decode disaggregation").

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <string>

#include "gateway/async_http.h"
#include "gateway/fleet.h"
#include "gateway/request.h"

namespace bragg::gateway {

struct ProxyOptions {
  // Prefill/decode disaggregation: every /generate goes to a prefill/decode pair instead of the
  // main pool.
  bool disaggregated = false;
  int bootstrap_port = 8998;  // the prefill workers' KV bootstrap port
};

// Thread-safe: Forward runs on the server's io threads. `*fleet` and `*server` must outlive it;
// the completions it hands `*server` refer to it, so it must also outlive the server's Stop.
class Proxy {
 public:
  Proxy(ProxyOptions options, Fleet* fleet, AsyncHttpServer* server);
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  // Routes `request` and returns the Action that forwards it (to a prefill/decode pair when
  // disaggregated), or answers 400 (a batch to a pair) or 503 (no worker).
  Action Serve(Request request);
  // A new request id: "gw-<16 hex digits random per process>-<counter>", so that a restarted
  // gateway does not reuse ids workers may still hold.
  std::string NewRid();

  uint64_t client_aborts() const { return client_aborts_.load(); }
  uint64_t upstream_errors() const { return upstream_errors_.load(); }

 private:
  struct Generate;   // one request being routed
  struct PdPrefill;  // the prefill half of a prefill/decode pair
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

  const ProxyOptions options_;
  Fleet* const fleet_;
  AsyncHttpServer* const server_;
  std::mutex rng_mu_;
  std::mt19937_64 rng_;  // bootstrap rooms; under rng_mu_
  uint64_t rid_instance_ = 0;
  std::atomic<uint64_t> rid_counter_{0};
  std::atomic<uint64_t> client_aborts_{0};
  std::atomic<uint64_t> upstream_errors_{0};
};

}  // namespace bragg::gateway
