#pragma once

// Shared pieces of the cgroup v1 and v2 implementations. Private to pbox_cgroup and its tests.

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "pbox/cgroup/cgroup.h"

namespace bragg::pbox {

// The directory and file operations the cgroup managers perform on cgroupfs. The real
// implementation is plain mkdir/rmdir/read/write without O_CREAT: on cgroupfs the kernel creates
// the control files on mkdir and removes them on rmdir. Tests derive a fake that does the same
// on a plain directory tree (and moves pids between cgroup.procs files). Implementations must be
// thread-safe; the real one is stateless.
class CgroupFs {
 public:
  virtual ~CgroupFs() = default;
  // AlreadyExists when `path` is present; other errors name the path.
  virtual Status MakeDir(const std::string& path);
  // Removes an empty cgroup directory. NotFound when absent, FailedPrecondition (EBUSY) while
  // it still holds processes or children.
  virtual Status RemoveDir(const std::string& path);
  virtual Result<std::string> Read(const std::string& path);
  // One write(2) to an existing control file (never creates it).
  virtual Status Write(const std::string& path, std::string_view data);
};

// Version detection and dispatch with an explicit CgroupFs (the public Create passes the real
// one). `fs` is shared with every Cgroup the manager creates because they may outlive it.
Result<std::unique_ptr<CgroupManager>> CreateCgroupManager(const CgroupManagerOptions& options,
                                                           std::shared_ptr<CgroupFs> fs);
Result<std::unique_ptr<CgroupManager>> CreateCgroupV1Manager(const CgroupManagerOptions& options,
                                                             std::shared_ptr<CgroupFs> fs);
Result<std::unique_ptr<CgroupManager>> CreateCgroupV2Manager(const CgroupManagerOptions& options,
                                                             std::shared_ptr<CgroupFs> fs);

// "v1" or "v2" from the layout under `root`; FailedPrecondition when it is neither.
Result<std::string> DetectCgroupVersion(const std::string& root);

// Sandbox and parent names: 1-128 characters of [A-Za-z0-9_.-], not starting with '.', so a
// name can never escape the parent or collide with a control file ("memory.max" has a dot but
// cgroupfs refuses mkdir of an existing file name with EEXIST, reported as AlreadyExists).
Status ValidateCgroupName(std::string_view what, const std::string& name);

bool PathExists(const std::string& path);

// A decimal unsigned integer with optional surrounding whitespace; `path` names the file in
// the error.
Result<uint64_t> ParseCgroupU64(const std::string& path, std::string_view text);
Result<uint64_t> ReadCgroupU64(CgroupFs& fs, const std::string& path);
// The value of the "key N" line of a flat-keyed file (memory.events, cpu.stat,
// memory.oom_control). NotFound when the key is absent; InvalidArgument when malformed.
Result<uint64_t> ReadKeyedU64(CgroupFs& fs, const std::string& path, std::string_view key);
// The pids of a cgroup.procs file; InvalidArgument when a line is not a pid.
Result<std::vector<pid_t>> ReadProcs(CgroupFs& fs, const std::string& procs_path);
// The pids of `dir`/cgroup.procs and of every descendant cgroup.
Result<std::vector<pid_t>> ReadProcsRecursive(CgroupFs& fs, const std::string& dir);
// The names of the subdirectories of `dir` (child cgroups), sorted.
Result<std::vector<std::string>> ListChildCgroups(const std::string& dir);

// SIGKILLs every pid found in `dirs` (recursively) until all are empty or `timeout` passes
// (DeadlineExceeded naming the cgroup and the pids left).
Status KillUntilEmpty(CgroupFs& fs, const std::vector<std::string>& dirs,
                      std::chrono::milliseconds timeout);

// Removes `dir` and every child cgroup below it, deepest first, retrying EBUSY briefly (a
// killed task leaves its cgroup asynchronously). A missing `dir` is OK.
Status RemoveCgroupTree(CgroupFs& fs, const std::string& dir);

// "0-3" from a limits string, validated and canonical; InvalidArgument otherwise.
Result<std::string> CanonicalCpus(const std::string& cpus);

// The checks every CreateCgroup makes before touching cgroupfs: a valid name and a finite,
// non-negative CPU quota. Returns the canonical CPU list ("" when the limits inherit it).
Result<std::string> CheckNameAndLimits(const std::string& name, const CgroupLimits& limits);

inline constexpr std::chrono::milliseconds kKillTimeout{2000};

}  // namespace bragg::pbox
