#pragma once

// The life of a server binary (bragg-gateway, bragg-sim-worker, bragg-engine) once its flags are
// parsed: its listen address, signals, file limit and the "listening on URL" line scripts read.

#include <signal.h>

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "common/status.h"

namespace bragg {

struct HostPort {
  std::string host;
  int port = 0;
};

// "127.0.0.1:8080" or "http://127.0.0.1:8080" (no path). InvalidArgument otherwise.
Result<HostPort> ParseHostPort(std::string_view text);

// For a server's main(): ignores SIGPIPE (a write to a hung-up client then fails with EPIPE
// instead of killing the process) and blocks SIGINT and SIGTERM in this thread and every
// thread started after it. Returns the blocked set for WaitForTermination.
sigset_t BlockTerminationSignals();
// Raises the soft RLIMIT_NOFILE to the hard limit: a proxied connection costs the gateway two
// descriptors. Returns the new soft limit; Internal if getrlimit/setrlimit fail.
Result<uint64_t> RaiseFileLimit();
// Waits until SIGINT or SIGTERM arrives.
void WaitForTermination(const sigset_t& set);

// The life of a server binary once its flags are parsed: parses `listen` (HOST:PORT), raises
// the file limit (a warning if it cannot), blocks the termination signals for every thread
// started after it, then `start` builds and starts the server on that address and returns the
// URL it serves on; "listening on URL" goes to stdout (scripts read the port from it when they
// asked for port 0) and, once SIGINT or SIGTERM arrives, `stop` runs. Returns main()'s exit
// code: 0; 2 for a bad `listen`; 1 when `start` failed. Errors are logged.
int ServeUntilTerminated(std::string_view listen,
                         const std::function<Result<std::string>(const HostPort&)>& start,
                         const std::function<void()>& stop);

}  // namespace bragg
