#pragma once

// Per-client fairness of the agent's admission (docs/pbox.md "Admission"): caps on the calls
// one client may have in flight, and pacing of the refusals it gets, so that a client that
// hammers a full agent cannot take the agent's CPU and threads from every other client.
//
// A client is what ClientKey says: the "x-pbox-client" id its library sends (one per client
// object), else its peer address. A client that forges a new id per call escapes the
// per-client caps, not the agent's global limit.

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>

#include "common/status.h"

namespace bragg::pbox {

struct ClientLimits {
  // CreateSandbox and CloneSandbox calls one client may have in flight; 0: no cap.
  uint32_t max_creates = 64;
  // Exec and Run calls one client may have in flight; 0: no cap.
  uint32_t max_execs = 1024;
  // Data-channel transfers (OpenTransfer tickets not yet used up, and transfers moving) one
  // client may hold at once; 0: no cap.
  uint32_t max_transfers = 256;
  // Refusals (RESOURCE_EXHAUSTED) one client gets at once per second, with a burst of as
  // many; beyond that each refusal is held until the client's budget allows it, at most
  // refusal_hold_ms. 0 (or negative, infinite, NaN): refusals are never held.
  double refusals_per_second = 20;
  uint32_t refusal_hold_ms = 200;
  // Refusals held at once for one client; beyond that they are answered at once (this
  // bounds the agent threads one client can park).
  uint32_t max_held_refusals = 256;
};

// Thread-safe.
class ClientLimiter {
 public:
  using Clock = std::chrono::steady_clock;
  enum class Kind { kCreate, kExec, kTransfer };

  // `now` is the clock (tests pass a fake one); `sleep` holds a refusal (tests record it).
  explicit ClientLimiter(
      ClientLimits limits, std::function<Clock::time_point()> now = [] { return Clock::now(); },
      std::function<void(std::chrono::microseconds)> sleep = nullptr);
  ~ClientLimiter();
  ClientLimiter(const ClientLimiter&) = delete;
  ClientLimiter& operator=(const ClientLimiter&) = delete;

  // One admitted call: releases its place in its client's count when destroyed. Move-only;
  // must not outlive the limiter.
  class Slot {
   public:
    Slot() = default;
    Slot(Slot&& other) noexcept;
    Slot& operator=(Slot&& other) noexcept;
    Slot(const Slot&) = delete;
    Slot& operator=(const Slot&) = delete;
    ~Slot();

   private:
    friend class ClientLimiter;
    Slot(ClientLimiter* limiter, std::string client, Kind kind)
        : limiter_(limiter), client_(std::move(client)), kind_(kind) {}
    void Release();
    ClientLimiter* limiter_ = nullptr;
    std::string client_;
    Kind kind_ = Kind::kCreate;
  };

  // Admits one call of `kind` by `client`: a Slot, or ResourceExhausted (naming the cap and
  // its flag) when the client already has its cap of such calls in flight.
  Result<Slot> Admit(const std::string& client, Kind kind);

  // Counts one refusal of `client` and returns how long to hold it before answering: zero
  // within its budget, at most refusal_hold_ms, and zero when max_held_refusals of its
  // refusals are already held (the caller holds nothing then).
  std::chrono::microseconds RefusalDelay(const std::string& client);

  // RefusalDelay, then holds the calling thread that long (counted in max_held_refusals).
  void PaceRefusal(const std::string& client);

  // Clients with state (in-flight calls, held refusals or a budget still refilling).
  size_t tracked_clients() const;

  const ClientLimits& limits() const { return limits_; }

 private:
  struct State {
    uint32_t creates = 0;
    uint32_t execs = 0;
    uint32_t transfers = 0;
    uint32_t held = 0;
    double tokens = 0;
    Clock::time_point refilled;
  };
  // Refills `st`'s budget up to `now`. Called with mu_ held.
  void Refill(State* st, Clock::time_point now) const;
  // Forgets `client` when nothing of it is left to remember. Called with mu_ held.
  void MaybeForget(std::map<std::string, State>::iterator it, Clock::time_point now);
  State& Find(const std::string& client, Clock::time_point now);
  // Counts one refusal in `st` and returns its hold. Called with mu_ held.
  std::chrono::microseconds DelayLocked(State* st, Clock::time_point now) const;
  void Release(const std::string& client, Kind kind);
  // The count and the cap of `kind` in `st`.
  uint32_t& CountOf(State& st, Kind kind);
  uint32_t CapOf(Kind kind) const;

  const ClientLimits limits_;
  const std::function<Clock::time_point()> now_;
  const std::function<void(std::chrono::microseconds)> sleep_;
  mutable std::mutex mu_;
  std::map<std::string, State> clients_;
  size_t next_sweep_;  // clients_ size at which Find next forgets idle clients
};

// The id a call's client is known by: "id:<x-pbox-client>" (at most 128 bytes of it) when
// the metadata is there, else "peer:<peer>".
std::string ClientKey(std::string_view client_id_metadata, std::string_view peer);

}  // namespace bragg::pbox
