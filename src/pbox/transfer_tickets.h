#pragma once

// Tickets of the data channel: OpenTransfer (service.cc) checks a transfer and files what it
// opened here under a random ticket; the data socket (data_server.cc) redeems the ticket once.
// A ticket is 32 random bytes (getrandom): the first 8 find the entry, all 32 are compared in
// constant time, so guessing one is as hard as guessing 192 random bits. Unknown, used and
// expired tickets are refused with the same error. Expired entries are dropped (removing an
// upload's temporary file) by Sweep and on every Issue.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "common/status.h"
#include "common/unique_fd.h"
#include "pbox/client_limiter.h"
#include "pbox/runtime/sandbox_fs.h"
#include "pbox/wire/data_protocol.h"

namespace bragg::pbox {

class Sandbox;

// What a ticket admits: one transfer of one file of one sandbox, in one direction.
struct TransferGrant {
  DataOp op = DataOp::kUpload;
  // Held weakly: an outstanding ticket does not keep a destroyed sandbox's files alive.
  std::weak_ptr<Sandbox> sandbox;
  std::string path;  // as the client named it, for messages
  // Upload: the exact byte count; download: the most bytes to send (UINT64_MAX: to the end).
  uint64_t size = 0;
  uint64_t offset = 0;  // download: first byte
  uint32_t mode = 0644;
  std::optional<PendingFile> pending;  // upload: the temporary file
  UniqueFd file;                       // download: the file, open for reading
  ClientLimiter::Slot slot;            // the client's admission, held until the transfer ends
};

struct TransferTicketOptions {
  std::chrono::milliseconds ttl{10000};  // a ticket lapses this long after it is issued
  size_t max_outstanding = 4096;         // tickets issued and not yet used or expired
};

// Thread-safe.
class TransferTickets {
 public:
  using Clock = std::chrono::steady_clock;
  // `now` is the clock (tests pass a fake one).
  explicit TransferTickets(
      TransferTicketOptions options,
      std::function<Clock::time_point()> now = [] { return Clock::now(); });
  ~TransferTickets();
  TransferTickets(const TransferTickets&) = delete;
  TransferTickets& operator=(const TransferTickets&) = delete;

  // Files `grant` under a new ticket. ResourceExhausted when max_outstanding are out;
  // Internal if the kernel gives no random bytes.
  Result<Ticket> Issue(TransferGrant grant);
  // Takes the grant of `ticket` (it cannot be redeemed again). PermissionDenied, with the
  // same message, whether the ticket is unknown, used, expired or for the other direction.
  Result<TransferGrant> Redeem(const Ticket& ticket, DataOp op);
  // Drops expired tickets; returns how many.
  size_t Sweep();
  size_t outstanding() const;
  std::chrono::milliseconds ttl() const { return options_.ttl; }

 private:
  struct Entry {
    Ticket ticket;
    Clock::time_point expires;
    TransferGrant grant;
  };
  // Moves expired entries into `out`. Called with mu_ held; `out` is destroyed unlocked.
  void TakeExpiredLocked(Clock::time_point now, std::vector<Entry>* out);

  const TransferTicketOptions options_;
  const std::function<Clock::time_point()> now_;
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, Entry> entries_;
};

}  // namespace bragg::pbox
