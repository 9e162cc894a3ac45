#include "gateway/health.h"

#include <fmt/format.h>
#include <httplib.h>
#include <spdlog/spdlog.h>

#include <chrono>
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
  for (Pool* pool : fleet_->pools()) {
    std::vector<WorkerSnapshot> snap = pool->router().Snapshot();
    for (size_t i = 0; i < snap.size(); ++i) {
      // A worker being registered is in the router a moment before its record.
      if (i >= pool->size()) {
        break;
      }
      ClientPool* cp = pool->Client(static_cast<int>(i));
      httplib::Client c(cp->target().host, cp->target().port);
      c.set_connection_timeout(0, 500000);
      c.set_read_timeout(2, 0);
      auto r = c.Get("/health");
      bool ok = r && r->status == 200;
      int failures = pool->RecordHealthCheck(static_cast<int>(i), ok);
      if (!ok && snap[i].healthy && failures < options_.failures) {
        spdlog::info("worker {} failed health check {} of {}: {}", snap[i].url, failures,
                     options_.failures,
                     r ? fmt::format("status {}", r->status) : httplib::to_string(r.error()));
        continue;
      }
      bool quarantined = pool->quarantined(static_cast<int>(i));
      if (ok && (!snap[i].healthy || quarantined)) {
        // A worker that missed a fleet update, or that a failed one left on other weights or
        // paused, must not serve new turns. While an update runs it decides.
        std::unique_lock<std::mutex> updating = weights_->TryLockUpdates();
        if (!updating.owns_lock()) {
          continue;
        }
        ok = weights_->Admit(*pool, static_cast<int>(i), c);
        snap[i].healthy = pool->router().Snapshot()[i].healthy;
      }
      if (ok != snap[i].healthy) {
        spdlog::info("worker {} is {}", snap[i].url, ok ? "healthy" : "unhealthy");
        pool->router().SetHealthy(static_cast<int>(i), ok);
      }
    }
  }
}

}  // namespace bragg::gateway
