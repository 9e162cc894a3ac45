#pragma once

// The health loop: every interval, GET /health on every worker of the fleet; a worker leaves
// rotation after enough failed checks in a row and comes back after a good one followed by the
// version check (WeightUpdater::Admit), never while a weight update runs.
//
// A probe that gets no answer in time from a worker that answered a proxied request since its
// previous probe began is excused, not counted: the worker is busy, not dead (a saturated
// worker queues /health behind its generations). A worker that answers /health with an error,
// or one that answers nothing at all, is counted as before.

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "gateway/fleet.h"
#include "gateway/weights.h"

namespace bragg::gateway {

struct HealthOptions {
  int interval_ms = 1000;
  // Consecutive failed checks before a worker is taken out of rotation.
  int failures = 3;
};

// Runs the loop on its own thread between Start and Stop (or destruction). `*fleet` and
// `*weights` must outlive it. Start/Stop from one thread.
class HealthChecker {
 public:
  HealthChecker(HealthOptions options, Fleet* fleet, WeightUpdater* weights);
  ~HealthChecker();
  HealthChecker(const HealthChecker&) = delete;
  HealthChecker& operator=(const HealthChecker&) = delete;

  void Start();
  // Ends the loop and joins its thread; idempotent.
  void Stop();

 private:
  void Loop();
  // One round over every worker of every pool.
  void CheckAll();

  struct Probe {
    std::chrono::steady_clock::time_point started{};  // when the last probe began
    bool excused = false;                             // it got no answer and was excused
  };

  const HealthOptions options_;
  Fleet* const fleet_;
  WeightUpdater* const weights_;
  std::thread thread_;
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stopping_ = false;                          // guarded by stop_mu_
  std::map<std::pair<Pool*, int>, Probe> probes_;  // the loop's thread alone
};

}  // namespace bragg::gateway
