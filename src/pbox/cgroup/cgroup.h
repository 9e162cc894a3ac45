#pragma once

// cgroups for sandboxes: cgroup v1 (one directory per controller hierarchy) and v2 (one
// unified tree) behind one interface. Implementations: cgroup_v1.cc, cgroup_v2.cc.

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace bragg::pbox {

struct CgroupLimits {
  uint64_t memory_bytes = 0;  // 0: unlimited. Swap is disabled for the cgroup where possible.
  uint32_t pids = 0;          // 0: unlimited
  std::string cpus;           // cpuset, e.g. "1-2"; empty: inherit the parent's
  double cpu_quota = 0;       // in CPUs (0.5 = half a CPU); 0: no quota
};

struct CgroupStats {
  uint64_t memory_current = 0;  // bytes
  uint64_t memory_peak = 0;     // bytes; 0 if the kernel does not report it
  uint64_t oom_kills = 0;       // OOM kills inside this cgroup so far
  uint64_t cpu_usage_ns = 0;
  uint32_t processes = 0;
};

// One sandbox's cgroup (on v1: a directory in each hierarchy). Owning: destruction calls
// Destroy(). Thread-safe for concurrent Stats() calls; Destroy() must not race AddProcess().
class Cgroup {
 public:
  virtual ~Cgroup() = default;
  virtual const std::string& name() const = 0;
  // Moves `pid` (a host pid) into this cgroup in every hierarchy.
  virtual Status AddProcess(pid_t pid) = 0;
  virtual Result<CgroupStats> Stats() const = 0;
  // SIGKILLs every process in the cgroup and waits (bounded, ~2 s) until it is empty.
  // Forks racing the kill are caught (v2: cgroup.kill; v1: freezer, then kill, then thaw).
  virtual Status KillAll() = 0;
  // KillAll, then removes the directories. Idempotent.
  virtual Status Destroy() = 0;
  // Freezes (true) every process of the cgroup and waits (bounded, ~1 s) until the kernel
  // says all are stopped; DeadlineExceeded (after thawing again) if they never are. Thawing
  // (false) does not wait: the tasks resume as the scheduler gets to them. v2: cgroup.freeze and
  // the "frozen" key of cgroup.events; v1: freezer.state (FailedPrecondition without a freezer
  // hierarchy). FailedPrecondition once destroyed.
  virtual Status Freeze(bool frozen) = 0;
  // v2: an O_DIRECTORY fd of the cgroup for clone3(CLONE_INTO_CGROUP); -1 on v1.
  virtual int dir_fd() const = 0;
  // The files a new single-threaded process writes "0" to, to move itself in before it runs
  // anything else: v2 cgroup.procs; v1 `tasks`, one per hierarchy, cpuset first. A thread
  // that moves itself through `tasks` skips cgroup_threadgroup_rwsem, whose write side (every
  // cgroup.procs write) waits for an RCU grace period: 13-16 ms per process measured here.
  virtual std::vector<std::string> ProcsFiles() const = 0;
  // OOM kills so far: the one figure read around every command, cheaper than Stats().
  virtual Result<uint64_t> OomKills() const = 0;
};

struct CgroupManagerOptions {
  // Where cgroupfs is mounted. Tests point this at a fake tree.
  std::string root = "/sys/fs/cgroup";
  // Contents of /proc/self/cgroup, read by Create() when empty (tests pass their own).
  std::string self_cgroup;
  // "auto" (detect), "v1" or "v2".
  std::string mode = "auto";
  // Sandbox cgroups live under <agent's own cgroup>/<parent_name>/ (one per hierarchy on v1).
  std::string parent_name = "pbox";
  // The CPUs sandboxes may use, written to the parent's cpuset; empty: inherit.
  std::string cpus;
  // false: only locate the parent, for reaping what a killed agent left (`pboxd --reap`):
  // Create() then creates no directory, writes no control file and moves no process, the
  // parent may be missing (ReapAll finds nothing, RemoveParent does nothing), and CreateCgroup
  // must not be called.
  bool create_parent = true;
};

class CgroupManager {
 public:
  // Detects the version (v2 when `root` itself is a cgroup2 mount, i.e. has
  // cgroup.controllers; v1 when it holds per-controller directories), locates the agent's
  // own cgroup from `self_cgroup`, and creates the parent. On v2 it also moves the agent's
  // processes into a leaf "<own>/agent" (the no-internal-processes rule) and enables the
  // cpu, cpuset, memory and pids controllers for the subtree. Errors name the file and say
  // what to do (e.g. "memory controller not available in <root>: enable it or delegate it").
  static Result<std::unique_ptr<CgroupManager>> Create(const CgroupManagerOptions& options);

  virtual ~CgroupManager() = default;
  virtual std::string version() const = 0;  // "v1" or "v2"
  // Creates <parent>/<name> with the limits applied. AlreadyExists if present.
  virtual Result<std::unique_ptr<Cgroup>> CreateCgroup(const std::string& name,
                                                       const CgroupLimits& limits) = 0;
  // Kills and removes every cgroup under the parent (what a killed agent left behind).
  // Returns the names reaped.
  virtual Result<std::vector<std::string>> ReapAll() = 0;
  // ReapAll, then removes the parent directories themselves: what an agent does on a clean
  // exit so that nothing of it stays in cgroupfs. A parent directory already gone is fine.
  virtual Status RemoveParent() = 0;
  // The parent directory (v2) or the parent in the memory hierarchy (v1), for diagnostics.
  virtual std::string parent_path() const = 0;
  // Every parent directory (v1: one per hierarchy), whether or not it exists now.
  virtual std::vector<std::string> parent_paths() const { return {parent_path()}; }
  // The controllers sandboxes' cgroups have, from {"cpu", "cpuset", "memory", "pids",
  // "freezer"} (v2's freezer is built in): which limits hold.
  virtual std::vector<std::string> controllers() const = 0;
};

}  // namespace bragg::pbox
