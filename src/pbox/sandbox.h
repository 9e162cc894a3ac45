#pragma once

// One sandbox as the agent tracks it, and the commands running in it.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"
#include "pbox/cgroup/cgroup.h"
#include "pbox/cgroup/cpuset.h"
#include "pbox/image/frozen_layer.h"
#include "pbox/runtime/runtime.h"

namespace bragg::pbox {

// Resolved settings of a sandbox (defaults filled in by the manager).
struct SandboxSettings {
  std::string image = "host";
  std::string runtime;
  uint32_t cpus = 1;
  double cpu_quota = 0;
  uint64_t memory_bytes = 0;
  uint32_t pids = 0;
  uint64_t disk_bytes = 0;
  std::map<std::string, std::string> env;
  std::string workdir = "/";
  uint32_t idle_ttl_seconds = 0;
  std::map<std::string, std::string> labels;
};

// The one rule of unset sandbox settings: a zero number or an empty string is unset. Returns
// `request` with each of its unset fields (image, runtime, cpus, cpu_quota, memory_bytes, pids,
// disk_bytes, workdir, idle_ttl_seconds) taken from `base`; env and labels are `request`'s.
SandboxSettings FillUnset(const SandboxSettings& request, const SandboxSettings& base);

struct CommandSpec {
  std::vector<std::string> argv;
  std::map<std::string, std::string> env;  // merged over the sandbox's
  std::string cwd;                         // "" = the sandbox's workdir
  std::chrono::milliseconds timeout{0};    // 0 = none
  bool stdin = false;
};

struct CommandResult {
  int exit_code = -1;
  int signal = 0;
  bool timed_out = false;
  bool oom_killed = false;
  bool cancelled = false;  // the caller went away (Pump's `cancelled`): the tree was killed
  uint64_t stdout_bytes = 0;
  uint64_t stderr_bytes = 0;
  double wall_ms = 0;
  double cpu_ms = 0;
  uint64_t peak_memory_bytes = 0;
  std::string error;
};

// Receives a command's output as it comes. Returning false (the client went away) kills the
// command. Called from the thread that runs Pump().
class OutputSink {
 public:
  virtual ~OutputSink() = default;
  virtual bool OnStdout(std::string_view data) = 0;
  virtual bool OnStderr(std::string_view data) = 0;
};

class Sandbox;

// A started command. Pump() runs on one thread; WriteStdin/CloseStdin/Signal may be called
// from another one concurrently.
class RunningCommand {
 public:
  ~RunningCommand();
  // Streams output to `sink` until the command exits (and its pipes drain, or 200 ms pass
  // after exit if a background process keeps them open), its timeout expires (the whole
  // process tree is killed), or the sink refuses data. Then returns what happened.
  // `cancelled`, when given, is asked at least every kCancelPollMs while the command runs:
  // once it says true (the caller went away), the whole process tree is killed the same way.
  CommandResult Pump(OutputSink& sink, const std::function<bool()>& cancelled = {});
  static constexpr int kCancelPollMs = 250;
  // Blocks while the pipe is full. FailedPrecondition if stdin was not requested or closed.
  Status WriteStdin(std::string_view data);
  void CloseStdin();
  Status Signal(int signal);

 private:
  friend class Sandbox;
  RunningCommand() = default;

  std::shared_ptr<Sandbox> sandbox_;
  std::shared_ptr<ProcessHandle> handle_;
  UniqueFd stdout_, stderr_;
  std::mutex stdin_mu_;
  UniqueFd stdin_;
  std::chrono::milliseconds timeout_{0};
  std::chrono::steady_clock::time_point started_;
  uint64_t oom_kills_before_ = 0;
  // The client sent SIGKILL itself (Signal): such a death is not the OOM killer's.
  std::atomic<bool> client_killed_{false};
};

// Thread-safe.
class Sandbox : public std::enable_shared_from_this<Sandbox> {
 public:
  Sandbox(std::string id, std::string session_id, SandboxSettings settings, CpuSet cpus,
          std::unique_ptr<Cgroup> cgroup, std::unique_ptr<RuntimeSandbox> runtime);
  ~Sandbox();

  const std::string& id() const { return id_; }
  const std::string& session_id() const { return session_id_; }
  const SandboxSettings& settings() const { return settings_; }
  const CpuSet& cpus() const { return cpus_; }
  int64_t created_unix_ms() const { return created_unix_ms_; }
  int64_t last_used_unix_ms() const { return last_used_unix_ms_.load(); }
  uint32_t running_commands() const { return running_.load(); }
  // File transfers in flight (TransferHold): like running commands, they keep the sandbox
  // from its idle TTL however long they take.
  uint32_t transfers() const { return transfers_.load(); }
  class TransferHold {
   public:
    explicit TransferHold(std::shared_ptr<Sandbox> sb) : sb_(std::move(sb)) {
      if (sb_) {
        sb_->transfers_.fetch_add(1);
      }
    }
    ~TransferHold() {
      if (sb_) {
        sb_->transfers_.fetch_sub(1);
        sb_->Touch();
      }
    }
    TransferHold(const TransferHold&) = delete;
    TransferHold& operator=(const TransferHold&) = delete;

   private:
    std::shared_ptr<Sandbox> sb_;
  };
  bool destroying() const { return destroying_.load(); }
  Result<CgroupStats> Stats() const { return cgroup_->Stats(); }
  const SandboxFs& fs() const { return runtime_->fs(); }
  // Removes a path for the file API (RuntimeSandbox::Remove): use this, not fs().Remove.
  Status Remove(const std::string& path, bool recursive) {
    return runtime_->Remove(path, recursive);
  }

  // Marks the sandbox used now (idle TTL).
  void Touch();
  // Starts a command. Unavailable once the sandbox is being destroyed.
  Result<std::unique_ptr<RunningCommand>> Start(const CommandSpec& spec);
  // Kills everything and releases the runtime and the cgroup. Idempotent.
  Status Destroy();
  // Keeps the sandbox's image (and its layers) from removal until this object is gone.
  void HoldImage(ImageLease lease) { image_lease_ = std::move(lease); }

  // Cloning (sandbox_manager_clone.cc). The frozen layer this sandbox sits on (null unless
  // it is a clone); Destroy lets go of it, so the last clone's Destroy removes it from disk.
  void set_frozen_layer(std::shared_ptr<const FrozenLayer> layer);
  std::shared_ptr<const FrozenLayer> frozen_layer() const;
  // A read-only fd of the writable layer (RuntimeSandbox::OpenWritableLayer).
  Result<UniqueFd> OpenWritableLayer() { return runtime_->OpenWritableLayer(); }
  // RuntimeSandbox::FlushWrites.
  Status FlushWrites(std::chrono::milliseconds timeout) { return runtime_->FlushWrites(timeout); }
  // Stops every process of the sandbox (its cgroup's freezer) for one holder; Thaw lets go of
  // that hold. Counted: the sandbox resumes only when its last holder thaws, so that
  // concurrent clones of one source each copy it stopped (one clone's thaw used to resume the
  // source while another still copied: a file renamed meanwhile failed that copy). When the
  // freezer cannot stop it, Freeze fails and holds nothing.
  Status Freeze();
  Status Thaw();

 private:
  friend class RunningCommand;
  const std::string id_;
  const std::string session_id_;
  const SandboxSettings settings_;
  const CpuSet cpus_;
  const int64_t created_unix_ms_;
  std::atomic<int64_t> last_used_unix_ms_;
  std::atomic<uint32_t> running_{0};
  std::atomic<uint32_t> transfers_{0};
  std::atomic<bool> destroying_{false};
  // OOM kills of the cgroup seen while pbox-init lived on (a native command killed alone): once
  // init is gone, only kills beyond these say that the OOM killer ended the sandbox.
  std::atomic<uint64_t> oom_kills_survived_{0};
  std::mutex destroy_mu_;
  std::unique_ptr<Cgroup> cgroup_;
  std::unique_ptr<RuntimeSandbox> runtime_;
  ImageLease image_lease_;
  mutable std::mutex layer_mu_;
  std::shared_ptr<const FrozenLayer> frozen_layer_;
  std::mutex freeze_mu_;  // held across the freezer's writes, so holders queue behind them
  int freeze_holders_ = 0;
};

int64_t UnixMillisNow();

}  // namespace bragg::pbox
