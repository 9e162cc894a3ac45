#pragma once

// Runs one /run_code request in a fresh pbox sandbox: create it (in pbox-fusion's session, so
// that the agent destroys it should pbox-fusion die), write the code and the request's files,
// compile, run, read back the files asked for, destroy it. Sandboxes are never reused.

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "common/status.h"
#include "fusion/api.h"
#include "fusion/call_watch.h"
#include "pbox/client/client.h"

namespace bragg::fusion {

struct RunnerOptions {
  std::string image = "host";         // pbox image; it must have /usr/bin/python3, bash, g++
  std::string runtime;                // pbox runtime; empty: the agent's default
  uint64_t default_memory_mb = 1024;  // when a request's memory_limit_MB is <= 0
  uint64_t disk_mb = 256;             // each sandbox's writable layer
  uint32_t pids = 256;                // processes and threads per sandbox (fork bombs stop here)
  uint32_t cpus = 1;
  uint64_t max_output_bytes = 1 << 20;  // per stream and command; pbox keeps head and tail
  uint64_t max_fetch_bytes = 64 << 20;  // all fetched files of one call together
  std::string workdir = "/workspace";
};

// Thread-safe: many calls may run at once. `client` must outlive the Runner.
class Runner {
 public:
  Runner(pbox::client::Client* client, RunnerOptions options);
  ~Runner();

  // Opens the pbox session every sandbox is created in. Unavailable (with the agent's reason)
  // when pboxd cannot be reached.
  Status Start();

  // Runs `request`. Never throws; failures of pbox become a SandboxError response. `call` (may
  // be null) is told the sandbox so that a client that hangs up gets it destroyed at once; a
  // call cancelled meanwhile stops at the next step. The sandbox is destroyed before returning.
  RunCodeResponse Run(const RunCodeRequest& request, WatchedCall* call);

  // Closes the session (the agent destroys every sandbox in it, so calls still running end at
  // once with a SandboxError); later calls fail. For shutdown.
  void Shutdown();

  // Destroys a sandbox, ignoring NOT_FOUND (CallWatch's DestroyFn).
  void Destroy(const std::string& sandbox_id);

  const RunnerOptions& options() const { return options_; }

 private:
  // Creates a sandbox for `request` in the session, reopening the session once if the agent
  // no longer knows it (pboxd restarted).
  Result<std::string> CreateSandbox(const RunCodeRequest& request);
  bool stopping();
  Result<CommandResult> RunCommand(const std::string& sandbox_id,
                                   const std::vector<std::string>& argv, double timeout_s,
                                   const std::string& stdin_data);

  pbox::client::Client* client_;
  RunnerOptions options_;
  std::mutex session_mu_;
  std::unique_ptr<pbox::client::Session> session_;  // guarded by session_mu_
  bool stopping_ = false;                           // guarded by session_mu_
};

}  // namespace bragg::fusion
