#include "pbox/client_limiter.h"

#include <algorithm>
#include <cmath>
#include <thread>

#include "fmt/format.h"

namespace bragg::pbox {
namespace {

// Past this many tracked clients, a lookup first forgets every idle one (bounds the map
// against a client that sends a new id per call).
constexpr size_t kSweepAbove = 1024;
constexpr size_t kMaxClientIdBytes = 128;

}  // namespace

namespace {

// A rate that is negative or not a number means no pacing (NaN would poison every budget).
ClientLimits Sane(ClientLimits limits) {
  if (!(limits.refusals_per_second > 0) || !std::isfinite(limits.refusals_per_second)) {
    limits.refusals_per_second = 0;
  }
  return limits;
}

}  // namespace

std::string ClientKey(std::string_view client_id_metadata, std::string_view peer) {
  if (!client_id_metadata.empty()) {
    return "id:" + std::string(client_id_metadata.substr(0, kMaxClientIdBytes));
  }
  return "peer:" + std::string(peer);
}

ClientLimiter::ClientLimiter(ClientLimits limits, std::function<Clock::time_point()> now,
                             std::function<void(std::chrono::microseconds)> sleep)
    : limits_(Sane(limits)),
      now_(std::move(now)),
      sleep_(std::move(sleep)),
      next_sweep_(kSweepAbove) {}

ClientLimiter::~ClientLimiter() = default;

ClientLimiter::Slot::Slot(Slot&& other) noexcept
    : limiter_(other.limiter_), client_(std::move(other.client_)), kind_(other.kind_) {
  other.limiter_ = nullptr;
}

ClientLimiter::Slot& ClientLimiter::Slot::operator=(Slot&& other) noexcept {
  if (this != &other) {
    Release();
    limiter_ = other.limiter_;
    client_ = std::move(other.client_);
    kind_ = other.kind_;
    other.limiter_ = nullptr;
  }
  return *this;
}

ClientLimiter::Slot::~Slot() { Release(); }

void ClientLimiter::Slot::Release() {
  if (limiter_ != nullptr) {
    limiter_->Release(client_, kind_);
    limiter_ = nullptr;
  }
}

void ClientLimiter::Refill(State* st, Clock::time_point now) const {
  double burst = std::max(1.0, limits_.refusals_per_second);
  if (now > st->refilled) {
    double elapsed = std::chrono::duration<double>(now - st->refilled).count();
    st->tokens = std::min(burst, st->tokens + elapsed * limits_.refusals_per_second);
    st->refilled = now;
  }
}

void ClientLimiter::MaybeForget(std::map<std::string, State>::iterator it, Clock::time_point now) {
  State& st = it->second;
  if (st.creates != 0 || st.execs != 0 || st.transfers != 0 || st.held != 0) {
    return;
  }
  Refill(&st, now);
  if (limits_.refusals_per_second <= 0 || st.tokens >= std::max(1.0, limits_.refusals_per_second)) {
    clients_.erase(it);
  }
}

ClientLimiter::State& ClientLimiter::Find(const std::string& client, Clock::time_point now) {
  auto it = clients_.find(client);
  if (it != clients_.end()) {
    return it->second;
  }
  if (clients_.size() >= next_sweep_) {
    for (auto i = clients_.begin(); i != clients_.end();) {
      auto next = std::next(i);
      MaybeForget(i, now);
      i = next;
    }
    // Amortized: what could not be forgotten yet waits until the map has doubled, so a client
    // minting a new id per call does not make every lookup walk the whole map.
    next_sweep_ = std::max(kSweepAbove, 2 * clients_.size());
  }
  State& st = clients_[client];
  st.tokens = std::max(1.0, limits_.refusals_per_second);
  st.refilled = now;
  return st;
}

Result<ClientLimiter::Slot> ClientLimiter::Admit(const std::string& client, Kind kind) {
  std::lock_guard<std::mutex> lock(mu_);
  State& st = Find(client, now_());
  uint32_t& count = CountOf(st, kind);
  uint32_t cap = CapOf(kind);
  if (cap != 0 && count >= cap) {
    switch (kind) {
      case Kind::kCreate:
        return absl::ResourceExhaustedError(
            fmt::format("this client already has {} sandbox creations in flight, the agent's "
                        "per-client limit (pboxd --client-max-creates): wait for some to finish",
                        cap));
      case Kind::kExec:
        return absl::ResourceExhaustedError(
            fmt::format("this client already has {} commands running, the agent's per-client "
                        "limit (pboxd --client-max-execs): wait for some to finish",
                        cap));
      case Kind::kTransfer:
        return absl::ResourceExhaustedError(
            fmt::format("this client already has {} file transfers open, the agent's per-client "
                        "limit (pboxd --client-max-transfers): finish or abandon some first "
                        "(an unused ticket lapses when it expires)",
                        cap));
    }
  }
  ++count;
  return Slot(this, client, kind);
}

uint32_t& ClientLimiter::CountOf(State& st, Kind kind) {
  switch (kind) {
    case Kind::kCreate:
      return st.creates;
    case Kind::kExec:
      return st.execs;
    case Kind::kTransfer:
      break;
  }
  return st.transfers;
}

uint32_t ClientLimiter::CapOf(Kind kind) const {
  switch (kind) {
    case Kind::kCreate:
      return limits_.max_creates;
    case Kind::kExec:
      return limits_.max_execs;
    case Kind::kTransfer:
      break;
  }
  return limits_.max_transfers;
}

void ClientLimiter::Release(const std::string& client, Kind kind) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = clients_.find(client);
  if (it == clients_.end()) {
    return;
  }
  uint32_t& count = CountOf(it->second, kind);
  if (count > 0) {
    --count;
  }
  MaybeForget(it, now_());
}

std::chrono::microseconds ClientLimiter::DelayLocked(State* st, Clock::time_point now) const {
  Refill(st, now);
  double hold_s = limits_.refusal_hold_ms / 1000.0;
  // The debt is bounded: a client that stops is back to its full burst within
  // refusal_hold_ms plus one burst's worth of refill.
  st->tokens = std::max(st->tokens - 1.0, -limits_.refusals_per_second * hold_s);
  if (st->tokens >= 0 || st->held >= limits_.max_held_refusals) {
    return std::chrono::microseconds(0);
  }
  double wait_s = std::min(hold_s, -st->tokens / limits_.refusals_per_second);
  return std::chrono::microseconds(static_cast<int64_t>(wait_s * 1e6));
}

std::chrono::microseconds ClientLimiter::RefusalDelay(const std::string& client) {
  if (limits_.refusals_per_second <= 0) {
    return std::chrono::microseconds(0);
  }
  std::lock_guard<std::mutex> lock(mu_);
  Clock::time_point now = now_();
  return DelayLocked(&Find(client, now), now);
}

void ClientLimiter::PaceRefusal(const std::string& client) {
  if (limits_.refusals_per_second <= 0) {
    return;
  }
  std::chrono::microseconds delay;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Clock::time_point now = now_();
    State& st = Find(client, now);
    delay = DelayLocked(&st, now);
    if (delay.count() <= 0) {
      return;
    }
    ++st.held;
  }
  if (sleep_) {
    sleep_(delay);
  } else {
    std::this_thread::sleep_for(delay);
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = clients_.find(client);
  if (it != clients_.end()) {
    --it->second.held;
    MaybeForget(it, now_());
  }
}

size_t ClientLimiter::tracked_clients() const {
  std::lock_guard<std::mutex> lock(mu_);
  return clients_.size();
}

}  // namespace bragg::pbox
