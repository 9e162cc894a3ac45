#include "pbox/cgroup/cgroup.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#include "common/fs.h"
#include "fmt/format.h"
#include "pbox/cgroup/cgroup_internal.h"
#include "pbox/cgroup/cpuset.h"

namespace bragg::pbox {

Status CgroupFs::MakeDir(const std::string& path) {
  if (::mkdir(path.c_str(), 0755) != 0) {
    return ErrnoError("mkdir", path);
  }
  return absl::OkStatus();
}

Status CgroupFs::RemoveDir(const std::string& path) {
  if (::rmdir(path.c_str()) != 0) {
    return ErrnoError("rmdir", path);
  }
  return absl::OkStatus();
}

Result<std::string> CgroupFs::Read(const std::string& path) { return ReadFileToString(path); }

Status CgroupFs::Write(const std::string& path, std::string_view data) {
  return WriteControlFile(path, data);
}

bool PathExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

Status ValidateCgroupName(std::string_view what, const std::string& name) {
  if (name.empty() || name.size() > 128) {
    return absl::InvalidArgumentError(
        fmt::format("invalid {} '{}': must be 1-128 characters", std::string(what), name));
  }
  if (name[0] == '.') {
    return absl::InvalidArgumentError(
        fmt::format("invalid {} '{}': must not start with '.'", std::string(what), name));
  }
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '-' || c == '.';
    if (!ok) {
      return absl::InvalidArgumentError(
          fmt::format("invalid {} '{}': only letters, digits, '_', '-' and '.' are allowed",
                      std::string(what), name));
    }
  }
  return absl::OkStatus();
}

Result<uint64_t> ParseCgroupU64(const std::string& path, std::string_view text) {
  auto is_space = [](char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; };
  while (!text.empty() && is_space(text.front())) {
    text.remove_prefix(1);
  }
  while (!text.empty() && is_space(text.back())) {
    text.remove_suffix(1);
  }
  if (text.empty() || text.size() > 20) {
    return absl::InvalidArgumentError(
        fmt::format("malformed {}: expected an unsigned integer, got '{}'", path,
                    std::string(text.substr(0, 64))));
  }
  uint64_t value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') {
      return absl::InvalidArgumentError(
          fmt::format("malformed {}: expected an unsigned integer, got '{}'", path,
                      std::string(text.substr(0, 64))));
    }
    uint64_t digit = static_cast<uint64_t>(c - '0');
    if (value > (UINT64_MAX - digit) / 10) {
      return absl::InvalidArgumentError(
          fmt::format("malformed {}: '{}' overflows 64 bits", path, std::string(text)));
    }
    value = value * 10 + digit;
  }
  return value;
}

Result<uint64_t> ReadCgroupU64(CgroupFs& fs, const std::string& path) {
  BRAGG_ASSIGN_OR_RETURN(std::string text, fs.Read(path));
  return ParseCgroupU64(path, text);
}

Result<uint64_t> ReadKeyedU64(CgroupFs& fs, const std::string& path, std::string_view key) {
  BRAGG_ASSIGN_OR_RETURN(std::string text, fs.Read(path));
  std::string_view rest = text;
  while (!rest.empty()) {
    size_t nl = rest.find('\n');
    std::string_view line = rest.substr(0, nl);
    rest = nl == std::string_view::npos ? std::string_view() : rest.substr(nl + 1);
    size_t sp = line.find(' ');
    if (sp == std::string_view::npos || line.substr(0, sp) != key) {
      continue;
    }
    return ParseCgroupU64(fmt::format("{} (key {})", path, std::string(key)), line.substr(sp + 1));
  }
  return absl::NotFoundError(fmt::format("{} has no '{}' line", path, std::string(key)));
}

Result<std::vector<pid_t>> ReadProcs(CgroupFs& fs, const std::string& procs_path) {
  BRAGG_ASSIGN_OR_RETURN(std::string text, fs.Read(procs_path));
  std::vector<pid_t> pids;
  std::string_view rest = text;
  while (!rest.empty()) {
    size_t nl = rest.find('\n');
    std::string_view line = rest.substr(0, nl);
    rest = nl == std::string_view::npos ? std::string_view() : rest.substr(nl + 1);
    if (line.empty()) {
      continue;
    }
    auto value = ParseCgroupU64(procs_path, line);
    if (!value.ok() || *value == 0 || *value > 0x3fffffff) {
      return absl::InvalidArgumentError(
          fmt::format("malformed {}: '{}' is not a pid", procs_path, std::string(line)));
    }
    pids.push_back(static_cast<pid_t>(*value));
  }
  return pids;
}

Result<std::vector<std::string>> ListChildCgroups(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    return ErrnoError("opendir", dir);
  }
  std::vector<std::string> names;
  while (struct dirent* e = ::readdir(d)) {
    if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) {
      continue;
    }
    bool is_dir = e->d_type == DT_DIR;
    if (e->d_type == DT_UNKNOWN) {
      struct stat st;
      is_dir =
          ::fstatat(::dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode);
    }
    if (is_dir) {
      names.emplace_back(e->d_name);
    }
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

Result<std::vector<pid_t>> ReadProcsRecursive(CgroupFs& fs, const std::string& dir) {
  BRAGG_ASSIGN_OR_RETURN(std::vector<pid_t> pids, ReadProcs(fs, dir + "/cgroup.procs"));
  BRAGG_ASSIGN_OR_RETURN(std::vector<std::string> children, ListChildCgroups(dir));
  for (const std::string& child : children) {
    auto more = ReadProcsRecursive(fs, dir + "/" + child);
    if (!more.ok()) {
      if (more.status().code() == absl::StatusCode::kNotFound) {
        continue;  // removed while we looked
      }
      return more.status();
    }
    pids.insert(pids.end(), more->begin(), more->end());
  }
  return pids;
}

Status KillUntilEmpty(CgroupFs& fs, const std::vector<std::string>& dirs,
                      std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    std::vector<pid_t> left;
    std::string where;
    for (const std::string& dir : dirs) {
      auto pids = ReadProcsRecursive(fs, dir);
      if (!pids.ok()) {
        if (pids.status().code() == absl::StatusCode::kNotFound) {
          continue;  // already removed
        }
        return pids.status();
      }
      if (!pids->empty() && where.empty()) {
        where = dir;
      }
      left.insert(left.end(), pids->begin(), pids->end());
    }
    if (left.empty()) {
      return absl::OkStatus();
    }
    for (pid_t pid : left) {
      // ESRCH: exited since we read cgroup.procs.
      (void)::kill(pid, SIGKILL);
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      std::string list;
      for (size_t i = 0; i < left.size() && i < 16; ++i) {
        list += (i ? " " : "") + std::to_string(left[i]);
      }
      return absl::DeadlineExceededError(fmt::format(
          "cgroup {} still has processes ({}) {} ms after SIGKILL: they may be stuck in "
          "uninterruptible sleep (check /proc/PID/stack) or be frozen by another freezer",
          where, list, timeout.count()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

Status RemoveCgroupTree(CgroupFs& fs, const std::string& dir) {
  auto children = ListChildCgroups(dir);
  if (!children.ok()) {
    return children.status().code() == absl::StatusCode::kNotFound ? absl::OkStatus()
                                                                   : children.status();
  }
  for (const std::string& child : *children) {
    BRAGG_RETURN_IF_ERROR(RemoveCgroupTree(fs, dir + "/" + child));
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  for (;;) {
    Status s = fs.RemoveDir(dir);
    if (s.ok() || s.code() == absl::StatusCode::kNotFound) {
      return absl::OkStatus();
    }
    // EBUSY: the css of a task killed a moment ago is still going away.
    if (s.code() != absl::StatusCode::kFailedPrecondition ||
        std::chrono::steady_clock::now() >= deadline) {
      return Annotate(s, "cannot remove cgroup (does it still hold processes?)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

Result<std::string> CanonicalCpus(const std::string& cpus) {
  BRAGG_ASSIGN_OR_RETURN(CpuSet set, CpuSet::Parse(cpus));
  if (set.empty()) {
    return absl::InvalidArgumentError(
        fmt::format("invalid cpuset '{}': no CPUs (leave it empty to inherit)", cpus));
  }
  return set.ToString();
}

Result<std::string> CheckNameAndLimits(const std::string& name, const CgroupLimits& limits) {
  BRAGG_RETURN_IF_ERROR(ValidateCgroupName("sandbox cgroup name", name));
  if (!std::isfinite(limits.cpu_quota) || limits.cpu_quota < 0) {
    return absl::InvalidArgumentError(
        fmt::format("invalid cpu_quota {} for cgroup {}: must be >= 0", limits.cpu_quota, name));
  }
  if (limits.cpus.empty()) {
    return std::string();
  }
  return CanonicalCpus(limits.cpus);
}

Result<std::string> DetectCgroupVersion(const std::string& root) {
  if (PathExists(root + "/cgroup.controllers")) {
    return std::string("v2");
  }
  for (const char* c : {"memory", "pids", "cpuset", "cpu", "freezer"}) {
    if (PathExists(fmt::format("{}/{}", root, c))) {
      return std::string("v1");
    }
  }
  return absl::FailedPreconditionError(fmt::format(
      "no cgroup filesystem at {}: neither {}/cgroup.controllers (cgroup v2) nor per-controller "
      "directories such as {}/memory (cgroup v1) exist; mount cgroupfs there or pass the right "
      "root",
      root, root, root));
}

Result<std::unique_ptr<CgroupManager>> CreateCgroupManager(const CgroupManagerOptions& options,
                                                           std::shared_ptr<CgroupFs> fs) {
  BRAGG_RETURN_IF_ERROR(ValidateCgroupName("cgroup parent name", options.parent_name));
  CgroupManagerOptions opts = options;
  if (opts.self_cgroup.empty()) {
    BRAGG_ASSIGN_OR_RETURN(opts.self_cgroup, ReadFileToString("/proc/self/cgroup"));
  }
  if (!opts.cpus.empty()) {
    BRAGG_ASSIGN_OR_RETURN(opts.cpus, CanonicalCpus(opts.cpus));
  }
  std::string mode = opts.mode;
  if (mode == "auto") {
    BRAGG_ASSIGN_OR_RETURN(mode, DetectCgroupVersion(opts.root));
  }
  if (mode == "v1") {
    return CreateCgroupV1Manager(opts, std::move(fs));
  }
  if (mode == "v2") {
    return CreateCgroupV2Manager(opts, std::move(fs));
  }
  return absl::InvalidArgumentError(
      fmt::format("invalid cgroup mode '{}': use auto, v1 or v2", opts.mode));
}

Result<std::unique_ptr<CgroupManager>> CgroupManager::Create(const CgroupManagerOptions& options) {
  return CreateCgroupManager(options, std::make_shared<CgroupFs>());
}

}  // namespace bragg::pbox
