#pragma once

// A Cgroup that holds no kernel state and whose every operation succeeds: the base of the
// tests' fakes, each of which overrides only what it is about.

#include <string>
#include <utility>
#include <vector>

#include "pbox/cgroup/cgroup.h"

namespace bragg::pbox::testing {

class NullCgroup : public Cgroup {
 public:
  explicit NullCgroup(std::string name) : name_(std::move(name)) {}

  const std::string& name() const override { return name_; }
  Status AddProcess(pid_t) override { return absl::OkStatus(); }
  Result<CgroupStats> Stats() const override { return CgroupStats{}; }
  Status KillAll() override { return absl::OkStatus(); }
  Status Destroy() override { return absl::OkStatus(); }
  Status Freeze(bool) override { return absl::OkStatus(); }
  int dir_fd() const override { return -1; }
  std::vector<std::string> ProcsFiles() const override { return {}; }
  Result<uint64_t> OomKills() const override { return uint64_t{0}; }

 private:
  std::string name_;
};

}  // namespace bragg::pbox::testing
