#include "gateway/health.h"

#include <fmt/format.h>
#include <httplib.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <optional>
#include <vector>

namespace bragg::gateway {

HealthChecker::HealthChecker(HealthOptions options, Fleet* fleet, WeightUpdater* weights)
    : options_(options), fleet_(fleet), weights_(weights) {}

HealthChecker::~HealthChecker() { Stop(); }

void HealthChecker::Start() {
  thread_ = std::thread([this] { Loop(); });
}

void HealthChecker::Stop() {
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  if (thread_.joinable()) {
    thread_.join();
  }
}

void HealthChecker::Loop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(stop_mu_);
      if (stop_cv_.wait_for(lock, std::chrono::milliseconds(options_.interval_ms),
                            [this] { return stopping_; })) {
        return;
      }
    }
    CheckAll();
  }
}

void HealthChecker::CheckAll() {
  // Versions read from workers in rotation, applied at the end of the round only if no fleet
  // update ran meanwhile: a read that overlapped an update may predate it, and must not
  // overwrite what the update recorded (nor make the fleet "follow" the old weights).
  struct VersionRead {
    Pool* pool;
    int worker;
    std::string version;
  };
  std::vector<VersionRead> reads;
  const uint64_t updates_before = weights_->updates_ok() + weights_->updates_failed();
  for (Pool* pool : fleet_->pools()) {
    std::vector<WorkerSnapshot> snap = pool->router().Snapshot();
    for (size_t i = 0; i < snap.size(); ++i) {
      // A worker being registered is in the router a moment before its record.
      if (i >= pool->size()) {
        break;
      }
      if (snap[i].removed) {
        continue;
      }
      int worker = static_cast<int>(i);
      auto c = pool->Client(worker)->NewClient();
      c->set_connection_timeout(0, 500000);
      c->set_read_timeout(2, 0);
      Probe& probe = probes_[{pool, worker}];
      const auto started = std::chrono::steady_clock::now();
      const auto previous =
          probe.started == std::chrono::steady_clock::time_point{} ? started : probe.started;
      probe.started = started;
      auto r = c->Get("/health");
      bool ok = r && r->status == 200;
      if (!r && pool->AnsweredSince(worker, previous)) {
        if (!probe.excused) {
          spdlog::info(
              "worker {} did not answer its health check ({}) but answers proxied "
              "requests: busy, kept as it is",
              snap[i].url, httplib::to_string(r.error()));
        }
        probe.excused = true;
        continue;
      }
      probe.excused = false;
      int failures = pool->RecordHealthCheck(worker, ok);
      if (!ok && snap[i].healthy && failures < options_.failures) {
        spdlog::info("worker {} failed health check {} of {}: {}", snap[i].url, failures,
                     options_.failures,
                     r ? fmt::format("status {}", r->status) : httplib::to_string(r.error()));
        continue;
      }
      bool quarantined = pool->quarantined(worker);
      if (ok && snap[i].healthy && !quarantined) {
        // Serving: its version is only read, never held against it (weights may be changing
        // outside the gateway; FollowWorkers below decides what the fleet's version is).
        if (std::optional<ModelInfo> info = GetModelInfo(*c)) {
          reads.push_back({pool, worker, std::move(info->weight_version)});
        }
        continue;
      }
      if (ok) {
        // A worker that missed a fleet update, or that a failed one left on other weights or
        // paused, must not serve new turns. While an update runs it decides.
        std::unique_lock<std::mutex> updating = weights_->TryLockUpdates();
        if (!updating.owns_lock()) {
          continue;
        }
        ok = weights_->Admit(*pool, worker, *c);
        snap[i].healthy = pool->router().Snapshot()[i].healthy;
      }
      if (ok != snap[i].healthy) {
        spdlog::info("worker {} is {}", snap[i].url, ok ? "healthy" : "unhealthy");
        pool->router().SetHealthy(worker, ok);
      }
    }
  }
  std::unique_lock<std::mutex> updating = weights_->TryLockUpdates();
  if (updating.owns_lock() &&
      weights_->updates_ok() + weights_->updates_failed() == updates_before) {
    for (VersionRead& r : reads) {
      r.pool->SetVersion(r.worker, std::move(r.version));
    }
    weights_->FollowWorkers();
  }
}

}  // namespace bragg::gateway
