#pragma once

// A Runtime that starts no processes, for driving the agent's request handling at fuzzing
// speed: each sandbox is a temp directory root (real SandboxFs) plus a real InitClient whose
// other end is a thread speaking the pbox-init protocol. A Spawn is answered with Spawned,
// the argv echoed on stdout (at most 4 KiB), and Exited with code argv.size(). Cgroups are
// fakes with no limits. The root directory doubles as the writable layer that CloneSandbox
// freezes. Everything a sandbox holds is released by Stop() / destruction.

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "pbox/cgroup/cgroup.h"
#include "pbox/runtime/runtime.h"

namespace bragg::pbox::fuzz {

class FakeRuntime : public Runtime {
 public:
  std::string name() const override { return "native"; }
  Result<std::unique_ptr<RuntimeSandbox>> Start(const LaunchSpec& spec) override;

  // Sandboxes started and not yet destroyed (a leak shows as a count that stays above 0).
  static int live();
};

class FakeCgroupManager : public CgroupManager {
 public:
  FakeCgroupManager() = default;
  explicit FakeCgroupManager(std::vector<std::string> controllers)
      : controllers_(std::move(controllers)) {}
  std::string version() const override { return "fake"; }
  Result<std::unique_ptr<Cgroup>> CreateCgroup(const std::string& name,
                                               const CgroupLimits& limits) override;
  Result<std::vector<std::string>> ReapAll() override { return std::vector<std::string>{}; }
  Status RemoveParent() override { return absl::OkStatus(); }
  std::string parent_path() const override { return "/fake"; }
  std::vector<std::string> controllers() const override { return controllers_; }
  // The limits of the last cgroup created.
  CgroupLimits last_limits() const;

  // Cgroups created and not yet destroyed.
  static int live();

 private:
  const std::vector<std::string> controllers_ = {"cpu", "cpuset", "memory", "pids"};
  mutable std::mutex mu_;
  CgroupLimits last_;
};

}  // namespace bragg::pbox::fuzz
