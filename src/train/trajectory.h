#pragma once

// A finished rollout as the trainer consumes it: token in, token out, exactly the ids the engine
// saw and produced (never re-tokenised text), with what the behaviour policy said about them.
// Torch-free: the rl controller, the CLI and the Python bindings build these.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace bragg::train {

struct Trajectory {
  std::string id;     // for messages and metrics; unique within a batch
  std::string group;  // GRPO group (the rollouts of one prompt); "" is a group of its own
  std::vector<int32_t> tokens;
  // 1 on tokens the policy sampled (they carry loss), 0 on prompt and tool output. Same length
  // as tokens; loss_mask[0] is 0 (the first token has no prefix to be predicted from).
  std::vector<uint8_t> loss_mask;
  // The behaviour policy's log-prob of each token (the engine's output_token_logprobs), same
  // length as tokens; read where loss_mask is 1 (other entries are ignored).
  std::vector<float> logprobs;
  // The weight version each token was sampled under (-1 where not sampled); same length as
  // tokens, or empty when unknown.
  std::vector<int64_t> versions;
  // Reward of the whole trajectory (GRPO normalises it within the group), or an advantage given
  // as is (then reward is ignored for the loss but still logged).
  double reward = 0;
  std::optional<double> advantage;
  // Routed experts of a MoE model, for router replay: int32 [tokens - 1, moe layers, top_k],
  // the experts each position but the last was routed to when it was generated (the engine's
  // routed_experts); empty: the trainer routes by itself.
  std::vector<int32_t> routed_experts;
};

// Checks one trajectory against the model's vocabulary and routing shape (moe_layers, top_k,
// num_experts: 0 for a dense model): equal lengths, ids in range, loss on at least one token,
// finite log-probs where loss_mask is 1, a finite reward. InvalidArgument naming the trajectory
// and the field.
Status Validate(const Trajectory& t, int64_t vocab_size, int moe_layers, int top_k,
                int num_experts);

// Parses one JSON object (the JSONL line format of docs/train.md: "id", "group", "tokens",
// "loss_mask", "logprobs", "versions", "reward", "advantage", "routed_experts" flat).
// InvalidArgument naming `where` and the field.
Result<Trajectory> ParseTrajectory(std::string_view json, std::string_view where);
std::string TrajectoryToJson(const Trajectory& t);

// Reads a JSONL file of trajectories (blank lines skipped). InvalidArgument naming file:line.
Result<std::vector<Trajectory>> ReadTrajectories(const std::string& path);

// GRPO's group-relative advantages: per group, (reward - group mean) / (group std + 1e-6), or
// without std normalisation reward - group mean (Dr. GRPO); a trajectory with an explicit
// advantage keeps it. One value per trajectory, in order.
std::vector<double> GroupAdvantages(std::span<const Trajectory> batch, bool normalize_std);

}  // namespace bragg::train
