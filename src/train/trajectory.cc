#include "train/trajectory.h"

#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "common/str_cat.h"

namespace bragg::train {

Status Validate(const Trajectory& t, int64_t vocab_size, int moe_layers, int top_k,
                int num_experts) {
  auto bad = [&](auto&&... parts) {
    return absl::InvalidArgumentError(Cat("trajectory ", t.id, ": ", parts...));
  };
  const size_t n = t.tokens.size();
  if (n < 2) {
    return bad("has ", n, " tokens; a trajectory needs a prompt token and a sampled one");
  }
  if (t.loss_mask.size() != n) {
    return bad("loss_mask has ", t.loss_mask.size(), " entries, tokens has ", n);
  }
  if (t.logprobs.size() != n) {
    return bad("logprobs has ", t.logprobs.size(), " entries, tokens has ", n);
  }
  if (!t.versions.empty() && t.versions.size() != n) {
    return bad("versions has ", t.versions.size(), " entries, tokens has ", n);
  }
  if (t.loss_mask[0] != 0) {
    return bad("loss_mask[0] is 1, but the first token has no prefix to be predicted from");
  }
  int64_t loss_tokens = 0;
  for (size_t i = 0; i < n; ++i) {
    if (t.tokens[i] < 0 || t.tokens[i] >= vocab_size) {
      return bad("tokens[", i, "] = ", t.tokens[i], " is outside the vocabulary (", vocab_size,
                 ")");
    }
    if (t.loss_mask[i] > 1) {
      return bad("loss_mask[", i, "] = ", int{t.loss_mask[i]}, "; it must be 0 or 1");
    }
    if (t.loss_mask[i] == 1) {
      ++loss_tokens;
      if (!std::isfinite(t.logprobs[i]) || t.logprobs[i] > 0) {
        return bad("logprobs[", i, "] = ", t.logprobs[i], " is not a log-probability");
      }
    }
  }
  if (loss_tokens == 0) {
    return bad("no token carries loss (loss_mask is all 0)");
  }
  if (!std::isfinite(t.reward)) {
    return bad("reward is ", t.reward);
  }
  if (t.advantage && !std::isfinite(*t.advantage)) {
    return bad("advantage is ", *t.advantage);
  }
  if (!t.routed_experts.empty()) {
    if (num_experts == 0) {
      return bad("has routed_experts, but the model is dense");
    }
    size_t want = (n - 1) * static_cast<size_t>(moe_layers) * static_cast<size_t>(top_k);
    if (t.routed_experts.size() != want) {
      return bad("routed_experts has ", t.routed_experts.size(), " entries; [tokens - 1 = ", n - 1,
                 ", moe layers = ", moe_layers, ", top_k = ", top_k, "] needs ", want);
    }
    for (size_t i = 0; i < want; ++i) {
      if (t.routed_experts[i] < 0 || t.routed_experts[i] >= num_experts) {
        return bad("routed_experts[", i, "] = ", t.routed_experts[i], " is not an expert (",
                   num_experts, ")");
      }
    }
  }
  return absl::OkStatus();
}

namespace {

template <typename T>
Status ReadArray(const nlohmann::json& j, const char* key, std::vector<T>* out, bool required,
                 std::string_view where) {
  auto it = j.find(key);
  if (it == j.end()) {
    if (required) {
      return absl::InvalidArgumentError(Cat(where, ": \"", key, "\" is missing"));
    }
    return absl::OkStatus();
  }
  if (!it->is_array()) {
    return absl::InvalidArgumentError(Cat(where, ": \"", key, "\" is not an array"));
  }
  out->reserve(it->size());
  for (const auto& v : *it) {
    if (!v.is_number()) {
      return absl::InvalidArgumentError(Cat(where, ": \"", key, "\" holds a non-number"));
    }
    out->push_back(v.get<T>());
  }
  return absl::OkStatus();
}

}  // namespace

Result<Trajectory> ParseTrajectory(std::string_view text, std::string_view where) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(Cat(where, ": not a JSON object"));
  }
  static const char* kKnown[] = {"id",       "group",  "tokens",    "loss_mask",     "logprobs",
                                 "versions", "reward", "advantage", "routed_experts"};
  for (const auto& [key, value] : j.items()) {
    if (std::find_if(std::begin(kKnown), std::end(kKnown),
                     [&](const char* k) { return key == k; }) == std::end(kKnown)) {
      return absl::InvalidArgumentError(Cat(where, ": unknown field \"", key, "\""));
    }
  }
  Trajectory t;
  auto id = j.find("id");
  if (id != j.end()) {
    t.id = id->is_string() ? id->get<std::string>() : id->dump();
  } else {
    t.id = std::string(where);
  }
  auto group = j.find("group");
  if (group != j.end()) {
    t.group = group->is_string() ? group->get<std::string>() : group->dump();
  }
  std::string at = Cat(where, " (trajectory ", t.id, ")");
  BRAGG_RETURN_IF_ERROR(ReadArray(j, "tokens", &t.tokens, true, at));
  std::vector<int> mask;
  BRAGG_RETURN_IF_ERROR(ReadArray(j, "loss_mask", &mask, true, at));
  for (int m : mask) {
    if (m != 0 && m != 1) {
      return absl::InvalidArgumentError(Cat(at, ": loss_mask holds ", m));
    }
    t.loss_mask.push_back(static_cast<uint8_t>(m));
  }
  BRAGG_RETURN_IF_ERROR(ReadArray(j, "logprobs", &t.logprobs, true, at));
  BRAGG_RETURN_IF_ERROR(ReadArray(j, "versions", &t.versions, false, at));
  BRAGG_RETURN_IF_ERROR(ReadArray(j, "routed_experts", &t.routed_experts, false, at));
  auto reward = j.find("reward");
  if (reward != j.end()) {
    if (!reward->is_number()) {
      return absl::InvalidArgumentError(Cat(at, ": \"reward\" is not a number"));
    }
    t.reward = reward->get<double>();
  }
  auto adv = j.find("advantage");
  if (adv != j.end() && !adv->is_null()) {
    if (!adv->is_number()) {
      return absl::InvalidArgumentError(Cat(at, ": \"advantage\" is not a number"));
    }
    t.advantage = adv->get<double>();
  }
  if (reward == j.end() && !t.advantage) {
    return absl::InvalidArgumentError(Cat(at, ": neither \"reward\" nor \"advantage\" is given"));
  }
  return t;
}

std::string TrajectoryToJson(const Trajectory& t) {
  nlohmann::json j;
  j["id"] = t.id;
  j["group"] = t.group;
  j["tokens"] = t.tokens;
  std::vector<int> mask(t.loss_mask.begin(), t.loss_mask.end());
  j["loss_mask"] = mask;
  j["logprobs"] = t.logprobs;
  if (!t.versions.empty()) {
    j["versions"] = t.versions;
  }
  j["reward"] = t.reward;
  if (t.advantage) {
    j["advantage"] = *t.advantage;
  }
  if (!t.routed_experts.empty()) {
    j["routed_experts"] = t.routed_experts;
  }
  return j.dump();
}

Result<std::vector<Trajectory>> ReadTrajectories(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(Cat("cannot open ", path, ": ", std::strerror(errno)));
  }
  std::vector<Trajectory> out;
  std::string line;
  int64_t lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) {
      continue;
    }
    BRAGG_ASSIGN_OR_RETURN(Trajectory t, ParseTrajectory(line, Cat(path, ":", lineno)));
    out.push_back(std::move(t));
  }
  if (in.bad()) {
    return absl::DataLossError(Cat("reading ", path, " failed"));
  }
  return out;
}

std::vector<double> GroupAdvantages(std::span<const Trajectory> batch, bool normalize_std) {
  std::map<std::string, std::vector<size_t>> groups;
  for (size_t i = 0; i < batch.size(); ++i) {
    groups[batch[i].group.empty() ? Cat("\x01", i) : batch[i].group].push_back(i);
  }
  std::vector<double> adv(batch.size(), 0.0);
  for (const auto& [name, members] : groups) {
    double mean = 0;
    for (size_t i : members) {
      mean += batch[i].reward;
    }
    mean /= static_cast<double>(members.size());
    double var = 0;
    for (size_t i : members) {
      var += (batch[i].reward - mean) * (batch[i].reward - mean);
    }
    // The unbiased std, as torch.std (GRPO implementations use it).
    double std = members.size() > 1 ? std::sqrt(var / static_cast<double>(members.size() - 1)) : 0;
    for (size_t i : members) {
      double a = batch[i].reward - mean;
      adv[i] = normalize_std ? a / (std + 1e-6) : a;
    }
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    if (batch[i].advantage) {
      adv[i] = *batch[i].advantage;
    }
  }
  return adv;
}

}  // namespace bragg::train
