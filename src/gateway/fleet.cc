#include "gateway/fleet.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <stdexcept>

namespace bragg::gateway {

namespace {

RouterOptions Sticky(RouterOptions options) {
  options.policy = Policy::kSticky;
  return options;
}

}  // namespace

Pool::Pool(std::string name, RouterOptions options, std::string worker_api_key)
    : name_(std::move(name)),
      worker_api_key_(std::move(worker_api_key)),
      router_(std::move(options)) {}

Worker& Pool::Record(int worker) const {
  if (worker < 0 || static_cast<size_t>(worker) >= size_) {
    throw std::out_of_range(fmt::format("pool {} has no worker {}", name_, worker));
  }
  return *router_.record(worker);
}

namespace {

Result<std::string> Canonical(const std::string& url, HostPort* hp) {
  BRAGG_ASSIGN_OR_RETURN(*hp, ParseHostPort(url));
  return fmt::format("http://{}:{}", hp->host, hp->port);
}

}  // namespace

Result<bool> Pool::AddWorker(const std::string& url, bool healthy, int bootstrap_port) {
  if (bootstrap_port < -1 || bootstrap_port > 65535) {
    return absl::InvalidArgumentError(
        fmt::format("bootstrap port {} is not a port (0-65535)", bootstrap_port));
  }
  HostPort hp;
  BRAGG_ASSIGN_OR_RETURN(std::string canonical, Canonical(url, &hp));
  std::lock_guard<std::mutex> lock(mu_);
  bool added = false;
  int index = router_.AddWorker(canonical, healthy, &added);
  Worker* w = router_.record(index);
  if (static_cast<size_t>(index) == size_) {
    w->client = std::make_unique<ClientPool>(hp, worker_api_key_);
    ++size_;
  }
  if (added) {
    // A member again after a removal starts afresh: the health loop checks its version.
    w->bootstrap_port = bootstrap_port;
    w->health_failures = 0;
    w->quarantined = false;
    w->needs_continue = false;
    w->version.clear();
  }
  return added;
}

bool Pool::RemoveWorker(const std::string& url) {
  HostPort hp;
  Result<std::string> canonical = Canonical(url, &hp);
  if (!canonical.ok()) {
    return false;
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<WorkerSnapshot> snap = router_.Snapshot();
  for (size_t i = 0; i < snap.size() && i < size_; ++i) {
    if (snap[i].url == *canonical && router_.RemoveWorker(static_cast<int>(i))) {
      spdlog::info("worker {} removed from pool {}", *canonical, name_);
      return true;
    }
  }
  return false;
}

std::vector<std::string> Pool::MemberUrls() const {
  size_t n = size();
  std::vector<std::string> out;
  std::vector<WorkerSnapshot> snap = router_.Snapshot();
  for (size_t i = 0; i < snap.size() && i < n; ++i) {
    if (!snap[i].removed) {
      out.push_back(snap[i].url);
    }
  }
  return out;
}

int Pool::bootstrap_port(int worker) const {
  std::lock_guard<std::mutex> lock(mu_);
  return Record(worker).bootstrap_port;
}

size_t Pool::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return size_;
}

ClientPool* Pool::Client(int worker) {
  std::lock_guard<std::mutex> lock(mu_);
  return Record(worker).client.get();
}

std::string Pool::url(int worker) const {
  std::lock_guard<std::mutex> lock(mu_);
  return Record(worker).url;
}

void Pool::MarkDown(int worker, std::string_view why) {
  spdlog::warn("worker {} of pool {} is down: {}", router_.Snapshot()[worker].url, name_, why);
  router_.SetHealthy(worker, false);
}

void Pool::Quarantine(int worker, std::string_view why, bool needs_continue) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Worker& w = Record(worker);
    w.quarantined = true;
    w.needs_continue = w.needs_continue || needs_continue;
  }
  MarkDown(worker, why);
}

int Pool::RecordHealthCheck(int worker, bool ok) {
  std::lock_guard<std::mutex> lock(mu_);
  Worker& w = Record(worker);
  w.health_failures = ok ? 0 : w.health_failures + 1;
  return w.health_failures;
}

void Pool::RecordAnswer(int worker, int status) {
  if (status >= 500) {
    return;
  }
  auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  Record(worker).last_answer = now;
}

bool Pool::AnsweredSince(int worker, std::chrono::steady_clock::time_point t) const {
  std::lock_guard<std::mutex> lock(mu_);
  return Record(worker).last_answer >= t;
}

bool Pool::quarantined(int worker) const {
  std::lock_guard<std::mutex> lock(mu_);
  return Record(worker).quarantined;
}

bool Pool::needs_continue(int worker) const {
  std::lock_guard<std::mutex> lock(mu_);
  return Record(worker).needs_continue;
}

void Pool::SetNeedsContinue(int worker, bool needs_continue) {
  std::lock_guard<std::mutex> lock(mu_);
  Record(worker).needs_continue = needs_continue;
}

void Pool::SetVersion(int worker, std::string version) {
  std::lock_guard<std::mutex> lock(mu_);
  Record(worker).version = std::move(version);
}

std::string Pool::version(int worker) const {
  std::lock_guard<std::mutex> lock(mu_);
  return Record(worker).version;
}

void Pool::Admitted(int worker, std::string version) {
  std::lock_guard<std::mutex> lock(mu_);
  Worker& w = Record(worker);
  w.version = std::move(version);
  w.quarantined = false;
}

std::vector<std::string> Pool::Versions() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  out.reserve(size_);
  for (size_t i = 0; i < size_; ++i) {
    out.push_back(Record(static_cast<int>(i)).version);
  }
  return out;
}

Fleet::Fleet(const RouterOptions& main, std::string worker_api_key)
    : main_("main", main, worker_api_key),
      prefill_("prefill", Sticky(main), worker_api_key),
      decode_("decode", Sticky(main), worker_api_key) {}

std::vector<Target> Fleet::HealthyTargets() {
  std::vector<Target> out;
  for (Pool* pool : pools()) {
    std::vector<WorkerSnapshot> snap = pool->router().Snapshot();
    for (size_t i = 0; i < snap.size(); ++i) {
      if (snap[i].healthy) {
        out.push_back({pool, static_cast<int>(i), snap[i].url});
      }
    }
  }
  return out;
}

std::vector<Target> Fleet::Members() {
  std::vector<Target> out;
  for (Pool* pool : pools()) {
    size_t n = pool->size();
    std::vector<WorkerSnapshot> snap = pool->router().Snapshot();
    for (size_t i = 0; i < snap.size() && i < n; ++i) {
      if (!snap[i].removed) {
        out.push_back({pool, static_cast<int>(i), snap[i].url});
      }
    }
  }
  return out;
}

std::string Fleet::version() const {
  std::lock_guard<std::mutex> lock(version_mu_);
  return version_;
}

void Fleet::set_version(std::string version) {
  std::lock_guard<std::mutex> lock(version_mu_);
  version_ = std::move(version);
}

std::string Fleet::VersionOr(const std::string& reported) {
  std::lock_guard<std::mutex> lock(version_mu_);
  if (version_.empty()) {
    version_ = reported;
  }
  return version_;
}

}  // namespace bragg::gateway
