// cgroup v2: one unified tree. The agent's processes move to a leaf "<own>/agent" because a
// cgroup with controllers enabled for its children may hold no processes itself.

#include <fcntl.h>
#include <signal.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <thread>

#include "common/fs.h"
#include "common/unique_fd.h"
#include "fmt/format.h"
#include "pbox/cgroup/cgroup.h"
#include "pbox/cgroup/cgroup_internal.h"
#include "spdlog/spdlog.h"

namespace bragg::pbox {
namespace {

constexpr uint64_t kCpuPeriodUs = 100000;
constexpr uint64_t kMinCpuQuotaUs = 1000;
constexpr const char* kAgentLeaf = "agent";

bool HasWord(std::string_view text, std::string_view word) {
  size_t pos = 0;
  while ((pos = text.find(word, pos)) != std::string_view::npos) {
    bool start_ok = pos == 0 || text[pos - 1] == ' ' || text[pos - 1] == '\n';
    size_t end = pos + word.size();
    bool end_ok = end == text.size() || text[end] == ' ' || text[end] == '\n';
    if (start_ok && end_ok) {
      return true;
    }
    pos = end;
  }
  return false;
}

// Kills everything in `dir` and below. cgroup.kill (5.14+) kills atomically, forks included;
// without it the cgroup is frozen first so that no task can fork between read and kill.
Status KillCgroupV2(CgroupFs& fs, const std::string& dir) {
  if (!PathExists(dir)) {
    return absl::OkStatus();
  }
  if (PathExists(dir + "/cgroup.kill")) {
    BRAGG_RETURN_IF_ERROR(fs.Write(dir + "/cgroup.kill", "1"));
  } else if (PathExists(dir + "/cgroup.freeze")) {
    BRAGG_RETURN_IF_ERROR(fs.Write(dir + "/cgroup.freeze", "1"));
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (std::chrono::steady_clock::now() < deadline) {
      auto frozen = ReadKeyedU64(fs, dir + "/cgroup.events", "frozen");
      if (!frozen.ok() || *frozen == 1) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    auto pids = ReadProcsRecursive(fs, dir);
    if (pids.ok()) {
      for (pid_t pid : *pids) {
        (void)::kill(pid, SIGKILL);
      }
    }
    BRAGG_RETURN_IF_ERROR(fs.Write(dir + "/cgroup.freeze", "0"));
  }
  return KillUntilEmpty(fs, {dir}, kKillTimeout);
}

class CgroupV2 : public Cgroup {
 public:
  CgroupV2(std::shared_ptr<CgroupFs> fs, std::string name, std::string path, UniqueFd dir)
      : fs_(std::move(fs)), name_(std::move(name)), path_(std::move(path)), dir_(std::move(dir)) {}

  ~CgroupV2() override {
    Status s = Destroy();
    if (!s.ok()) {
      spdlog::warn("destroying cgroup {}: {}", name_, std::string(s.message()));
    }
  }

  const std::string& name() const override { return name_; }
  int dir_fd() const override { return dir_.get(); }

  std::vector<std::string> ProcsFiles() const override { return {path_ + "/cgroup.procs"}; }

  Result<uint64_t> OomKills() const override {
    return ReadKeyedU64(*fs_, path_ + "/memory.events", "oom_kill");
  }

  Status AddProcess(pid_t pid) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (destroyed_) {
      return absl::FailedPreconditionError(fmt::format("cgroup {} was destroyed", name_));
    }
    return Annotate(fs_->Write(path_ + "/cgroup.procs", std::to_string(pid)),
                    fmt::format("adding pid {} to cgroup {}", pid, name_));
  }

  Result<CgroupStats> Stats() const override {
    CgroupStats stats;
    BRAGG_ASSIGN_OR_RETURN(stats.memory_current, ReadCgroupU64(*fs_, path_ + "/memory.current"));
    if (PathExists(path_ + "/memory.peak")) {  // 5.19+
      BRAGG_ASSIGN_OR_RETURN(stats.memory_peak, ReadCgroupU64(*fs_, path_ + "/memory.peak"));
    }
    BRAGG_ASSIGN_OR_RETURN(stats.oom_kills,
                           ReadKeyedU64(*fs_, path_ + "/memory.events", "oom_kill"));
    BRAGG_ASSIGN_OR_RETURN(uint64_t usec, ReadKeyedU64(*fs_, path_ + "/cpu.stat", "usage_usec"));
    stats.cpu_usage_ns = usec * 1000;
    BRAGG_ASSIGN_OR_RETURN(std::vector<pid_t> pids, ReadProcsRecursive(*fs_, path_));
    stats.processes = static_cast<uint32_t>(pids.size());
    return stats;
  }

  Status KillAll() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (destroyed_) {
      return absl::OkStatus();
    }
    return Annotate(KillCgroupV2(*fs_, path_), fmt::format("killing cgroup {}", name_));
  }

  Status Freeze(bool frozen) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (destroyed_) {
      return absl::FailedPreconditionError(fmt::format("cgroup {} was destroyed", name_));
    }
    BRAGG_RETURN_IF_ERROR(
        Annotate(fs_->Write(path_ + "/cgroup.freeze", frozen ? "1" : "0"),
                 fmt::format("{} cgroup {}", frozen ? "freezing" : "thawing", name_)));
    if (!frozen) {
      return absl::OkStatus();  // the tasks resume on their own; nothing to wait for
    }
    // cgroup.events says "frozen 1" once every task has stopped.
    const uint64_t want = frozen ? 1 : 0;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    for (;;) {
      BRAGG_ASSIGN_OR_RETURN(uint64_t state,
                             ReadKeyedU64(*fs_, path_ + "/cgroup.events", "frozen"));
      if (state == want) {
        return absl::OkStatus();
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (frozen) {
      (void)fs_->Write(path_ + "/cgroup.freeze", "0");
    }
    return absl::DeadlineExceededError(
        fmt::format("cgroup {} did not {} within 1 s", name_, frozen ? "freeze" : "thaw"));
  }

  Status Destroy() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (destroyed_) {
      return absl::OkStatus();
    }
    BRAGG_RETURN_IF_ERROR(
        Annotate(KillCgroupV2(*fs_, path_), fmt::format("killing cgroup {}", name_)));
    dir_.Reset();
    BRAGG_RETURN_IF_ERROR(
        Annotate(RemoveCgroupTree(*fs_, path_), fmt::format("destroying cgroup {}", name_)));
    destroyed_ = true;
    return absl::OkStatus();
  }

 private:
  std::shared_ptr<CgroupFs> fs_;
  std::string name_;
  std::string path_;
  mutable std::mutex mu_;
  UniqueFd dir_;
  bool destroyed_ = false;
};

class CgroupV2Manager : public CgroupManager {
 public:
  CgroupV2Manager(std::shared_ptr<CgroupFs> fs, std::string parent,
                  std::vector<std::string> controllers)
      : fs_(std::move(fs)), parent_(std::move(parent)), controllers_(std::move(controllers)) {}

  std::vector<std::string> controllers() const override {
    std::vector<std::string> out = controllers_;
    out.emplace_back("freezer");
    std::sort(out.begin(), out.end());
    return out;
  }
  std::string version() const override { return "v2"; }
  std::string parent_path() const override { return parent_; }

  Result<std::unique_ptr<Cgroup>> CreateCgroup(const std::string& name,
                                               const CgroupLimits& limits) override {
    BRAGG_ASSIGN_OR_RETURN(std::string cpus, CheckNameAndLimits(name, limits));
    if (!cpus.empty()) {
      BRAGG_RETURN_IF_ERROR(Require("cpuset", "CPUs were asked for"));
    }
    if (limits.cpu_quota > 0) {
      BRAGG_RETURN_IF_ERROR(Require("cpu", "a CPU quota was asked for"));
    }
    std::string path = parent_ + "/" + name;
    Status made = fs_->MakeDir(path);
    if (made.code() == absl::StatusCode::kAlreadyExists) {
      return absl::AlreadyExistsError(fmt::format(
          "cgroup {} already exists ({}): destroy that sandbox first, or ReapAll leftovers", name,
          path));
    }
    BRAGG_RETURN_IF_ERROR(Annotate(made, fmt::format("creating cgroup {}", name)));
    auto dir = OpenFile(path, O_RDONLY | O_DIRECTORY);
    if (!dir.ok()) {
      (void)RemoveCgroupTree(*fs_, path);
      return dir.status();
    }
    auto cgroup = std::make_unique<CgroupV2>(fs_, name, path, std::move(*dir));
    Status s = ApplyLimits(path, cpus, limits);
    if (!s.ok()) {
      (void)cgroup->Destroy();
      return Annotate(s, fmt::format("setting limits of cgroup {}", name));
    }
    return std::unique_ptr<Cgroup>(std::move(cgroup));
  }

  Status RemoveParent() override {
    BRAGG_RETURN_IF_ERROR(ReapAll().status());
    if (!PathExists(parent_)) {
      return absl::OkStatus();
    }
    return fs_->RemoveDir(parent_);
  }

  Result<std::vector<std::string>> ReapAll() override {
    auto listed = ListChildCgroups(parent_);
    if (!listed.ok() && listed.status().code() == absl::StatusCode::kNotFound) {
      return std::vector<std::string>();  // a locate-only manager whose parent is gone
    }
    BRAGG_ASSIGN_OR_RETURN(std::vector<std::string> names, std::move(listed));
    Status status;
    for (const std::string& name : names) {
      std::string path = parent_ + "/" + name;
      Status s = KillCgroupV2(*fs_, path);
      if (s.ok()) {
        s = RemoveCgroupTree(*fs_, path);
      }
      if (!s.ok()) {
        s = Annotate(s, fmt::format("reaping leftover cgroup {}", name));
        spdlog::warn("{}", std::string(s.message()));
      }
      status.Update(s);
    }
    BRAGG_RETURN_IF_ERROR(status);
    return names;
  }

 private:
  Status Require(const char* controller, const char* why) const {
    if (std::find(controllers_.begin(), controllers_.end(), controller) != controllers_.end()) {
      return absl::OkStatus();
    }
    return absl::FailedPreconditionError(
        fmt::format("{} but the {} controller is not enabled in {}/cgroup.subtree_control: "
                    "delegate it to the agent's cgroup (systemd: Delegate=yes)",
                    why, controller, parent_));
  }

  Status ApplyLimits(const std::string& path, const std::string& cpus, const CgroupLimits& limits) {
    if (limits.memory_bytes > 0) {
      BRAGG_RETURN_IF_ERROR(fs_->Write(path + "/memory.max", std::to_string(limits.memory_bytes)));
    }
    // Without swap accounting (swapaccount=0 or no swap) the file does not exist.
    if (PathExists(path + "/memory.swap.max")) {
      BRAGG_RETURN_IF_ERROR(fs_->Write(path + "/memory.swap.max", "0"));
    }
    if (limits.pids > 0) {
      BRAGG_RETURN_IF_ERROR(fs_->Write(path + "/pids.max", std::to_string(limits.pids)));
    }
    if (!cpus.empty()) {
      Status s = fs_->Write(path + "/cpuset.cpus", cpus);
      if (!s.ok()) {
        return Annotate(
            s, fmt::format("the CPUs must be a subset of {}/cpuset.cpus.effective", parent_));
      }
    }
    if (limits.cpu_quota > 0) {
      uint64_t quota = std::max<uint64_t>(
          kMinCpuQuotaUs, static_cast<uint64_t>(std::llround(limits.cpu_quota * kCpuPeriodUs)));
      BRAGG_RETURN_IF_ERROR(
          fs_->Write(path + "/cpu.max", fmt::format("{} {}", quota, kCpuPeriodUs)));
    }
    return absl::OkStatus();
  }

  std::shared_ptr<CgroupFs> fs_;
  std::string parent_;
  std::vector<std::string> controllers_;  // enabled for the sandboxes
};

// Moves every process of `own` into `own`/agent; processes may fork meanwhile, so repeat
// until the cgroup stays empty.
Status MoveToLeaf(CgroupFs& fs, const std::string& own) {
  std::string leaf = fmt::format("{}/{}", own, kAgentLeaf);
  Status made = fs.MakeDir(leaf);
  if (!made.ok() && made.code() != absl::StatusCode::kAlreadyExists) {
    return Annotate(made, "creating the agent's leaf cgroup");
  }
  for (int round = 0; round < 20; ++round) {
    BRAGG_ASSIGN_OR_RETURN(std::vector<pid_t> pids, ReadProcs(fs, own + "/cgroup.procs"));
    if (pids.empty()) {
      return absl::OkStatus();
    }
    for (pid_t pid : pids) {
      Status s = fs.Write(leaf + "/cgroup.procs", std::to_string(pid));
      if (!s.ok() && s.code() != absl::StatusCode::kNotFound) {  // ESRCH: it exited
        return Annotate(s, fmt::format("moving pid {} of the agent's cgroup into {}", pid, leaf));
      }
    }
  }
  return absl::FailedPreconditionError(fmt::format(
      "processes keep appearing in {}/cgroup.procs: cannot move them all into {} (the cgroup "
      "must hold no processes before controllers are enabled for its children)",
      own, leaf));
}

// The cgroup an agent started in `own` should use. When `own` is the leaf "agent" that an
// earlier agent made and moved its parent shell into (a restart from the same job script or
// shell), that is the cgroup above it, which the earlier agent left with no processes of its
// own and the controllers enabled: using it again keeps the sandbox parent where the earlier
// agent had it, and where `pboxd --reap` run from that shell looks, instead of nesting
// "<own>/agent/agent" one level deeper with every restart.
std::string DelegatedCgroup(CgroupFs& fs, const std::string& own, const std::string& root) {
  size_t slash = own.rfind('/');
  if (own == root || slash == std::string::npos || own.substr(slash + 1) != kAgentLeaf) {
    return own;
  }
  std::string up = own.substr(0, slash);
  if (up.size() < root.size()) {
    return own;
  }
  Result<std::vector<pid_t>> procs = ReadProcs(fs, up + "/cgroup.procs");
  Result<std::string> enabled = fs.Read(up + "/cgroup.subtree_control");
  if (!procs.ok() || !procs->empty() || !enabled.ok()) {
    return own;
  }
  // The kernel lists "memory pids"; a file that only echoes writes holds "+memory +pids".
  std::replace(enabled->begin(), enabled->end(), '+', ' ');
  if (!HasWord(*enabled, "memory") || !HasWord(*enabled, "pids")) {
    return own;
  }
  return up;
}

}  // namespace

Result<std::unique_ptr<CgroupManager>> CreateCgroupV2Manager(const CgroupManagerOptions& options,
                                                             std::shared_ptr<CgroupFs> fs) {
  std::string own_path;
  bool found = false;
  size_t start = 0;
  const std::string& self = options.self_cgroup;
  while (start < self.size()) {
    size_t nl = self.find('\n', start);
    std::string line = self.substr(start, nl == std::string::npos ? std::string::npos : nl - start);
    start = nl == std::string::npos ? self.size() : nl + 1;
    if (line.rfind("0::", 0) == 0) {
      own_path = line.substr(3);
      found = true;
      break;
    }
  }
  if (!found || own_path.empty() || own_path[0] != '/' ||
      own_path.find("/..") != std::string::npos) {
    return absl::FailedPreconditionError(fmt::format(
        "no valid '0::/path' line in /proc/self/cgroup ('{}'): the agent is not in a cgroup v2 "
        "hierarchy; run it on a cgroup v2 host or pass --cgroup-mode=v1",
        self.substr(0, 200)));
  }
  std::string own = own_path == "/" ? options.root : options.root + own_path;
  while (own.size() > 1 && own.back() == '/') {
    own.pop_back();
  }
  if (!PathExists(own + "/cgroup.procs")) {
    return absl::FailedPreconditionError(fmt::format(
        "the agent's cgroup {} (from /proc/self/cgroup) is not in the cgroup2 tree at {}: run "
        "pboxd with the host's cgroupfs mounted there",
        own, options.root));
  }
  if (!options.create_parent) {
    // Reaping only: what the agent would use, with nothing created, enabled or moved (the
    // caller may be an epilog in a cgroup it must not leave). The agent moved every process
    // of its cgroup into the "agent" leaf (its parent shell too), and systemd runs a
    // delegated unit's ExecStopPost in ".control": from there the parent is one level up.
    std::string parent = own + "/" + options.parent_name;
    const std::string leaf = own.substr(own.rfind('/') + 1);
    if (!PathExists(parent) && own != options.root && (leaf == "agent" || leaf == ".control")) {
      std::string up = own.substr(0, own.rfind('/')) + "/" + options.parent_name;
      if (PathExists(up)) {
        parent = std::move(up);
      }
    }
    return std::unique_ptr<CgroupManager>(
        new CgroupV2Manager(std::move(fs), std::move(parent), {}));
  }
  own = DelegatedCgroup(*fs, own, options.root);
  BRAGG_ASSIGN_OR_RETURN(std::string available, fs->Read(own + "/cgroup.controllers"));
  for (const char* required : {"memory", "pids"}) {
    if (!HasWord(available, required)) {
      return absl::FailedPreconditionError(fmt::format(
          "{} controller not available in {}/cgroup.controllers: enable it in the parent's "
          "cgroup.subtree_control or delegate it to the agent (systemd: Delegate=yes)",
          required, own));
    }
  }
  std::vector<std::string> controllers;
  std::string enable;
  for (const char* c : {"cpu", "cpuset", "memory", "pids"}) {
    if (HasWord(available, c)) {
      controllers.emplace_back(c);
      enable += fmt::format("{}+{}", enable.empty() ? "" : " ", c);
    } else {
      spdlog::warn("cgroup v2 controller {} not available in {}/cgroup.controllers", c, own);
    }
  }
  if (!options.cpus.empty() &&
      std::find(controllers.begin(), controllers.end(), "cpuset") == controllers.end()) {
    return absl::FailedPreconditionError(
        fmt::format("sandbox CPUs {} were given but the cpuset controller is not available in "
                    "{}/cgroup.controllers: delegate it or start pboxd without --cpus",
                    options.cpus, own));
  }
  // The root cgroup is exempt from the no-internal-processes rule (and holds every process
  // of the host, which must not be moved).
  if (own != options.root) {
    BRAGG_RETURN_IF_ERROR(MoveToLeaf(*fs, own));
  }
  BRAGG_RETURN_IF_ERROR(Annotate(fs->Write(own + "/cgroup.subtree_control", enable),
                                 "enabling controllers for the agent's children"));
  std::string parent = own + "/" + options.parent_name;
  Status made = fs->MakeDir(parent);
  if (!made.ok() && made.code() != absl::StatusCode::kAlreadyExists) {
    return Annotate(made,
                    "creating the sandbox parent cgroup (pboxd needs root or a delegated "
                    "cgroup)");
  }
  if (!options.cpus.empty()) {
    Status s = fs->Write(parent + "/cpuset.cpus", options.cpus);
    if (!s.ok()) {
      return Annotate(s, fmt::format("the sandbox CPUs ({}) must be a subset of the agent's "
                                     "{}/cpuset.cpus.effective",
                                     options.cpus, own));
    }
  }
  BRAGG_RETURN_IF_ERROR(Annotate(fs->Write(parent + "/cgroup.subtree_control", enable),
                                 "enabling controllers for the sandboxes"));
  return std::unique_ptr<CgroupManager>(
      new CgroupV2Manager(std::move(fs), std::move(parent), std::move(controllers)));
}

}  // namespace bragg::pbox
