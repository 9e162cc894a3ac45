#pragma once

// One agent loop (docs/rl.md "Agent loop"): generate a turn through the gateway (routing key =
// the rollout's id, so its turns stay on their KV cache), hand the turn's text to the task's
// tool server in the rollout's sandbox, append the observation's tokens, until the tool server
// says done or a turn/token limit; then run the verifier for the reward. Token in, token out:
// the trajectory is exactly the ids the engine saw and produced.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"
#include "gateway/client.h"
#include "pbox/client/client.h"
#include "rl/config.h"
#include "rl/tool_server.h"
#include "rl/vocab.h"
#include "train/trajectory.h"

namespace bragg::rl {

struct Prompt {
  std::string text;
  std::string meta_json = "{}";  // the task's metadata, handed to the verifier as is
  std::string balance_key;       // meta[task.balance_by] as text ("" when not balancing)
};

struct ToolCallRecord {
  std::string tool;
  double ms = 0;
  bool error = false;
  std::string failure;  // ToolReply::failure
  size_t bytes = 0;
};

struct RolloutResult {
  train::Trajectory trajectory;
  std::vector<ToolCallRecord> tool_calls;
  std::vector<std::string> turns;  // the model's turns as text
  int turn_count = 0;
  bool done = false;  // the tool server said done (the model answered)
  double reward = 0;  // the verifier's
  // Why the trajectory cannot be trained on ("" when it can): "verifier_failed",
  // "verifier_no_number", "generate_failed", "bad_logprobs".
  std::string dropped;
  std::string detail;  // the message behind `dropped`
  // For the progress line: tokens sent as prompts on turns after the first, and how many of
  // them the engine found in its cache.
  int64_t later_prompt_tokens = 0, later_cached_tokens = 0;
  int64_t generated_tokens = 0;
  int generate_retries = 0;  // /generate calls asked again after a transport or worker failure
  double generate_s = 0, tools_s = 0, verify_s = 0;
  // The fleet's weight version when the rollout began (set by the controller; -1: unknown).
  // The gateway salts a rollout's cache with the version live at its first request, so its
  // prompt may reuse KV that this version's predecessors computed even when every token it
  // sampled carries a later version.
  int64_t start_version = -1;
};

// Scores one rollout (its JSON): what the verifier printed, or why it failed (VerifierOutput,
// tool_server.h). A Status error means the verifier could not be run at all (its sandbox or the
// agent is gone).
using Verifier = std::function<Result<VerifierOutput>(const std::string& input_json)>;

// The task's verifier (`task.verifier`) in `sandbox_id`, through pbox exec.
Verifier PboxVerifier(pbox::client::Client* pbox, std::string sandbox_id, const TaskConfig* task);

struct RolloutEnv {
  const Vocab* vocab;
  const TaskConfig* task;
  std::vector<int32_t> stop_ids;
  gateway::RolloutClient* gateway;  // this thread's
  ToolChannel* tools;
  Verifier verify;
  // Called around each /generate (in flight: +1, then -1): the engine-idle accounting.
  std::function<void(int)> on_generate;
};

// Runs one rollout. `temperature` 0: greedy (evaluation). Errors only for what makes the
// rollout meaningless to retry (a prompt that does not encode); everything else is a result
// with `dropped` set.
Result<RolloutResult> RunRollout(const RolloutEnv& env, const std::string& id,
                                 const std::string& group, const Prompt& prompt,
                                 const SamplingConfig& sampling, uint64_t seed);

// The engine's weight version name as a number ("12" -> 12); -1 if it is not one.
int64_t VersionNumber(const std::string& name);

}  // namespace bragg::rl
