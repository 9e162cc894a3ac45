#pragma once

// Owns every sandbox of the agent: admission, ids, sessions (leases), idle TTLs, CPU
// placement and teardown.

#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "pbox/cgroup/cgroup.h"
#include "pbox/cgroup/cpuset.h"
#include "pbox/image/frozen_layer.h"
#include "pbox/image/image_store.h"
#include "pbox/runtime/runtime.h"
#include "pbox/sandbox.h"

namespace bragg::pbox {

struct SandboxDefaults {
  uint64_t memory_bytes = 1ull << 30;
  uint64_t disk_bytes = 1ull << 30;
  uint32_t pids = 512;
  uint32_t detached_ttl_seconds = 3600;
  uint64_t max_memory_bytes = 0;  // 0: no cap on what a sandbox may ask for
};

// Counters the manager reports to (owned by the caller; any may be null).
struct ManagerHooks {
  std::function<void(double seconds)> on_create;
  std::function<void()> on_destroy;
  std::function<void()> on_reject;
};

// Thread-safe.
class SandboxManager {
 public:
  // `runtimes` by name; `default_runtime` must be one of them. All pointers are borrowed and
  // must outlive the manager.
  SandboxManager(std::map<std::string, Runtime*> runtimes, std::string default_runtime,
                 ImageStore* images, CgroupManager* cgroups, CpuAllocator* cpus,
                 SandboxDefaults defaults, uint32_t max_sandboxes, ManagerHooks hooks = {});
  // Destroys every sandbox.
  ~SandboxManager();

  // Sessions. OpenSession returns a new id; CloseSession destroys all its sandboxes (in
  // parallel) and forgets it. Creating in an unknown or closed session is FailedPrecondition.
  // `cpus`: the session's sandboxes run only on these CPUs (empty: the whole sandbox set);
  // InvalidArgument unless they lie within the agent's sandbox set.
  Result<std::string> OpenSession(const std::string& client_name, const std::string& job_id = "",
                                  const CpuSet& cpus = CpuSet());
  void CloseSession(const std::string& session_id);

  // Asked once new sandboxes are ready, just before they are published: true when whoever asked
  // for them has gone away (its call was cancelled: the client died, or gave up). Called on
  // the thread that called Create or Clone; may be empty (never gone).
  using CallerGone = std::function<bool()>;

  // ResourceExhausted at once when max_sandboxes are live or being created. Cancelled, with the
  // new sandbox destroyed, when `caller_gone` says so once it is ready: nobody could learn its
  // id (a detached one would hold a slot until its idle TTL, a session's one would join a
  // session whose client is dead).
  Result<std::shared_ptr<Sandbox>> Create(const std::string& session_id,
                                          const SandboxSettings& requested,
                                          const CallerGone& caller_gone = {});
  // Clones `source_id` `count` times (sandbox_manager_clone.cc; docs/pbox.md "Cloning"):
  // freezes its writable layer into a frozen layer under `layers_dir` (set_layers_dir) and
  // starts `count` sandboxes on it, with the source's settings where `overrides` leaves a
  // field zero or empty (env and labels merge over the source's). The clones join
  // `session_id`, or the source's session when it is empty; a source of another session
  // is PermissionDenied. All or nothing: ResourceExhausted when `count` more sandboxes
  // do not fit, and on any failure every clone made so far is destroyed; Cancelled when
  // `caller_gone` (as in Create) says so once they are ready.
  Result<std::vector<std::shared_ptr<Sandbox>>> Clone(const std::string& session_id,
                                                      const std::string& source_id, uint32_t count,
                                                      const SandboxSettings& overrides,
                                                      const CallerGone& caller_gone = {});
  // Where frozen layers are copied; Clone is FailedPrecondition until it is set.
  void set_layers_dir(std::string dir) { layers_dir_ = std::move(dir); }

  // NotFound for unknown ids.
  Result<std::shared_ptr<Sandbox>> Get(const std::string& id);
  Status Destroy(const std::string& id);
  std::vector<std::shared_ptr<Sandbox>> List(const std::string& session_id = "");
  // Destroys all sandboxes (shutdown).
  void DestroyAll();
  // Destroys sandboxes idle past their TTL; returns how many. Called by the TTL thread every
  // second; public for tests.
  size_t ReapIdle(int64_t now_unix_ms);

  size_t live() const;
  uint32_t max_sandboxes() const { return max_sandboxes_; }
  const SandboxDefaults& defaults() const { return defaults_; }

 private:
  struct CreateOptions {
    std::shared_ptr<const FrozenLayer> frozen;  // a clone's layers
    bool admitted = false;                      // the caller already counted it in creating_
    bool publish = true;     // false: returned unregistered, for the caller to publish
    CallerGone caller_gone;  // asked before publishing (see Create)
  };
  Result<std::shared_ptr<Sandbox>> CreateImpl(const std::string& session_id,
                                              const SandboxSettings& requested,
                                              const CreateOptions& options);
  void TtlLoop();
  void DestroyMany(std::vector<std::shared_ptr<Sandbox>> victims);
  Status Validate(const SandboxSettings& s) const;
  // Ends `n` creations that admission counted in creating_ (none for n == 0). Takes mu_.
  void EndCreating(size_t n);

  const std::map<std::string, Runtime*> runtimes_;
  const std::string default_runtime_;
  ImageStore* images_;
  CgroupManager* cgroups_;
  CpuAllocator* cpus_;
  // The sandboxes' cgroups have the cpuset controller: a sandbox's CPUs are its own. Without it
  // (a user's systemd delegates cpu, memory and pids) sandboxes run on the agent's CPUs and
  // `cpus` becomes that many CPUs' worth of time (cpu.max) unless cpu_quota is given.
  const bool pin_cpus_;
  const bool cpu_controller_;
  const SandboxDefaults defaults_;
  const uint32_t max_sandboxes_;
  ManagerHooks hooks_;

  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Sandbox>> sandboxes_;
  std::map<std::string, std::set<std::string>> sessions_;  // session -> sandbox ids
  std::map<std::string, CpuSet> session_cpus_;             // sessions opened with a CPU set
  size_t creating_ = 0;
  std::string layers_dir_;
  bool stopping_ = false;
  std::condition_variable ttl_cv_;
  std::thread ttl_thread_;
};

// "sb-" + 12 random hex digits; "ss-" for sessions.
std::string NewId(const char* prefix);

}  // namespace bragg::pbox
