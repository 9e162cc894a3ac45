#include "gateway/client.h"

#include <fmt/format.h>

#include "gateway/http_util.h"

namespace bragg::gateway {

using nlohmann::json;

namespace {

absl::StatusCode HttpToCode(int status) {
  switch (status) {
    case 400:
      return absl::StatusCode::kInvalidArgument;
    case 404:
      return absl::StatusCode::kNotFound;
    case 429:
      return absl::StatusCode::kResourceExhausted;
    case 503:
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kInternal;
  }
}

}  // namespace

Result<std::unique_ptr<RolloutClient>> RolloutClient::Create(const std::string& base_url,
                                                             ClientOptions options) {
  BRAGG_ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(base_url));
  return std::unique_ptr<RolloutClient>(new RolloutClient(hp.host, hp.port, options));
}

RolloutClient::RolloutClient(std::string host, int port, ClientOptions options)
    : options_(options), http_(host, port) {
  http_.set_keep_alive(true);
  http_.set_tcp_nodelay(true);
  http_.set_read_timeout(options_.read_timeout_s, 0);
}

Result<TurnResult> RolloutClient::Generate(const std::string& rollout_id,
                                           const std::vector<int32_t>& input_ids,
                                           const json& sampling_params) {
  json body = {
      {"input_ids", input_ids}, {"sampling_params", sampling_params}, {"routing_key", rollout_id}};
  if (options_.return_logprob) {
    body["return_logprob"] = true;
  }
  RoutedExpertsAssembler* assembler = nullptr;
  size_t start_len = 0;
  if (options_.return_routed_experts) {
    assembler = &experts_[rollout_id];
    body["return_routed_experts"] = true;
    if (options_.delta_routed_experts) {
      start_len = assembler->positions();
      if (start_len > input_ids.size()) {
        return absl::InvalidArgumentError(fmt::format(
            "rollout {}: input_ids ({} tokens) is shorter than what it already covered ({})",
            rollout_id, input_ids.size(), start_len));
      }
      body["routed_experts_start_len"] = start_len;
    }
  }
  auto r = http_.Post("/generate", body.dump(), "application/json");
  if (!r) {
    return absl::UnavailableError(fmt::format("POST /generate: {}", httplib::to_string(r.error())));
  }
  if (r->status != 200) {
    return absl::Status(HttpToCode(r->status),
                        fmt::format("POST /generate: HTTP {}: {}", r->status, r->body));
  }
  json j = json::parse(r->body, nullptr, false);
  if (!j.is_object() || !j.contains("meta_info") || !j["meta_info"].is_object() ||
      !j.contains("output_ids") || !j["output_ids"].is_array()) {
    return absl::DataLossError("response has no meta_info/output_ids");
  }
  TurnResult out;
  out.output_ids = j["output_ids"].get<std::vector<int32_t>>();
  out.meta_info = std::move(j["meta_info"]);
  out.prompt_tokens = out.meta_info.value("prompt_tokens", size_t{0});
  out.cached_tokens = out.meta_info.value("cached_tokens", size_t{0});
  if (assembler != nullptr) {
    if (!out.meta_info.contains("routed_experts") || !out.meta_info["routed_experts"].is_string()) {
      return absl::DataLossError("asked for routed_experts but the response has none");
    }
    const std::string& b64 = out.meta_info["routed_experts"].get_ref<const std::string&>();
    out.routed_experts_bytes = b64.size();
    BRAGG_ASSIGN_OR_RETURN(std::vector<int32_t> suffix, DecodeRoutedExperts(b64));
    if (!options_.delta_routed_experts) {
      assembler->Reset();
    }
    size_t total = input_ids.size() + out.output_ids.size();
    Status s = assembler->Append(start_len, total, suffix);
    if (!s.ok()) {
      return absl::DataLossError(std::string(s.message()));
    }
    out.meta_info.erase("routed_experts");
  }
  return out;
}

const std::vector<int32_t>& RolloutClient::RoutedExperts(const std::string& rollout_id) const {
  static const std::vector<int32_t>* const kEmpty = new std::vector<int32_t>();
  auto it = experts_.find(rollout_id);
  return it == experts_.end() ? *kEmpty : it->second.data();
}

Status RolloutClient::Forget(const std::string& rollout_id) {
  experts_.erase(rollout_id);
  auto r =
      http_.Post("/rollouts/forget", json{{"routing_key", rollout_id}}.dump(), "application/json");
  if (!r) {
    return absl::UnavailableError(
        fmt::format("POST /rollouts/forget: {}", httplib::to_string(r.error())));
  }
  if (r->status != 200) {
    return absl::Status(HttpToCode(r->status),
                        fmt::format("POST /rollouts/forget: HTTP {}: {}", r->status, r->body));
  }
  return absl::OkStatus();
}

}  // namespace bragg::gateway
