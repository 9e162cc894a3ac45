#pragma once

// Small pieces shared by the gateway and the simulated worker on top of cpp-httplib.

#include <httplib.h>
#include <signal.h>

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/http_server.h"
#include "common/serve.h"
#include "common/status.h"

namespace bragg::gateway {

// The serving helpers of every server binary live in common/serve.h.
using ::bragg::BindServer;
using ::bragg::BlockTerminationSignals;
using ::bragg::ElasticTaskQueue;
using ::bragg::HostPort;
using ::bragg::ParseHostPort;
using ::bragg::RaiseFileLimit;
using ::bragg::ServeUntilTerminated;
using ::bragg::WaitForTermination;

// Keep-alive connections to one upstream, reused across requests. Thread-safe. Every client it
// hands out sends "Authorization: Bearer <api_key>" when `api_key` is not empty.
class ClientPool {
 public:
  explicit ClientPool(HostPort target, std::string api_key = "");
  // A connected-or-fresh client; give it back with Release when the exchange ended cleanly.
  std::unique_ptr<httplib::Client> Acquire();
  void Release(std::unique_ptr<httplib::Client> client);
  // A fresh client of its own (never pooled) for one-off calls with their own timeouts.
  std::unique_ptr<httplib::Client> NewClient() const;
  const HostPort& target() const { return target_; }

 private:
  HostPort target_;
  const std::string api_key_;
  std::mutex mu_;
  std::vector<std::unique_ptr<httplib::Client>> idle_;
};

// A JSON error body {"error": {"message": ...}} with `status`.
void SetError(httplib::Response& res, int status, std::string_view message);

}  // namespace bragg::gateway
