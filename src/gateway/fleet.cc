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

Pool::Pool(std::string name, RouterOptions options)
    : name_(std::move(name)), router_(std::move(options)) {}

Worker& Pool::Record(int worker) const {
  if (worker < 0 || static_cast<size_t>(worker) >= size_) {
    throw std::out_of_range(fmt::format("pool {} has no worker {}", name_, worker));
  }
  return *router_.record(worker);
}

Status Pool::AddWorker(const std::string& url, bool healthy) {
  BRAGG_ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(url));
  std::string canonical = fmt::format("http://{}:{}", hp.host, hp.port);
  std::lock_guard<std::mutex> lock(mu_);
  int index = router_.AddWorker(canonical, healthy);
  if (static_cast<size_t>(index) == size_) {
    router_.record(index)->client = std::make_unique<ClientPool>(hp);
    ++size_;
  }
  return absl::OkStatus();
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

Fleet::Fleet(const RouterOptions& main)
    : main_("main", main), prefill_("prefill", Sticky(main)), decode_("decode", Sticky(main)) {}

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
