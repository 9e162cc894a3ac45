#pragma once

// The fleet's weights: the in-place weight update of every worker (pause, load, continue, with
// rollback), the fleet's version read at startup, and the version check that admits a worker
// back into rotation (docs/gateway.md, "Fleet weight update").

#include <httplib.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "gateway/fleet.h"

namespace bragg::gateway {

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

// What GET /get_model_info says about a worker's weights.
struct ModelInfo {
  std::string model_path;
  std::string weight_version;
  bool paused = false;  // SGLang's /get_model_info does not say; the simulator does
};

// GET /get_model_info on `c`; nullopt when the worker does not answer it with a JSON object.
std::optional<ModelInfo> GetModelInfo(httplib::Client& c);

// Runs the fleet's weight updates and version checks over the workers of `*fleet`, which must
// outlive it. Thread-safe: updates are serialized; the version checks run on the health loop.
class WeightUpdater {
 public:
  explicit WeightUpdater(Fleet* fleet);
  WeightUpdater(const WeightUpdater&) = delete;
  WeightUpdater& operator=(const WeightUpdater&) = delete;

  // Pauses every healthy worker in place, loads `model_path` as `version` without flushing the
  // KV cache, and continues them. New rollouts are salted with `version` from the moment every
  // worker is paused. If any pause or load fails, the workers that loaded (or may have) go back
  // to their previous weights and all continue on the old version (success false). success is
  // also false when a worker could not be continued. After any failure every worker's
  // /get_model_info is read again, and those not on the fleet's version are quarantined.
  // Blocks for as long as the workers take.
  WeightUpdateReport Update(const std::string& model_path, const std::string& version);

  // Reads the fleet's weight version from the workers at startup (the one most of them report);
  // those on another version are quarantined.
  void ReadFleetVersion();

  // For the health loop, on `worker` of `pool` that answers /health through `c`: continues it
  // when it may be paused, then checks that /get_model_info reports the fleet's version (the
  // first version read becomes the fleet's when none is known yet). True when the worker may
  // serve; its quarantine ends then. Call only while holding TryLockUpdates's lock.
  bool Admit(Pool& pool, int worker, httplib::Client& c);
  // The update lock if no update runs (owns_lock() false otherwise): while an update runs it
  // decides which workers serve.
  std::unique_lock<std::mutex> TryLockUpdates();

  // Weights changed outside the gateway (a framework's update_weights_from_distributed or
  // _from_tensor, docs/gateway.md, "Weights changed outside the gateway"). For the health loop,
  // after a round that recorded the version of every worker in rotation (Pool::SetVersion):
  // when all of them that reported one report the same version and it is not the fleet's, it
  // becomes the fleet's and salts new rollouts. Call only while holding TryLockUpdates's lock.
  void FollowWorkers();

  uint64_t updates_ok() const { return updates_ok_.load(); }
  uint64_t updates_failed() const { return updates_failed_.load(); }
  uint64_t updates_external() const { return updates_external_.load(); }

 private:
  struct Upstream {
    httplib::Error error = httplib::Error::Success;
    int status = 0;
    std::string body;
  };
  Upstream Post(Pool& pool, int worker, const std::string& path, const std::string& body);
  // New rollouts on every pool are salted with `version`.
  void SetSaltVersion(const std::string& version);
  // Whether `worker`, not on the fleet's version, may serve on `version` anyway: it was not
  // quarantined by the gateway's own update, and a worker in rotation reports `version` too (an
  // outside update under way), or none is in rotation (then `version` becomes the fleet's).
  bool ExternalVersion(Pool& pool, int worker, const std::string& version);
  // The workers in rotation and not quarantined.
  std::vector<Target> Serving();
  // The fleet's version becomes `version`, learnt from the workers.
  void FollowVersion(const std::string& version);

  Fleet* const fleet_;
  std::mutex update_mu_;      // one fleet update at a time
  std::string salt_version_;  // the version new rollouts are salted with; under update_mu_
  std::atomic<uint64_t> updates_ok_{0};
  std::atomic<uint64_t> updates_failed_{0};
  std::atomic<uint64_t> updates_external_{0};
};

}  // namespace bragg::gateway
