#include "pbox/sandbox_manager.h"

#include <sys/random.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>

#include "absl/cleanup/cleanup.h"
#include "fmt/format.h"
#include "spdlog/spdlog.h"

namespace bragg::pbox {

std::string NewId(const char* prefix) {
  unsigned char bytes[6];
  if (::getrandom(bytes, sizeof(bytes), 0) != sizeof(bytes)) {
    // getrandom on a booted kernel does not fail for 6 bytes; fall back to the clock.
    uint64_t t = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    std::memcpy(bytes, &t, sizeof(bytes));
  }
  std::string out = prefix;
  for (unsigned char b : bytes) {
    out += fmt::format("{:02x}", b);
  }
  return out;
}

namespace {

bool HasController(const CgroupManager& cgroups, const char* name) {
  std::vector<std::string> have = cgroups.controllers();
  return std::find(have.begin(), have.end(), name) != have.end();
}

}  // namespace

SandboxManager::SandboxManager(std::map<std::string, Runtime*> runtimes,
                               std::string default_runtime, ImageStore* images,
                               CgroupManager* cgroups, CpuAllocator* cpus, SandboxDefaults defaults,
                               uint32_t max_sandboxes, ManagerHooks hooks)
    : runtimes_(std::move(runtimes)),
      default_runtime_(std::move(default_runtime)),
      images_(images),
      cgroups_(cgroups),
      cpus_(cpus),
      pin_cpus_(HasController(*cgroups, "cpuset")),
      cpu_controller_(HasController(*cgroups, "cpu")),
      defaults_(defaults),
      max_sandboxes_(max_sandboxes),
      hooks_(std::move(hooks)) {
  ttl_thread_ = std::thread([this] { TtlLoop(); });
}

SandboxManager::~SandboxManager() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  ttl_cv_.notify_all();
  ttl_thread_.join();
  DestroyAll();
}

Result<std::string> SandboxManager::OpenSession(const std::string& client_name,
                                                const std::string& job_id, const CpuSet& cpus) {
  if (!cpus.empty() && !pin_cpus_) {
    return absl::FailedPreconditionError(fmt::format(
        "session CPUs {} cannot be held: this agent's cgroup has no cpuset controller (delegate "
        "cpuset to it, docs/cluster.md)",
        cpus.ToString()));
  }
  if (!cpus.empty() && !cpus.IsSubsetOf(cpus_->pool())) {
    return absl::InvalidArgumentError(
        fmt::format("session CPUs {} are not within this agent's sandbox CPUs {}", cpus.ToString(),
                    cpus_->pool().ToString()));
  }
  std::string id = NewId("ss-");
  std::lock_guard<std::mutex> lock(mu_);
  sessions_[id];
  if (!cpus.empty()) {
    session_cpus_[id] = cpus;
  }
  spdlog::info("session {} opened by \"{}\"{}{}", id, client_name,
               job_id.empty() ? "" : fmt::format(" for job {}", job_id),
               cpus.empty() ? "" : fmt::format(" on CPUs {}", cpus.ToString()));
  return id;
}

void SandboxManager::CloseSession(const std::string& session_id) {
  std::vector<std::shared_ptr<Sandbox>> victims;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(session_id);
    if (it == sessions_.end()) {
      return;
    }
    for (const std::string& id : it->second) {
      auto sb = sandboxes_.find(id);
      if (sb != sandboxes_.end()) {
        victims.push_back(sb->second);
        sandboxes_.erase(sb);
      }
    }
    sessions_.erase(it);
    session_cpus_.erase(session_id);
  }
  size_t n = victims.size();
  auto start = std::chrono::steady_clock::now();
  DestroyMany(std::move(victims));
  spdlog::info(
      "session {} closed: {} sandboxes destroyed in {:.1f} ms", session_id, n,
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
}

Status SandboxManager::Validate(const SandboxSettings& s) const {
  if (s.cpus > cpus_->pool().size()) {
    return absl::InvalidArgumentError(
        fmt::format("asked for {} CPUs, but the agent's sandbox CPU set {} has {}", s.cpus,
                    cpus_->pool().ToString(), cpus_->pool().size()));
  }
  // Written so that NaN fails too (every comparison with NaN is false).
  if (!(s.cpu_quota >= 0 && s.cpu_quota <= 4096)) {
    return absl::InvalidArgumentError(fmt::format("cpu_quota {} out of range", s.cpu_quota));
  }
  if (s.memory_bytes < (16ull << 20)) {
    return absl::InvalidArgumentError(
        fmt::format("memory {} bytes is below the 16 MiB minimum", s.memory_bytes));
  }
  if (defaults_.max_memory_bytes != 0 && s.memory_bytes > defaults_.max_memory_bytes) {
    return absl::InvalidArgumentError(
        fmt::format("memory {} bytes is above the agent's per-sandbox maximum {}", s.memory_bytes,
                    defaults_.max_memory_bytes));
  }
  if (s.disk_bytes < (1ull << 20)) {
    return absl::InvalidArgumentError(
        fmt::format("disk {} bytes is below the 1 MiB minimum", s.disk_bytes));
  }
  if (s.pids < 8) {
    return absl::InvalidArgumentError(fmt::format("pids {} is below the minimum of 8", s.pids));
  }
  if (s.workdir.empty() || s.workdir[0] != '/') {
    return absl::InvalidArgumentError(
        fmt::format("workdir \"{}\" must be an absolute path", s.workdir));
  }
  for (const auto& [k, v] : s.env) {
    if (k.empty() || k.find('=') != std::string::npos || k.find('\0') != std::string::npos ||
        v.find('\0') != std::string::npos) {
      return absl::InvalidArgumentError(fmt::format("bad environment variable \"{}\"", k));
    }
  }
  return absl::OkStatus();
}

Result<std::shared_ptr<Sandbox>> SandboxManager::Create(const std::string& session_id,
                                                        const SandboxSettings& requested,
                                                        const CallerGone& caller_gone) {
  return CreateImpl(session_id, requested, {.caller_gone = caller_gone});
}

Result<std::shared_ptr<Sandbox>> SandboxManager::CreateImpl(const std::string& session_id,
                                                            const SandboxSettings& requested,
                                                            const CreateOptions& options) {
  auto t0 = std::chrono::steady_clock::now();
  if (!options.admitted) {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      return absl::UnavailableError("the agent is shutting down");
    }
    if (!session_id.empty() && sessions_.count(session_id) == 0) {
      return absl::FailedPreconditionError(fmt::format(
          "session {} is not open (it ended, or belongs to another agent)", session_id));
    }
    if (sandboxes_.size() + creating_ >= max_sandboxes_) {
      if (hooks_.on_reject) {
        hooks_.on_reject();
      }
      return absl::ResourceExhaustedError(
          fmt::format("the agent is at its limit of {} sandboxes: destroy some, or start pboxd "
                      "with a larger --max-sandboxes",
                      max_sandboxes_));
    }
    ++creating_;
  }
  absl::Cleanup creating_done = [this, n = options.admitted ? 0 : 1] { EndCreating(n); };

  SandboxSettings base;
  base.image = "host";
  base.runtime = default_runtime_;
  base.cpus = 1;
  base.cpu_quota = 0;
  base.memory_bytes = defaults_.memory_bytes;
  base.disk_bytes = defaults_.disk_bytes;
  base.pids = defaults_.pids;
  base.workdir = "/";
  // Only a sandbox outside any session has an idle TTL by default.
  base.idle_ttl_seconds = session_id.empty() ? defaults_.detached_ttl_seconds : 0;
  SandboxSettings s = FillUnset(requested, base);
  BRAGG_RETURN_IF_ERROR(Validate(s));
  auto rt = runtimes_.find(s.runtime);
  if (rt == runtimes_.end()) {
    std::string known;
    for (const auto& [name, _] : runtimes_) {
      known += (known.empty() ? "" : ", ") + name;
    }
    return absl::InvalidArgumentError(
        fmt::format("unknown runtime \"{}\" (this agent runs: {})", s.runtime, known));
  }
  BRAGG_ASSIGN_OR_RETURN(ImageLease image, images_->Acquire(s.image));

  std::string id = NewId("sb-");
  CpuSet session_cpus;  // the session's own CPU set, if it was opened with one
  if (!session_id.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = session_cpus_.find(session_id); it != session_cpus_.end()) {
      session_cpus = it->second;
    }
  }
  CpuSet cpus;
  if (pin_cpus_) {
    BRAGG_ASSIGN_OR_RETURN(cpus,
                           cpus_->Allocate(s.cpus, session_cpus.empty() ? nullptr : &session_cpus));
  }
  absl::Cleanup cpus_release = [allocator = cpus_, cpus] { allocator->Release(cpus); };

  CgroupLimits limits;
  limits.memory_bytes = s.memory_bytes;
  limits.pids = rt->second->HostPidsLimit(s.pids);
  limits.cpus = cpus.ToString();
  limits.cpu_quota = s.cpu_quota;
  if (!pin_cpus_ && s.cpu_quota <= 0 && cpu_controller_) {
    limits.cpu_quota = static_cast<double>(s.cpus);  // N CPUs' worth of time, on shared CPUs
  }
  const auto t_cgroup = std::chrono::steady_clock::now();
  BRAGG_ASSIGN_OR_RETURN(std::unique_ptr<Cgroup> cgroup, cgroups_->CreateCgroup(id, limits));
  const double cgroup_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_cgroup)
          .count();

  LaunchSpec launch;
  launch.id = id;
  launch.image = &image.image();
  launch.disk_bytes = s.disk_bytes;
  launch.shm_bytes = std::min<uint64_t>(64ull << 20, s.memory_bytes / 2);
  launch.hostname = id;
  launch.cgroup = cgroup.get();
  launch.pids = s.pids;
  if (options.frozen != nullptr) {
    launch.frozen_lower_dirs = options.frozen->LowerDirs();
  }
  auto runtime_sandbox = rt->second->Start(launch);
  if (!runtime_sandbox.ok()) {
    (void)cgroup->Destroy();
    return runtime_sandbox.status();
  }
  auto sandbox = std::make_shared<Sandbox>(id, session_id, s, cpus, std::move(cgroup),
                                           std::move(*runtime_sandbox));
  sandbox->HoldImage(std::move(image));
  sandbox->set_frozen_layer(options.frozen);
  if (s.workdir != "/") {
    Status st = sandbox->fs().MakeDir(s.workdir, 0755, /*parents=*/true);
    if (!st.ok() && st.code() != absl::StatusCode::kAlreadyExists) {
      (void)sandbox->Destroy();
      return Annotate(st, "creating the workdir");
    }
  }
  if (options.publish && options.caller_gone && options.caller_gone()) {
    (void)sandbox->Destroy();
    return absl::CancelledError(fmt::format(
        "the caller went away while sandbox {} was being created; it was destroyed", id));
  }
  bool orphaned = false;
  if (options.publish) {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ || (!session_id.empty() && sessions_.count(session_id) == 0)) {
      orphaned = true;
    } else {
      sandboxes_[id] = sandbox;
      if (!session_id.empty()) {
        sessions_[session_id].insert(id);
      }
    }
  }
  if (orphaned) {
    (void)sandbox->Destroy();
    return absl::FailedPreconditionError(
        fmt::format("session {} ended while the sandbox was being created", session_id));
  }
  std::move(cpus_release).Cancel();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (hooks_.on_create) {
    hooks_.on_create(seconds);
  }
  spdlog::debug("sandbox {} created in {:.2f} ms (cgroup {:.2f} ms, session {}, cpus {})", id,
                seconds * 1e3, cgroup_ms, session_id.empty() ? "-" : session_id, cpus.ToString());
  return sandbox;
}

void SandboxManager::EndCreating(size_t n) {
  if (n == 0) {
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  creating_ -= n;
}

Result<std::shared_ptr<Sandbox>> SandboxManager::Get(const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sandboxes_.find(id);
  if (it == sandboxes_.end()) {
    return absl::NotFoundError(fmt::format("no sandbox {} on this agent", id));
  }
  return it->second;
}

Status SandboxManager::Destroy(const std::string& id) {
  std::shared_ptr<Sandbox> victim;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sandboxes_.find(id);
    if (it == sandboxes_.end()) {
      return absl::NotFoundError(fmt::format("no sandbox {} on this agent", id));
    }
    victim = it->second;
    sandboxes_.erase(it);
    auto s = sessions_.find(victim->session_id());
    if (s != sessions_.end()) {
      s->second.erase(id);
    }
  }
  DestroyMany({victim});
  return absl::OkStatus();
}

void SandboxManager::DestroyMany(std::vector<std::shared_ptr<Sandbox>> victims) {
  auto destroy_one = [this](const std::shared_ptr<Sandbox>& sb) {
    Status s = sb->Destroy();
    if (!s.ok()) {
      spdlog::warn("destroying sandbox {}: {}", sb->id(), std::string(s.message()));
    }
    cpus_->Release(sb->cpus());
    if (hooks_.on_destroy) {
      hooks_.on_destroy();
    }
  };
  if (victims.size() <= 1) {
    for (const auto& sb : victims) {
      destroy_one(sb);
    }
    return;
  }
  // Teardown waits on the kernel (namespace exit, cgroup removal): run a few in parallel.
  size_t workers = std::min<size_t>(victims.size(), 8);
  std::atomic<size_t> next{0};
  std::vector<std::thread> threads;
  for (size_t w = 0; w < workers; ++w) {
    threads.emplace_back([&] {
      for (size_t i = next.fetch_add(1); i < victims.size(); i = next.fetch_add(1)) {
        destroy_one(victims[i]);
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
}

std::vector<std::shared_ptr<Sandbox>> SandboxManager::List(const std::string& session_id) {
  std::vector<std::shared_ptr<Sandbox>> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, sb] : sandboxes_) {
    if (session_id.empty() || sb->session_id() == session_id) {
      out.push_back(sb);
    }
  }
  return out;
}

void SandboxManager::DestroyAll() {
  std::vector<std::shared_ptr<Sandbox>> victims;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, sb] : sandboxes_) {
      victims.push_back(sb);
    }
    sandboxes_.clear();
    for (auto& [sid, ids] : sessions_) {
      ids.clear();
    }
  }
  DestroyMany(std::move(victims));
}

size_t SandboxManager::ReapIdle(int64_t now_unix_ms) {
  std::vector<std::shared_ptr<Sandbox>> victims;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = sandboxes_.begin(); it != sandboxes_.end();) {
      const auto& sb = it->second;
      uint32_t ttl = sb->settings().idle_ttl_seconds;
      if (ttl != 0 && sb->running_commands() == 0 && sb->transfers() == 0 &&
          now_unix_ms - sb->last_used_unix_ms() > static_cast<int64_t>(ttl) * 1000) {
        victims.push_back(sb);
        auto s = sessions_.find(sb->session_id());
        if (s != sessions_.end()) {
          s->second.erase(sb->id());
        }
        it = sandboxes_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (const auto& sb : victims) {
    spdlog::info("sandbox {} idle for over {} s: destroying", sb->id(),
                 sb->settings().idle_ttl_seconds);
  }
  size_t n = victims.size();
  DestroyMany(std::move(victims));
  return n;
}

size_t SandboxManager::live() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sandboxes_.size();
}

void SandboxManager::TtlLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    ttl_cv_.wait_for(lock, std::chrono::seconds(1));
    if (stopping_) {
      break;
    }
    lock.unlock();
    ReapIdle(UnixMillisNow());
    lock.lock();
  }
}

}  // namespace bragg::pbox
