#pragma once

// pbox-fusion's HTTP front: SandboxFusion's POST /run_code and GET /v1/ping on cpp-httplib,
// with at most `max_concurrency` calls running and the rest queued (waiting for a slot; a
// queued call whose client hangs up is dropped before it gets a sandbox).

#include <httplib.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/status.h"
#include "fusion/api.h"
#include "fusion/call_watch.h"
#include "fusion/runner.h"

namespace bragg::fusion {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;                         // 0: any free port
  size_t max_concurrency = 32;          // /run_code calls running at once
  size_t max_connections = 1024;        // connections served at once (one thread each)
  size_t max_request_bytes = 64 << 20;  // larger bodies get 413
  RequestLimits limits;
};

// Counters, for the log line at exit and for tests.
struct ServerStats {
  uint64_t calls = 0;      // /run_code calls answered 200
  uint64_t refused = 0;    // answered 422
  uint64_t abandoned = 0;  // clients that hung up before their answer
};

// `runner` must be started and outlive the Server. Start/Stop from one thread; the handlers run
// on httplib's threads.
class Server {
 public:
  Server(Runner* runner, ServerOptions options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds and serves in the background. Unavailable when the port is in use.
  Status Start();
  // Stops accepting, ends the calls in flight (their sandboxes are destroyed) and joins.
  void Stop();

  int port() const { return port_; }
  std::string url() const;
  ServerStats stats() const;

 private:
  void RunCode(const httplib::Request& req, httplib::Response& res);
  // Waits for a free slot; false if `call` is cancelled (or the server stops) meanwhile.
  bool AcquireSlot(const WatchedCall& call);
  void ReleaseSlot();

  Runner* runner_;
  ServerOptions options_;
  CallWatch watch_;
  httplib::Server http_;
  std::thread thread_;
  int port_ = 0;

  mutable std::mutex mu_;
  std::condition_variable slot_free_;
  size_t running_ = 0;  // guarded by mu_
  bool stopping_ = false;
  ServerStats stats_;
};

}  // namespace bragg::fusion
