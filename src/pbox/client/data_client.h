#pragma once

// The client side of the agent's data channel (docs/pbox.md "Data channel";
// src/pbox/wire/data_protocol.h): pooled connections to the data socket and the transfer of one
// ticket's bytes over one of them.

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"
#include "pbox/wire/data_protocol.h"

namespace bragg::pbox::client {

// Thread-safe. Keeps up to kMaxIdle idle connections per client, each reused for the next
// transfer to the same endpoint within kMaxIdleAge.
class DataPool {
 public:
  // `tcp_host`: the host "tcp://:PORT" data endpoints mean (the host of the gRPC endpoint).
  explicit DataPool(std::string tcp_host) : tcp_host_(std::move(tcp_host)) {}

  // One upload: the request, `data`, the trailer, then the agent's status. Returns the
  // status frame of a successful upload; the agent's error (or the connection's) otherwise.
  Result<DataStatus> Upload(const std::string& endpoint, const Ticket& ticket,
                            std::string_view data);
  // The same with `size` bytes of the regular file `fd` from `offset` (sendfile).
  Result<DataStatus> UploadFile(const std::string& endpoint, const Ticket& ticket, int fd,
                                off_t offset, uint64_t size);
  // One download into `out` (replaced) or, with `fd` >= 0, written to `fd`.
  Result<DataStatus> Download(const std::string& endpoint, const Ticket& ticket, std::string* out,
                              int fd = -1);

  // Connects to `endpoint` ("unix:///p" or "tcp://HOST:PORT" / "tcp://:PORT"). Unavailable if
  // nothing listens there.
  Result<UniqueFd> Dial(const std::string& endpoint) const;

  static constexpr size_t kMaxIdle = 64;
  static constexpr std::chrono::seconds kMaxIdleAge{20};

 private:
  struct Idle {
    std::string endpoint;
    UniqueFd fd;
    std::chrono::steady_clock::time_point since;
  };
  Result<UniqueFd> Acquire(const std::string& endpoint);
  void Release(const std::string& endpoint, UniqueFd fd);

  const std::string tcp_host_;
  std::mutex mu_;
  std::vector<Idle> idle_;
};

}  // namespace bragg::pbox::client
