#pragma once

// A task's long-lived tool server inside a rollout's sandbox (docs/rl.md "Tool protocol"):
// started once through pbox exec with stdin kept open, then fed one JSON line per model turn
// ({"text": ...}) and read one JSON line back ({"observation", "tool", "error"} or
// {"done": true}). A fresh interpreter per call would cost ~100 ms; a line on a pipe costs
// microseconds. With task.verifier_in_tool_server the same server scores the finished rollout
// ({"verify": ROLLOUT} -> {"reward": X}), sparing each rollout a verifier process.
//
// A server that hangs past the call's timeout, dies (a crash, the sandbox's OOM killer) or
// answers something that is not a JSON object is reported in ToolReply::failure: the caller
// shows the model an error observation and calls Restart(). Thread-safe.

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <variant>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"
#include "pbox/client/client.h"

namespace bragg::rl {

struct ToolReply {
  std::string observation;
  std::string tool;     // the tool server's name for the call ("" when it gave none)
  bool done = false;    // the rollout is over (the model answered)
  bool error = false;   // the observation is an error (the server's, or a failure below)
  std::string failure;  // "" | "timeout" | "exited: ..." | "oom" | "bad reply: ..."
  double ms = 0;        // wall-clock of the call
  size_t bytes = 0;     // size of the reply line
};

// What scoring a finished rollout gave (the verifier's stdout, or the tool server's reward).
struct VerifierOutput {
  std::string failure;  // "" when it ran; else its exit, signal or timeout and stderr
  std::string output;   // what it printed: the reward, unless it printed no number
};

// What an agent loop needs of a task's tools: one call per model turn, and a fresh start after a
// failure. ToolServer, a server in the rollout's pbox sandbox, is the real one; the controller
// benchmark uses an in-process stub.
class ToolChannel {
 public:
  virtual ~ToolChannel() = default;
  // A failure (timeout, exit, bad reply) is a reply with `failure` set and an error
  // observation, not a Status: the rollout goes on.
  virtual ToolReply Call(std::string_view text, std::chrono::milliseconds timeout) = 0;
  virtual Status Restart() = 0;
  // task.verifier_in_tool_server: the finished rollout's reward from the tool server. Channels
  // that cannot score say so in `failure`.
  virtual VerifierOutput Verify(std::string_view rollout_json, std::chrono::milliseconds timeout) {
    (void)rollout_json;
    (void)timeout;
    return {.failure = "this tool channel does not verify", .output = ""};
  }
};

class ToolServer : public ToolChannel {
 public:
  // Starts `argv` in `sandbox_id`. The client must outlive the server.
  static Result<std::unique_ptr<ToolServer>> Start(pbox::client::Client* client,
                                                   std::string sandbox_id,
                                                   std::vector<std::string> argv);
  // Closes the server's stdin, waits a moment for it to exit, then kills it.
  ~ToolServer() override;
  ToolServer(const ToolServer&) = delete;
  ToolServer& operator=(const ToolServer&) = delete;

  // Sends one turn and waits for the reply line. A failure (timeout, exit, bad reply) is a
  // reply with `failure` set and an error observation, not a Status: the rollout goes on.
  ToolReply Call(std::string_view text, std::chrono::milliseconds timeout) override;
  // Sends {"verify": ROLLOUT} and reads {"reward": X}; a server that has exited (a crash on
  // the last turn) is started again first. A reply without a numeric "reward" is returned as
  // `output` (the rollout is then dropped as verifier_no_number); {"error": "..."}, a hang, a
  // crash or a reply that is not a JSON object is a `failure` (verifier_failed). `rollout_json`
  // must be a JSON object.
  VerifierOutput Verify(std::string_view rollout_json, std::chrono::milliseconds timeout) override;
  // Kills whatever runs in the sandbox and starts the server again.
  Status Restart() override;
  bool alive() const;
  // How the last server process ended ("" while it runs).
  std::string exit_description() const;

 private:
  ToolServer(pbox::client::Client* client, std::string sandbox_id, std::vector<std::string> argv)
      : client_(client), sandbox_id_(std::move(sandbox_id)), argv_(std::move(argv)) {}
  Status Launch();
  // Writes `line` and waits for one reply line: the line, or a failure reply (error set).
  // call_mu_ held.
  std::variant<std::string, ToolReply> Exchange(const std::string& line,
                                                std::chrono::milliseconds timeout);
  // Ends the running server: closes stdin, waits up to `grace`, kills every process in the
  // sandbox if it is still there, joins the exec thread.
  void Stop(std::chrono::milliseconds grace);

  pbox::client::Client* const client_;
  const std::string sandbox_id_;
  const std::vector<std::string> argv_;

  std::mutex call_mu_;  // one call at a time
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::string out_;  // stdout not yet consumed
  std::string err_;  // the last bytes of stderr, for messages
  bool exited_ = true;
  std::string exit_;  // DescribeExit of the last run
  bool oom_ = false;
  UniqueFd stdin_;  // our end of the server's stdin
  std::thread exec_;
};

}  // namespace bragg::rl
