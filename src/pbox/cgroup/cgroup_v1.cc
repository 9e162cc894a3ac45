// cgroup v1: one directory per controller hierarchy. The agent's own cgroup differs per
// hierarchy (/proc/self/cgroup has one line each), so the sandbox parent is created under the
// agent's cgroup in every hierarchy we use.

#include <signal.h>

#include <cmath>
#include <mutex>
#include <thread>

#include "common/status.h"
#include "fmt/format.h"
#include "pbox/cgroup/cgroup.h"
#include "pbox/cgroup/cgroup_internal.h"
#include "spdlog/spdlog.h"

namespace bragg::pbox {
namespace {

constexpr uint64_t kCfsPeriodUs = 100000;
constexpr uint64_t kMinCfsQuotaUs = 1000;

struct Hierarchy {
  std::vector<std::string> controllers;  // those of ours mounted here, e.g. {"cpu", "cpuacct"}
  std::string mount;                     // /sys/fs/cgroup/memory
  std::string parent;                    // <mount><own>/<parent_name>
};

// Which hierarchy (index into the vector) carries each controller we use; -1 when absent.
struct Layout {
  std::vector<Hierarchy> hierarchies;
  int memory = -1;
  int pids = -1;
  int cpuset = -1;
  int cpu = -1;
  int cpuacct = -1;
  int freezer = -1;
};

std::vector<std::string_view> Split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  for (;;) {
    size_t pos = s.find(sep);
    out.push_back(s.substr(0, pos));
    if (pos == std::string_view::npos) {
      return out;
    }
    s.remove_prefix(pos + 1);
  }
}

std::string Trim(std::string_view s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) {
    s.remove_suffix(1);
  }
  while (!s.empty() && (s.front() == '\n' || s.front() == ' ')) {
    s.remove_prefix(1);
  }
  return std::string(s);
}

class CgroupV1 : public Cgroup {
 public:
  // `dirs` are this cgroup's directories, one per hierarchy, parallel to `layout.hierarchies`
  // (empty string where the directory does not exist, e.g. a partial leftover).
  CgroupV1(std::shared_ptr<CgroupFs> fs, std::string name, const Layout& layout,
           std::vector<std::string> dirs)
      : fs_(std::move(fs)), name_(std::move(name)), layout_(layout), dirs_(std::move(dirs)) {}

  ~CgroupV1() override {
    Status s = Destroy();
    if (!s.ok()) {
      spdlog::warn("destroying cgroup {}: {}", name_, std::string(s.message()));
    }
  }

  const std::string& name() const override { return name_; }
  int dir_fd() const override { return -1; }

  std::vector<std::string> ProcsFiles() const override {
    std::vector<std::string> out;
    if (layout_.cpuset >= 0 && !dirs_[static_cast<size_t>(layout_.cpuset)].empty()) {
      out.push_back(dirs_[static_cast<size_t>(layout_.cpuset)] + "/tasks");
    }
    for (size_t i = 0; i < dirs_.size(); ++i) {
      if (static_cast<int>(i) != layout_.cpuset && !dirs_[i].empty()) {
        out.push_back(dirs_[i] + "/tasks");
      }
    }
    return out;
  }

  Result<uint64_t> OomKills() const override {
    if (layout_.memory < 0 || dirs_[static_cast<size_t>(layout_.memory)].empty()) {
      return absl::FailedPreconditionError(
          fmt::format("cgroup {} has no memory controller", name_));
    }
    return ReadKeyedU64(*fs_, dirs_[static_cast<size_t>(layout_.memory)] + "/memory.oom_control",
                        "oom_kill");
  }

  Status AddProcess(pid_t pid) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (destroyed_) {
      return absl::FailedPreconditionError(fmt::format("cgroup {} was destroyed", name_));
    }
    // cpuset first: a task must never run outside its CPUs, even briefly.
    std::vector<size_t> order;
    if (layout_.cpuset >= 0) {
      order.push_back(static_cast<size_t>(layout_.cpuset));
    }
    for (size_t i = 0; i < dirs_.size(); ++i) {
      if (static_cast<int>(i) != layout_.cpuset) {
        order.push_back(i);
      }
    }
    for (size_t i : order) {
      if (dirs_[i].empty()) {
        continue;
      }
      BRAGG_RETURN_IF_ERROR(Annotate(fs_->Write(dirs_[i] + "/cgroup.procs", std::to_string(pid)),
                                     fmt::format("adding pid {} to cgroup {}", pid, name_)));
    }
    return absl::OkStatus();
  }

  Result<CgroupStats> Stats() const override {
    CgroupStats stats;
    const std::string& mem = Dir(layout_.memory);
    if (mem.empty()) {
      return absl::FailedPreconditionError(
          fmt::format("cgroup {} has no memory cgroup directory", name_));
    }
    BRAGG_ASSIGN_OR_RETURN(stats.memory_current,
                           ReadCgroupU64(*fs_, mem + "/memory.usage_in_bytes"));
    BRAGG_ASSIGN_OR_RETURN(stats.memory_peak,
                           ReadCgroupU64(*fs_, mem + "/memory.max_usage_in_bytes"));
    auto ooms = ReadKeyedU64(*fs_, mem + "/memory.oom_control", "oom_kill");
    if (ooms.ok()) {
      stats.oom_kills = *ooms;
    } else if (ooms.status().code() != absl::StatusCode::kNotFound) {
      return ooms.status();  // malformed; a missing "oom_kill" line (before 4.13) reads as 0
    }
    const std::string& acct = Dir(layout_.cpuacct);
    if (!acct.empty()) {
      BRAGG_ASSIGN_OR_RETURN(stats.cpu_usage_ns, ReadCgroupU64(*fs_, acct + "/cpuacct.usage"));
    }
    BRAGG_ASSIGN_OR_RETURN(std::vector<pid_t> pids, ReadProcsRecursive(*fs_, mem));
    stats.processes = static_cast<uint32_t>(pids.size());
    return stats;
  }

  Status KillAll() override {
    std::lock_guard<std::mutex> lock(mu_);
    return KillAllLocked();
  }

  Status Freeze(bool frozen) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (destroyed_) {
      return absl::FailedPreconditionError(fmt::format("cgroup {} was destroyed", name_));
    }
    const std::string& freezer = Dir(layout_.freezer);
    if (freezer.empty() || !PathExists(freezer + "/freezer.state")) {
      return absl::FailedPreconditionError(
          fmt::format("cgroup {} has no freezer: mount the v1 freezer hierarchy", name_));
    }
    const std::string state_file = freezer + "/freezer.state";
    const char* want = frozen ? "FROZEN" : "THAWED";
    BRAGG_RETURN_IF_ERROR(
        Annotate(fs_->Write(state_file, want),
                 fmt::format("{} cgroup {}", frozen ? "freezing" : "thawing", name_)));
    if (!frozen) {
      return absl::OkStatus();  // THAWED takes effect in the write
    }
    // FREEZING until every task has stopped.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    for (;;) {
      BRAGG_ASSIGN_OR_RETURN(std::string state, fs_->Read(state_file));
      if (Trim(state) == want) {
        return absl::OkStatus();
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (frozen) {
      (void)fs_->Write(state_file, "THAWED");
    }
    return absl::DeadlineExceededError(
        fmt::format("cgroup {} did not reach {} within 1 s", name_, want));
  }

  Status Destroy() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (destroyed_) {
      return absl::OkStatus();
    }
    BRAGG_RETURN_IF_ERROR(KillAllLocked());
    Status status;
    for (const std::string& dir : dirs_) {
      if (!dir.empty()) {
        status.Update(RemoveCgroupTree(*fs_, dir));
      }
    }
    if (status.ok()) {
      destroyed_ = true;
    }
    return Annotate(status, fmt::format("destroying cgroup {}", name_));
  }

 private:
  const std::string& Dir(int index) const {
    static const std::string kNone;
    return index < 0 ? kNone : dirs_[static_cast<size_t>(index)];
  }

  std::vector<std::string> ExistingDirs() const {
    std::vector<std::string> out;
    for (const std::string& dir : dirs_) {
      if (!dir.empty() && PathExists(dir)) {
        out.push_back(dir);
      }
    }
    return out;
  }

  Status KillAllLocked() {
    if (destroyed_) {
      return absl::OkStatus();
    }
    std::vector<std::string> dirs = ExistingDirs();
    const std::string& freezer = Dir(layout_.freezer);
    if (!freezer.empty() && PathExists(freezer + "/freezer.state")) {
      // Frozen tasks cannot fork, so one pass over cgroup.procs kills them all; the pending
      // SIGKILL is acted on at THAWED, and a killed task cannot fork any more.
      Status frozen = fs_->Write(freezer + "/freezer.state", "FROZEN");
      if (frozen.ok()) {
        auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
        while (std::chrono::steady_clock::now() < deadline) {
          auto state = fs_->Read(freezer + "/freezer.state");
          if (!state.ok() || Trim(*state) == "FROZEN") {
            break;
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
        for (const std::string& dir : dirs) {
          auto pids = ReadProcsRecursive(*fs_, dir);
          if (pids.ok()) {
            for (pid_t pid : *pids) {
              (void)::kill(pid, SIGKILL);
            }
          }
        }
        BRAGG_RETURN_IF_ERROR(Annotate(fs_->Write(freezer + "/freezer.state", "THAWED"),
                                       fmt::format("thawing cgroup {}", name_)));
      } else {
        spdlog::warn("cannot freeze cgroup {} ({}); killing without the freezer", name_,
                     std::string(frozen.message()));
      }
    }
    return Annotate(KillUntilEmpty(*fs_, dirs, kKillTimeout),
                    fmt::format("killing cgroup {}", name_));
  }

  std::shared_ptr<CgroupFs> fs_;
  std::string name_;
  Layout layout_;
  mutable std::mutex mu_;
  std::vector<std::string> dirs_;
  bool destroyed_ = false;
};

class CgroupV1Manager : public CgroupManager {
 public:
  CgroupV1Manager(std::shared_ptr<CgroupFs> fs, Layout layout)
      : fs_(std::move(fs)), layout_(std::move(layout)) {}

  std::string version() const override { return "v1"; }
  std::vector<std::string> controllers() const override {
    std::vector<std::string> out;
    for (const Hierarchy& h : layout_.hierarchies) {
      for (const std::string& c : h.controllers) {
        if (c != "cpuacct") {
          out.push_back(c);
        }
      }
    }
    std::sort(out.begin(), out.end());
    return out;
  }
  std::string parent_path() const override {
    return layout_.hierarchies[static_cast<size_t>(layout_.memory)].parent;
  }

  std::vector<std::string> parent_paths() const override {
    std::vector<std::string> paths;
    for (const Hierarchy& h : layout_.hierarchies) {
      paths.push_back(h.parent);
    }
    return paths;
  }

  Result<std::unique_ptr<Cgroup>> CreateCgroup(const std::string& name,
                                               const CgroupLimits& limits) override {
    BRAGG_ASSIGN_OR_RETURN(std::string cpus, CheckNameAndLimits(name, limits));
    if (limits.cpu_quota > 0 && layout_.cpu < 0) {
      return absl::FailedPreconditionError(fmt::format(
          "cgroup {}: a CPU quota was asked for but the cpu controller is not mounted under {}; "
          "mount it or create the sandbox without cpu_quota",
          name, parent_path()));
    }
    std::vector<std::string> dirs;
    for (const Hierarchy& h : layout_.hierarchies) {
      std::string dir = h.parent + "/" + name;
      Status s = fs_->MakeDir(dir);
      if (!s.ok()) {
        for (const std::string& made : dirs) {
          (void)RemoveCgroupTree(*fs_, made);
        }
        if (s.code() == absl::StatusCode::kAlreadyExists) {
          return absl::AlreadyExistsError(fmt::format(
              "cgroup {} already exists ({}): destroy that sandbox first, or ReapAll leftovers",
              name, dir));
        }
        return Annotate(s, fmt::format("creating cgroup {}", name));
      }
      dirs.push_back(dir);
    }
    auto cgroup = std::make_unique<CgroupV1>(fs_, name, layout_, dirs);
    Status s = ApplyLimits(dirs, cpus, limits);
    if (!s.ok()) {
      (void)cgroup->Destroy();
      return Annotate(s, fmt::format("setting limits of cgroup {}", name));
    }
    return std::unique_ptr<Cgroup>(std::move(cgroup));
  }

  Status RemoveParent() override {
    BRAGG_RETURN_IF_ERROR(ReapAll().status());
    Status status;
    for (const Hierarchy& h : layout_.hierarchies) {
      if (PathExists(h.parent)) {
        status.Update(fs_->RemoveDir(h.parent));
      }
    }
    return status;
  }

  Result<std::vector<std::string>> ReapAll() override {
    std::vector<std::string> names;
    for (const Hierarchy& h : layout_.hierarchies) {
      auto children = ListChildCgroups(h.parent);
      if (!children.ok()) {
        if (children.status().code() == absl::StatusCode::kNotFound) {
          continue;
        }
        return children.status();
      }
      for (std::string& c : *children) {
        if (std::find(names.begin(), names.end(), c) == names.end()) {
          names.push_back(std::move(c));
        }
      }
    }
    std::sort(names.begin(), names.end());
    Status status;
    for (const std::string& name : names) {
      std::vector<std::string> dirs;
      for (const Hierarchy& h : layout_.hierarchies) {
        std::string dir = h.parent + "/" + name;
        dirs.push_back(PathExists(dir) ? dir : std::string());
      }
      CgroupV1 cgroup(fs_, name, layout_, std::move(dirs));
      Status s = cgroup.Destroy();
      if (!s.ok()) {
        spdlog::warn("reaping leftover cgroup {}: {}", name, std::string(s.message()));
      }
      status.Update(s);
    }
    BRAGG_RETURN_IF_ERROR(status);
    return names;
  }

 private:
  Status ApplyLimits(const std::vector<std::string>& dirs, const std::string& cpus,
                     const CgroupLimits& limits) {
    auto dir = [&](int index) -> const std::string& { return dirs[static_cast<size_t>(index)]; };
    // cpuset.cpus and cpuset.mems start empty in a new v1 cpuset and a task cannot join until
    // both are set: copy the parent's unless the sandbox asks for its own CPUs.
    const std::string& cs = dir(layout_.cpuset);
    std::string parent = layout_.hierarchies[static_cast<size_t>(layout_.cpuset)].parent;
    std::string want_cpus = cpus;
    if (want_cpus.empty()) {
      BRAGG_ASSIGN_OR_RETURN(std::string pc, fs_->Read(parent + "/cpuset.cpus"));
      want_cpus = Trim(pc);
    }
    Status s = fs_->Write(cs + "/cpuset.cpus", want_cpus);
    if (!s.ok()) {
      return Annotate(s, fmt::format("the CPUs must be a subset of the sandbox CPU set in "
                                     "{}/cpuset.cpus",
                                     parent));
    }
    BRAGG_ASSIGN_OR_RETURN(std::string mems, fs_->Read(parent + "/cpuset.mems"));
    BRAGG_RETURN_IF_ERROR(fs_->Write(cs + "/cpuset.mems", Trim(mems)));

    const std::string& mem = dir(layout_.memory);
    if (limits.memory_bytes > 0) {
      std::string bytes = std::to_string(limits.memory_bytes);
      BRAGG_RETURN_IF_ERROR(fs_->Write(mem + "/memory.limit_in_bytes", bytes));
      // memsw (memory+swap) exists only with swap accounting; equal to the memory limit it
      // means no swap. It must be written after memory.limit_in_bytes (memsw >= limit).
      if (PathExists(mem + "/memory.memsw.limit_in_bytes")) {
        BRAGG_RETURN_IF_ERROR(fs_->Write(mem + "/memory.memsw.limit_in_bytes", bytes));
      }
    }
    if (limits.pids > 0) {
      BRAGG_RETURN_IF_ERROR(
          fs_->Write(dir(layout_.pids) + "/pids.max", std::to_string(limits.pids)));
    }
    if (limits.cpu_quota > 0) {
      uint64_t quota = std::max<uint64_t>(
          kMinCfsQuotaUs, static_cast<uint64_t>(std::llround(limits.cpu_quota * kCfsPeriodUs)));
      const std::string& cpu = dir(layout_.cpu);
      BRAGG_RETURN_IF_ERROR(fs_->Write(cpu + "/cpu.cfs_period_us", std::to_string(kCfsPeriodUs)));
      BRAGG_RETURN_IF_ERROR(fs_->Write(cpu + "/cpu.cfs_quota_us", std::to_string(quota)));
    }
    return absl::OkStatus();
  }

  std::shared_ptr<CgroupFs> fs_;
  Layout layout_;
};

}  // namespace

Result<std::unique_ptr<CgroupManager>> CreateCgroupV1Manager(const CgroupManagerOptions& options,
                                                             std::shared_ptr<CgroupFs> fs) {
  // id:controller,controller:path
  struct Line {
    std::vector<std::string> controllers;
    std::string list;
    std::string path;
  };
  std::vector<Line> lines;
  for (std::string_view raw : Split(options.self_cgroup, '\n')) {
    if (raw.empty()) {
      continue;
    }
    std::vector<std::string_view> fields = Split(raw, ':');
    if (fields.size() < 3) {
      return absl::InvalidArgumentError(fmt::format(
          "malformed /proc/self/cgroup line '{}': expected ID:CONTROLLERS:PATH", std::string(raw)));
    }
    // The path may itself contain ':'.
    size_t path_start = fields[0].size() + fields[1].size() + 2;
    Line line;
    line.list = std::string(fields[1]);
    line.path = std::string(raw.substr(path_start));
    if (line.path.empty() || line.path[0] != '/') {
      return absl::InvalidArgumentError(fmt::format(
          "malformed /proc/self/cgroup line '{}': the path must be absolute", std::string(raw)));
    }
    for (std::string_view c : Split(fields[1], ',')) {
      line.controllers.emplace_back(c);
    }
    lines.push_back(std::move(line));
  }

  Layout layout;
  std::vector<std::string> hierarchy_lists;  // Line::list of each hierarchy, for dedup
  const struct {
    const char* name;
    bool required;
    int Layout::*slot;
  } kControllers[] = {
      {"memory", true, &Layout::memory},    {"pids", true, &Layout::pids},
      {"cpuset", true, &Layout::cpuset},    {"cpu", false, &Layout::cpu},
      {"cpuacct", false, &Layout::cpuacct}, {"freezer", false, &Layout::freezer},
  };
  for (const auto& c : kControllers) {
    const Line* found = nullptr;
    for (const Line& line : lines) {
      if (std::find(line.controllers.begin(), line.controllers.end(), c.name) !=
          line.controllers.end()) {
        found = &line;
        break;
      }
    }
    std::string mount;
    if (found != nullptr) {
      for (const std::string& candidate :
           {fmt::format("{}/{}", options.root, c.name), options.root + "/" + found->list}) {
        if (PathExists(candidate + "/cgroup.procs")) {
          mount = candidate;
          break;
        }
      }
    }
    if (mount.empty()) {
      std::string why = found == nullptr
                            ? fmt::format("/proc/self/cgroup has no '{}' line", c.name)
                            : fmt::format("neither {}/{} nor {}/{} is a cgroup v1 mount",
                                          options.root, c.name, options.root, found->list);
      if (c.required) {
        return absl::FailedPreconditionError(
            fmt::format("{} controller not available in {} ({}): mount the cgroup v1 {} "
                        "hierarchy there (mount -t cgroup -o {} cgroup {}/{}) or run on cgroup v2",
                        c.name, options.root, why, c.name, c.name, options.root, c.name));
      }
      spdlog::warn("optional cgroup v1 controller {} not available ({}); continuing without it",
                   c.name, why);
      continue;
    }
    auto it = std::find(hierarchy_lists.begin(), hierarchy_lists.end(), found->list);
    if (it != hierarchy_lists.end()) {
      size_t index = static_cast<size_t>(it - hierarchy_lists.begin());
      layout.hierarchies[index].controllers.emplace_back(c.name);
      layout.*(c.slot) = static_cast<int>(index);
      continue;
    }
    std::string own = found->path == "/" ? mount : mount + found->path;
    if (!PathExists(own)) {
      return absl::FailedPreconditionError(fmt::format(
          "the agent's {} cgroup {} (from /proc/self/cgroup) does not exist: is {} the cgroupfs of "
          "this cgroup namespace? Run pboxd with the host's /sys/fs/cgroup mounted",
          c.name, own, options.root));
    }
    Hierarchy h;
    h.controllers.emplace_back(c.name);
    h.mount = mount;
    h.parent = own + "/" + options.parent_name;
    layout.*(c.slot) = static_cast<int>(layout.hierarchies.size());
    layout.hierarchies.push_back(std::move(h));
    hierarchy_lists.push_back(found->list);
  }

  for (size_t i = 0; options.create_parent && i < layout.hierarchies.size(); ++i) {
    const Hierarchy& h = layout.hierarchies[i];
    Status s = fs->MakeDir(h.parent);
    if (!s.ok() && s.code() != absl::StatusCode::kAlreadyExists) {
      return Annotate(s,
                      "creating the sandbox parent cgroup (pboxd needs root or a delegated "
                      "cgroup)");
    }
    if (static_cast<int>(i) == layout.cpuset) {
      std::string own = h.parent.substr(0, h.parent.rfind('/'));
      std::string cpus = options.cpus;
      if (cpus.empty()) {
        BRAGG_ASSIGN_OR_RETURN(std::string own_cpus, fs->Read(own + "/cpuset.cpus"));
        cpus = Trim(own_cpus);
      }
      BRAGG_ASSIGN_OR_RETURN(std::string mems, fs->Read(own + "/cpuset.mems"));
      Status w = fs->Write(h.parent + "/cpuset.cpus", cpus);
      if (!w.ok()) {
        return Annotate(w, fmt::format("the sandbox CPUs ({}) must be a subset of the agent's "
                                       "cpuset {}/cpuset.cpus",
                                       cpus, own));
      }
      BRAGG_RETURN_IF_ERROR(fs->Write(h.parent + "/cpuset.mems", Trim(mems)));
    }
  }
  return std::unique_ptr<CgroupManager>(new CgroupV1Manager(std::move(fs), std::move(layout)));
}

}  // namespace bragg::pbox
