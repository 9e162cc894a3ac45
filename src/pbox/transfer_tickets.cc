#include "pbox/transfer_tickets.h"

#include <sys/random.h>

#include <cstring>
#include <vector>

#include "fmt/format.h"

namespace bragg::pbox {
namespace {

uint64_t KeyOf(const Ticket& t) {
  uint64_t key;
  std::memcpy(&key, t.data(), sizeof(key));
  return key;
}

bool SameTicket(const Ticket& a, const Ticket& b) {
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

Status Refused() {
  return absl::PermissionDeniedError(
      "invalid, already used or expired transfer ticket: ask OpenTransfer for a new one");
}

}  // namespace

TransferTickets::TransferTickets(TransferTicketOptions options,
                                 std::function<Clock::time_point()> now)
    : options_(options), now_(std::move(now)) {}

TransferTickets::~TransferTickets() = default;

void TransferTickets::TakeExpiredLocked(Clock::time_point now, std::vector<Entry>* out) {
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->second.expires <= now) {
      out->push_back(std::move(it->second));
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
}

Result<Ticket> TransferTickets::Issue(TransferGrant grant) {
  Ticket ticket;
  size_t got = 0;
  while (got < ticket.size()) {
    ssize_t n = ::getrandom(ticket.data() + got, ticket.size() - got, 0);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      return ErrnoError("getrandom", "transfer ticket");
    }
    got += static_cast<size_t>(n);
  }
  std::vector<Entry> expired;  // destroyed after the lock is released (unlinks temp files)
  std::lock_guard<std::mutex> lock(mu_);
  Clock::time_point now = now_();
  if (entries_.size() >= options_.max_outstanding / 2) {
    TakeExpiredLocked(now, &expired);
  }
  if (entries_.size() >= options_.max_outstanding) {
    return absl::ResourceExhaustedError(
        fmt::format("the agent has {} transfer tickets outstanding, its limit: retry when some "
                    "are used or expired",
                    entries_.size()));
  }
  auto [it, inserted] = entries_.try_emplace(KeyOf(ticket));
  if (!inserted) {
    // 2^-64 per live ticket: refuse rather than overwrite.
    return absl::UnavailableError("transfer ticket collision: retry");
  }
  it->second.ticket = ticket;
  it->second.expires = now + options_.ttl;
  it->second.grant = std::move(grant);
  return ticket;
}

Result<TransferGrant> TransferTickets::Redeem(const Ticket& ticket, DataOp op) {
  std::optional<Entry> taken;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(KeyOf(ticket));
    if (it == entries_.end() || !SameTicket(it->second.ticket, ticket)) {
      return Refused();
    }
    // Used once, whatever happens next: a wrong direction or an expired ticket burns it too.
    taken.emplace(std::move(it->second));
    entries_.erase(it);
  }
  if (taken->expires <= now_() || taken->grant.op != op) {
    return Refused();
  }
  return std::move(taken->grant);
}

size_t TransferTickets::Sweep() {
  std::vector<Entry> expired;
  {
    std::lock_guard<std::mutex> lock(mu_);
    TakeExpiredLocked(now_(), &expired);
  }
  return expired.size();
}

size_t TransferTickets::outstanding() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

}  // namespace bragg::pbox
