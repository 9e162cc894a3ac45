#pragma once

// C++ client for rollouts through bragg-gateway (or one SGLang worker): keeps each rollout's
// routing key and, with delta router replay, its routed-experts array, asking each turn only for
// the new suffix (routed_experts_start_len) and reassembling the full array.

#include <httplib.h>

#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/status.h"
#include "gateway/routed_experts.h"

namespace bragg::gateway {

struct TurnResult {
  std::vector<int32_t> output_ids;
  nlohmann::json meta_info;
  size_t prompt_tokens = 0;
  size_t cached_tokens = 0;
  // Bytes of routed_experts base64 received for this turn.
  size_t routed_experts_bytes = 0;
};

struct ClientOptions {
  bool return_routed_experts = false;
  // true: ask for the suffix only and reassemble; false: ask for the whole array every turn.
  bool delta_routed_experts = true;
  // Ask for meta_info.output_token_logprobs (the behaviour policy's log-probs, for training).
  bool return_logprob = false;
  int read_timeout_s = 600;
};

// One connection to `base_url` ("http://HOST:PORT"). Not thread-safe: one per thread.
class RolloutClient {
 public:
  // InvalidArgument for a malformed URL.
  static Result<std::unique_ptr<RolloutClient>> Create(const std::string& base_url,
                                                       ClientOptions options);

  // One turn of rollout `rollout_id`: POST /generate with `input_ids` (the whole conversation so
  // far) and `sampling_params`. Errors: Unavailable for transport failures, the HTTP status
  // mapped to a canonical code otherwise, DataLoss if routed experts do not line up.
  Result<TurnResult> Generate(const std::string& rollout_id, const std::vector<int32_t>& input_ids,
                              const nlohmann::json& sampling_params);

  // The rollout's full routed-experts array so far ([tokens - 1, layers, top_k] flattened);
  // empty if none.
  const std::vector<int32_t>& RoutedExperts(const std::string& rollout_id) const;
  // Ends a finished rollout: drops its client-side state and tells the gateway
  // (POST /rollouts/forget), which stops counting it as load on its worker. The local state is
  // dropped even when the call fails (Unavailable, or the HTTP status mapped).
  Status Forget(const std::string& rollout_id);

 private:
  RolloutClient(std::string host, int port, ClientOptions options);
  ClientOptions options_;
  httplib::Client http_;
  std::map<std::string, RoutedExpertsAssembler> experts_;
};

}  // namespace bragg::gateway
