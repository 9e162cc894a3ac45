#pragma once

// The agent's data channel (docs/pbox.md "Data channel"): a socket beside each gRPC listener
// ("<path>.data" beside a unix socket, one TCP port for the TCP listeners) where the bytes of
// file transfers move with splice(2) and sendfile(2), socket to file and back, without HTTP/2
// framing or userspace copies. Each transfer is admitted by a ticket of TransferTickets
// (issued by the OpenTransfer RPC after the token, the sandbox and the path were checked); the
// wire format is data_protocol.h.
//
// Every connection has its own thread, never a gRPC one, so a slow data client holds only
// its own; connections are capped (at the cap an idle one is closed to make room; a request's
// header must arrive whole within stall_timeout), and one that makes no progress for
// stall_timeout (or sits
// idle between transfers for idle_timeout) is closed.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"
#include "pbox/transfer_tickets.h"

namespace bragg::pbox {

struct AgentMetrics;

struct DataServerOptions {
  uint32_t max_connections = 1024;
  std::chrono::milliseconds idle_timeout{60000};   // between transfers on one connection
  std::chrono::milliseconds stall_timeout{30000};  // no byte moved mid-transfer
};

// Thread-safe.
class DataServer {
 public:
  // Listens on DataSocketPathFor(p) (mode 0660, replacing a stale socket) for each p in
  // `unix_paths`, and on HOST:`tcp_port` for each HOST in `tcp_hosts` (port 0: one free port,
  // the same for every host). `tickets` and `metrics` (may be null) are borrowed and must
  // outlive the server. Errors: the socket calls that failed, naming the address.
  static Result<std::unique_ptr<DataServer>> Start(TransferTickets* tickets,
                                                   const std::vector<std::string>& unix_paths,
                                                   const std::vector<std::string>& tcp_hosts,
                                                   uint16_t tcp_port, DataServerOptions options,
                                                   const AgentMetrics* metrics);
  // Stops accepting, closes every connection (transfers in flight fail and leave nothing
  // behind), waits for their threads and removes the unix sockets.
  ~DataServer();
  DataServer(const DataServer&) = delete;
  DataServer& operator=(const DataServer&) = delete;

  // "unix:///path.data" of the first unix listener; empty when there is none.
  const std::string& unix_endpoint() const { return unix_endpoint_; }
  // The TCP port; 0 when there is no TCP listener.
  uint16_t tcp_port() const { return tcp_port_; }
  // Open data connections now.
  size_t connections() const;

 private:
  DataServer(TransferTickets* tickets, DataServerOptions options, const AgentMetrics* metrics);
  void AcceptLoop();
  void Serve(UniqueFd sock);

  TransferTickets* const tickets_;
  const DataServerOptions options_;
  const AgentMetrics* const metrics_;
  std::vector<UniqueFd> listeners_;
  std::vector<std::string> unix_paths_;
  std::string unix_endpoint_;
  uint16_t tcp_port_ = 0;
  UniqueFd stop_;  // eventfd: wakes the accept loop to stop
  std::thread acceptor_;

  mutable std::mutex mu_;
  std::condition_variable idle_;
  std::set<int> open_;  // sockets of live connections, shut down by the destructor
  // Those of open_ idle between transfers: at the connection limit the oldest of them is shut
  // down to make room (clients keep pools of idle connections and dial again when one closes).
  // Shut down and closed only under mu_, so a number here is always the connection's.
  std::vector<int> waiting_;
  bool stopping_ = false;
};

}  // namespace bragg::pbox
