#pragma once

// Routing decisions for one pool of workers: which worker serves a /generate request. Pure logic,
// no I/O, so the gateway, the benchmark and the unit tests drive the same code.

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "gateway/radix_cache.h"

namespace bragg::gateway {

enum class Policy {
  kSticky,      // every turn of a rollout on the worker of its previous turn (default for RL)
  kCacheAware,  // best approximate prefix match with bounded load, ties to the least loaded
  kRoundRobin,
  kLeastLoad,
  kSglCacheAware,  // sgl-router's cache_aware rules, for comparison (benchmark baseline)
};

// "sticky", "cache_aware", "round_robin", "least_load", "sgl_cache_aware", and sgl-router's
// "manual" (sticky) and "power_of_two" (least_load); InvalidArgument else (sgl-router's "random"
// and "bucket" included, with what to use instead).
Result<Policy> ParsePolicy(std::string_view name);
std::string_view PolicyName(Policy policy);

struct RouterOptions {
  Policy policy = Policy::kSticky;
  // sgl-router's defaults: cache_threshold, balance_abs_threshold, balance_rel_threshold.
  double cache_threshold = 0.3;
  int64_t balance_abs_threshold = 64;
  double balance_rel_threshold = 1.5;
  // Tokens each worker's approximate tree keeps (LRU beyond it).
  size_t tree_capacity_tokens = size_t{1} << 22;
  // A new rollout (or, for cache_aware, any request) only goes to a worker whose load (live
  // rollouts; in-flight requests for cache_aware) is below max(min + load_slack,
  // factor * min), min being the least loaded worker's: cache affinity within bounded load.
  double bounded_load_factor = 1.25;
  int64_t load_slack = 2;
  // A match counts as "as good as the best" within this fraction of the best match length, so
  // identical shared prefixes (a long system prompt) spread by load instead of piling up.
  double match_slack = 0.02;
  // Rollouts remembered for stickiness; the least recently used are forgotten beyond this.
  size_t max_rollouts = size_t{1} << 20;
};

struct RouteDecision {
  int worker = -1;
  std::string reason;          // "sticky", "new_cache", "new_load", "failover", "round_robin", ...
  std::string salt;            // cache salt (extra_key) for this request, empty for none
  bool moved = false;          // the rollout left a dead worker on this request
  size_t expected_cached = 0;  // approximate tree's prefix match on the chosen worker
};

struct WorkerSnapshot {
  std::string url;
  bool healthy = true;
  int64_t in_flight = 0;
  int64_t rollouts = 0;
  uint64_t requests = 0;
  uint64_t prompt_tokens = 0;
  uint64_t cached_tokens = 0;
  uint64_t moved_out = 0;  // sticky rollouts moved off this worker because it went down
  bool removed = false;    // removed from the fleet (RemoveWorker); listed nowhere
};

struct Worker;  // fleet.h: the one record per worker

// Thread-safe (one internal mutex). Workers are numbered in the order they are added; a removed
// worker keeps its number and record (requests in flight on it still Finish) and gets no
// requests, like an unhealthy one; an unhealthy worker gets no requests. The Router owns each
// worker's record (fleet.h) and guards its routing part (url, healthy, stats, tree) with its mutex.
class Router {
 public:
  explicit Router(RouterOptions options);
  ~Router();
  Router(const Router&) = delete;
  Router& operator=(const Router&) = delete;

  // Adds a worker and returns its index; an existing url returns its index (its health
  // unchanged, unless it was removed: then it is a member again, with health `healthy`). A worker
  // added unhealthy gets no request until SetHealthy(true). `*added` (if given): whether the
  // worker became a member now (new, or added again after a removal).
  int AddWorker(std::string url, bool healthy = true, bool* added = nullptr);
  // No effect on a removed worker.
  void SetHealthy(int worker, bool healthy);
  // Takes `worker` out for good (until added again): no new requests, its rollouts move on
  // their next turn as from a dead worker. False when there is no such member.
  bool RemoveWorker(int worker);
  // Weight version new rollouts start on; it salts their cache (extra_key "wv:<version>").
  void SetFleetVersion(std::string version);

  // Picks a worker for a request of rollout `key` (empty: not part of a rollout) with prompt
  // `tokens`. `client_salt`, if not empty, is the client's own extra_key; it is combined with
  // the version salt ("<client_salt>|wv:<version>"), so that a client's own key never lets a
  // rollout reuse KV computed by other weights. Counts the request in flight on the chosen worker
  // until Finish. Unavailable when no worker is healthy.
  Result<RouteDecision> Route(std::string_view key, std::span<const int32_t> tokens,
                              std::string_view client_salt = {});
  // Ends a request Route sent to `worker`, with the token counts the worker reported.
  void Finish(int worker, uint64_t prompt_tokens, uint64_t cached_tokens);
  // Forgets rollout `key` (it finished).
  void Forget(std::string_view key);

  // The record of `worker`, nullptr when there is none; it lives as long as the Router. Only its
  // owner's part (fleet.h: client, version, health and quarantine fields, under the Pool's
  // mutex) and its url (never changed once added) may be used outside the Router.
  Worker* record(int worker);

  std::vector<WorkerSnapshot> Snapshot() const;
  std::map<std::string, uint64_t> DecisionCounts() const;
  size_t num_workers() const;

 private:
  struct Rollout {
    int worker = -1;
    std::string salt;
    std::list<std::string>::iterator lru;
  };

  int PickNew(std::span<const int32_t> salted, bool by_rollouts, std::string* reason,
              size_t* match);
  int PickSgl(std::span<const int32_t> salted, std::string* reason, size_t* match);
  int PickLeastLoad() const;
  bool AnyHealthy() const;

  const RouterOptions options_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::unordered_map<std::string, Rollout> rollouts_;
  std::list<std::string> rollout_lru_;
  std::map<std::string, uint64_t> decisions_;
  std::string fleet_version_;
  size_t rr_next_ = 0;
  std::vector<int32_t> scratch_;
};

// Token id standing for cache salt `salt` at the front of a sequence (negative, never a real
// token id).
int32_t SaltToken(std::string_view salt);

}  // namespace bragg::gateway
