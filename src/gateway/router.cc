#include "gateway/router.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "gateway/fleet.h"

namespace bragg::gateway {

Result<Policy> ParsePolicy(std::string_view name) {
  if (name == "sticky") {
    return Policy::kSticky;
  }
  if (name == "cache_aware") {
    return Policy::kCacheAware;
  }
  if (name == "round_robin") {
    return Policy::kRoundRobin;
  }
  if (name == "least_load") {
    return Policy::kLeastLoad;
  }
  if (name == "sgl_cache_aware") {
    return Policy::kSglCacheAware;
  }
  // sgl-router's names: "manual" pins a routing key to a worker, as sticky does; power_of_two
  // sends to the less loaded of two random workers, least_load to the least loaded of all.
  if (name == "manual") {
    return Policy::kSticky;
  }
  if (name == "power_of_two") {
    return Policy::kLeastLoad;
  }
  if (name == "random" || name == "bucket") {
    return absl::InvalidArgumentError(fmt::format(
        "sgl-router's policy '{}' has no counterpart here: use sticky (the default; sgl-router's "
        "manual), cache_aware, sgl_cache_aware (sgl-router's cache_aware), round_robin or "
        "least_load (power_of_two)",
        name));
  }
  return absl::InvalidArgumentError(fmt::format(
      "unknown routing policy '{:.64}': use sticky, cache_aware, sgl_cache_aware, round_robin or "
      "least_load",
      name));
}

std::string_view PolicyName(Policy policy) {
  switch (policy) {
    case Policy::kSticky:
      return "sticky";
    case Policy::kCacheAware:
      return "cache_aware";
    case Policy::kRoundRobin:
      return "round_robin";
    case Policy::kLeastLoad:
      return "least_load";
    case Policy::kSglCacheAware:
      return "sgl_cache_aware";
  }
  return "unknown";
}

int32_t SaltToken(std::string_view salt) {
  // FNV-1a: stable across runs and processes, unlike std::hash.
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : salt) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return -1 - static_cast<int32_t>(h % (uint64_t{1} << 30));
}

Router::Router(RouterOptions options) : options_(std::move(options)) {}

Router::~Router() = default;

Worker* Router::record(int worker) {
  std::lock_guard<std::mutex> lock(mu_);
  if (worker < 0 || static_cast<size_t>(worker) >= workers_.size()) {
    return nullptr;
  }
  return workers_[worker].get();
}

int Router::AddWorker(std::string url, bool healthy, bool* added) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < workers_.size(); ++i) {
    Worker& w = *workers_[i];
    if (w.url == url) {
      if (added != nullptr) {
        *added = w.removed;
      }
      if (w.removed) {
        // Registered again after a removal: a new member, its cache cold.
        w.removed = false;
        w.healthy = healthy;
        w.stats.removed = false;
      }
      return static_cast<int>(i);
    }
  }
  if (added != nullptr) {
    *added = true;
  }
  workers_.push_back(std::make_unique<Worker>(url, options_.tree_capacity_tokens));
  workers_.back()->healthy = healthy;
  workers_.back()->stats.url = std::move(url);
  return static_cast<int>(workers_.size() - 1);
}

void Router::SetHealthy(int worker, bool healthy) {
  std::lock_guard<std::mutex> lock(mu_);
  if (worker < 0 || static_cast<size_t>(worker) >= workers_.size()) {
    return;
  }
  Worker& w = *workers_[worker];
  if (w.removed) {
    return;
  }
  if (w.healthy && !healthy) {
    // Its KV cache is gone with it; a returning worker starts cold.
    w.tree.Clear();
  }
  w.healthy = healthy;
}

bool Router::RemoveWorker(int worker) {
  std::lock_guard<std::mutex> lock(mu_);
  if (worker < 0 || static_cast<size_t>(worker) >= workers_.size() || workers_[worker]->removed) {
    return false;
  }
  Worker& w = *workers_[worker];
  w.removed = true;
  w.stats.removed = true;
  w.healthy = false;
  w.tree.Clear();
  return true;
}

void Router::SetFleetVersion(std::string version) {
  std::lock_guard<std::mutex> lock(mu_);
  fleet_version_ = std::move(version);
}

size_t Router::num_workers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return workers_.size();
}

bool Router::AnyHealthy() const {
  for (const auto& w : workers_) {
    if (w->healthy) {
      return true;
    }
  }
  return false;
}

int Router::PickLeastLoad() const {
  int best = -1;
  for (size_t i = 0; i < workers_.size(); ++i) {
    const Worker& w = *workers_[i];
    if (!w.healthy) {
      continue;
    }
    if (best < 0 || w.stats.in_flight < workers_[best]->stats.in_flight) {
      best = static_cast<int>(i);
    }
  }
  return best;
}

int Router::PickNew(std::span<const int32_t> salted, bool by_rollouts, std::string* reason,
                    size_t* match) {
  auto load = [&](const Worker& w) { return by_rollouts ? w.stats.rollouts : w.stats.in_flight; };
  int64_t min_load = -1;
  for (const auto& w : workers_) {
    if (w->healthy) {
      min_load = min_load < 0 ? load(*w) : std::min(min_load, load(*w));
    }
  }
  // Bounded load relative to the least loaded worker: a shared system prompt matches everywhere
  // it was seen, and bounding by the mean would still let it drain one worker.
  int64_t limit = std::max(min_load + options_.load_slack,
                           static_cast<int64_t>(std::ceil(options_.bounded_load_factor *
                                                          static_cast<double>(min_load))));
  std::vector<size_t> matches(workers_.size(), 0);
  size_t best = 0;
  for (size_t i = 0; i < workers_.size(); ++i) {
    Worker& w = *workers_[i];
    if (!w.healthy || load(w) + 1 > limit) {
      continue;
    }
    matches[i] = w.tree.Peek(salted);
    best = std::max(best, matches[i]);
  }
  auto floor = static_cast<size_t>(static_cast<double>(best) * (1.0 - options_.match_slack));
  int pick = -1;
  for (size_t i = 0; i < workers_.size(); ++i) {
    Worker& w = *workers_[i];
    if (!w.healthy || load(w) + 1 > limit || matches[i] < floor) {
      continue;
    }
    // Equal load: the worker with the least cached (most free KV), as sgl-router's fallback.
    if (pick < 0 || load(w) < load(*workers_[pick]) ||
        (load(w) == load(*workers_[pick]) &&
         w.tree.size_tokens() < workers_[pick]->tree.size_tokens())) {
      pick = static_cast<int>(i);
    }
  }
  *match = pick >= 0 ? matches[pick] : 0;
  *reason = best > 0 ? "new_cache" : "new_load";
  return pick;
}

int Router::PickSgl(std::span<const int32_t> salted, std::string* reason, size_t* match) {
  int64_t max_load = -1;
  int64_t min_load = -1;
  for (const auto& w : workers_) {
    if (!w->healthy) {
      continue;
    }
    int64_t l = w->stats.in_flight;
    max_load = max_load < 0 ? l : std::max(max_load, l);
    min_load = min_load < 0 ? l : std::min(min_load, l);
  }
  bool imbalanced = (max_load - min_load) > options_.balance_abs_threshold &&
                    static_cast<double>(max_load) >
                        static_cast<double>(min_load) * options_.balance_rel_threshold;
  if (imbalanced) {
    *reason = "sgl_balance";
    int pick = PickLeastLoad();
    *match = workers_[pick]->tree.Peek(salted);
    return pick;
  }
  int best = -1;
  size_t best_match = 0;
  int smallest = -1;
  for (size_t i = 0; i < workers_.size(); ++i) {
    Worker& w = *workers_[i];
    if (!w.healthy) {
      continue;
    }
    size_t m = w.tree.Peek(salted);
    if (best < 0 || m > best_match) {
      best = static_cast<int>(i);
      best_match = m;
    }
    if (smallest < 0 || w.tree.size_tokens() < workers_[smallest]->tree.size_tokens()) {
      smallest = static_cast<int>(i);
    }
  }
  double rate =
      salted.empty() ? 0.0 : static_cast<double>(best_match) / static_cast<double>(salted.size());
  if (rate > options_.cache_threshold) {
    *reason = "sgl_cache";
    *match = best_match;
    return best;
  }
  *reason = "sgl_smallest_tree";
  *match = workers_[smallest]->tree.Peek(salted);
  return smallest;
}

Result<RouteDecision> Router::Route(std::string_view key, std::span<const int32_t> tokens,
                                    std::string_view client_salt) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!AnyHealthy()) {
    return absl::UnavailableError("no healthy worker: register one with --worker or POST /workers");
  }
  RouteDecision d;
  Rollout* rollout = nullptr;
  bool fresh = false;
  if (!key.empty()) {
    auto it = rollouts_.find(std::string(key));
    if (it == rollouts_.end()) {
      rollout_lru_.push_front(std::string(key));
      it = rollouts_.emplace(std::string(key), Rollout{}).first;
      it->second.lru = rollout_lru_.begin();
      it->second.salt = fleet_version_.empty() ? "" : "wv:" + fleet_version_;
      fresh = true;
      if (rollouts_.size() > options_.max_rollouts) {
        auto victim = rollouts_.find(rollout_lru_.back());
        if (victim->second.worker >= 0) {
          workers_[victim->second.worker]->stats.rollouts--;
        }
        rollouts_.erase(victim);
        rollout_lru_.pop_back();
      }
    } else {
      rollout_lru_.splice(rollout_lru_.begin(), rollout_lru_, it->second.lru);
    }
    rollout = &it->second;
    d.salt = rollout->salt;
  } else {
    d.salt = fleet_version_.empty() ? "" : "wv:" + fleet_version_;
  }
  if (!client_salt.empty()) {
    d.salt = d.salt.empty() ? std::string(client_salt) : fmt::format("{}|{}", client_salt, d.salt);
  }
  std::span<const int32_t> salted = tokens;
  if (!d.salt.empty()) {
    scratch_.clear();
    scratch_.push_back(SaltToken(d.salt));
    scratch_.insert(scratch_.end(), tokens.begin(), tokens.end());
    salted = scratch_;
  }

  int pick = -1;
  switch (options_.policy) {
    case Policy::kSticky:
      if (rollout != nullptr && !fresh && rollout->worker >= 0 &&
          workers_[rollout->worker]->healthy) {
        pick = rollout->worker;
        d.reason = "sticky";
      } else {
        pick = PickNew(salted, rollout != nullptr, &d.reason, &d.expected_cached);
        if (rollout != nullptr && !fresh && rollout->worker >= 0) {
          d.reason = "failover";
          d.moved = true;
        }
      }
      break;
    case Policy::kCacheAware:
      pick = PickNew(salted, false, &d.reason, &d.expected_cached);
      break;
    case Policy::kRoundRobin:
      for (size_t n = 0; n < workers_.size(); ++n) {
        size_t i = (rr_next_ + n) % workers_.size();
        if (workers_[i]->healthy) {
          pick = static_cast<int>(i);
          rr_next_ = i + 1;
          break;
        }
      }
      d.reason = "round_robin";
      break;
    case Policy::kLeastLoad:
      pick = PickLeastLoad();
      d.reason = "least_load";
      break;
    case Policy::kSglCacheAware:
      pick = PickSgl(salted, &d.reason, &d.expected_cached);
      break;
  }
  if (pick < 0) {
    return absl::UnavailableError("no healthy worker below its load bound");
  }
  Worker& w = *workers_[pick];
  if (rollout != nullptr && rollout->worker != pick) {
    if (rollout->worker >= 0) {
      workers_[rollout->worker]->stats.rollouts--;
      // Only a sticky rollout "moves" (off a dead worker); the other policies pick a worker per
      // request by design.
      if (d.moved) {
        workers_[rollout->worker]->stats.moved_out++;
      }
    }
    rollout->worker = pick;
    w.stats.rollouts++;
  }
  size_t had = w.tree.Insert(salted);
  d.expected_cached = had;
  if (!d.salt.empty() && d.expected_cached > 0) {
    d.expected_cached -= 1;
  }
  w.stats.in_flight++;
  w.stats.requests++;
  decisions_[d.reason]++;
  d.worker = pick;
  return d;
}

void Router::Finish(int worker, uint64_t prompt_tokens, uint64_t cached_tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  if (worker < 0 || static_cast<size_t>(worker) >= workers_.size()) {
    return;
  }
  WorkerSnapshot& s = workers_[worker]->stats;
  s.in_flight--;
  s.prompt_tokens += prompt_tokens;
  s.cached_tokens += cached_tokens;
}

void Router::Forget(std::string_view key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = rollouts_.find(std::string(key));
  if (it == rollouts_.end()) {
    return;
  }
  if (it->second.worker >= 0) {
    workers_[it->second.worker]->stats.rollouts--;
  }
  rollout_lru_.erase(it->second.lru);
  rollouts_.erase(it);
}

std::vector<WorkerSnapshot> Router::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<WorkerSnapshot> out;
  for (const auto& w : workers_) {
    out.push_back(w->stats);
    out.back().healthy = w->healthy;
  }
  return out;
}

std::map<std::string, uint64_t> Router::DecisionCounts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return decisions_;
}

}  // namespace bragg::gateway
