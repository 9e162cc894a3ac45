#include "rl/rollout.h"

#include <absl/strings/numbers.h>
#include <absl/strings/strip.h>

#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/str_cat.h"

namespace bragg::rl {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

RolloutResult Dropped(RolloutResult r, std::string why, std::string detail) {
  r.dropped = std::move(why);
  r.detail = std::move(detail);
  return r;
}

// The turn's per-token versions from meta_info.weight_versions ([start, end) over its output).
std::vector<int64_t> TurnVersions(const json& meta, size_t n) {
  std::vector<int64_t> v(n, -1);
  int64_t fallback = VersionNumber(meta.value("weight_version", std::string()));
  std::fill(v.begin(), v.end(), fallback);
  auto it = meta.find("weight_versions");
  if (it == meta.end() || !it->is_array()) {
    return v;
  }
  for (const json& span : *it) {
    if (!span.is_object() || !span.contains("version") || !span["version"].is_string()) {
      continue;
    }
    int64_t version = VersionNumber(span["version"].get<std::string>());
    int64_t start = span.value("start", int64_t{0}), end = span.value("end", int64_t{0});
    for (int64_t i = std::max<int64_t>(start, 0); i < end && i < static_cast<int64_t>(n); ++i) {
      v[static_cast<size_t>(i)] = version;
    }
  }
  return v;
}

}  // namespace

int64_t VersionNumber(const std::string& name) {
  int64_t v = -1;
  if (!absl::SimpleAtoi(name, &v) || v < 0) {
    return -1;
  }
  return v;
}

Verifier PboxVerifier(pbox::client::Client* pbox, std::string sandbox_id, const TaskConfig* task) {
  return [pbox, sandbox_id = std::move(sandbox_id),
          task](const std::string& input) -> Result<VerifierOutput> {
    BRAGG_ASSIGN_OR_RETURN(
        auto v, pbox->Run({.sandbox_id = sandbox_id,
                           .argv = task->verifier,
                           .timeout_ms = static_cast<uint64_t>(task->tool_timeout().count()),
                           .stdin = input,
                           .max_output_bytes = 4096}));
    const auto& res = v.result();
    VerifierOutput out;
    if (!res.error().empty() || res.signal() != 0 || res.exit_code() != 0 || res.timed_out()) {
      out.failure = Cat("exit ", res.exit_code(), " signal ", res.signal(),
                        res.timed_out() ? " (timed out)" : "", ": ", v.stderr().substr(0, 200));
    }
    out.output = v.stdout();
    return out;
  };
}

Result<RolloutResult> RunRollout(const RolloutEnv& env, const std::string& id,
                                 const std::string& group, const Prompt& prompt,
                                 const SamplingConfig& sampling, uint64_t seed) {
  const TaskConfig& task = *env.task;
  RolloutResult r;
  train::Trajectory& t = r.trajectory;
  t.id = id;
  t.group = group;
  auto prompt_ids = env.vocab->Encode(prompt.text);
  if (!prompt_ids.ok()) {
    return absl::InvalidArgumentError(Cat("prompt of ", id, ": ", prompt_ids.status().message()));
  }
  t.tokens = *prompt_ids;
  t.loss_mask.assign(t.tokens.size(), 0);
  t.logprobs.assign(t.tokens.size(), 0.0f);
  t.versions.assign(t.tokens.size(), -1);
  std::vector<std::string> observations;
  // The trajectory ends with the model's last turn: an observation after it was never seen by
  // the engine (no routed experts for it) and carries no loss.
  size_t trained_len = t.tokens.size();

  for (int turn = 0; turn < task.max_turns; ++turn) {
    int64_t room = task.max_tokens - static_cast<int64_t>(t.tokens.size());
    if (room <= 0) {
      break;
    }
    json sp = {
        {"temperature", sampling.temperature},
        {"top_p", sampling.top_p},
        {"max_new_tokens", std::min<int64_t>(task.max_new_tokens, room)},
        {"stop_token_ids", env.stop_ids},
        {"sampling_seed", (seed + static_cast<uint64_t>(turn) * 0x9E3779B97F4A7C15ull) >> 1}};
    auto t0 = Clock::now();
    Result<gateway::TurnResult> out = absl::UnknownError("not tried");
    // An engine that dies mid-turn: the gateway fails over; the turn is asked again (the
    // engine's cache of the rollout is gone, the tokens so far are not).
    for (int attempt = 0; attempt < 4; ++attempt) {
      r.generate_retries += attempt > 0 ? 1 : 0;
      if (env.on_generate) env.on_generate(+1);
      out = env.gateway->Generate(id, t.tokens, sp);
      if (env.on_generate) env.on_generate(-1);
      if (out.ok() || (out.status().code() != absl::StatusCode::kUnavailable &&
                       out.status().code() != absl::StatusCode::kInternal &&
                       out.status().code() != absl::StatusCode::kDataLoss)) {
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200 << attempt));
    }
    r.generate_s += Since(t0);
    if (!out.ok()) {
      return Dropped(std::move(r), "generate_failed", std::string(out.status().message()));
    }
    if (turn > 0) {
      r.later_prompt_tokens += static_cast<int64_t>(out->prompt_tokens);
      r.later_cached_tokens += static_cast<int64_t>(out->cached_tokens);
    }
    const std::vector<int32_t>& ids = out->output_ids;
    if (ids.empty()) {
      break;
    }
    auto lps = out->meta_info.find("output_token_logprobs");
    if (lps == out->meta_info.end() || !lps->is_array() || lps->size() != ids.size()) {
      return Dropped(std::move(r), "bad_logprobs", "output_token_logprobs missing or short");
    }
    std::vector<int64_t> versions = TurnVersions(out->meta_info, ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      const json& e = (*lps)[i];
      if (!e.is_array() || e.empty() || !e[0].is_number()) {
        return Dropped(std::move(r), "bad_logprobs", Cat("no finite log-prob for output ", i));
      }
      t.tokens.push_back(ids[i]);
      t.loss_mask.push_back(1);
      t.logprobs.push_back(e[0].get<float>());
      t.versions.push_back(versions[i]);
    }
    r.generated_tokens += static_cast<int64_t>(ids.size());
    trained_len = t.tokens.size();
    ++r.turn_count;
    std::string text = env.vocab->Decode(ids);
    r.turns.push_back(text);

    auto t1 = Clock::now();
    ToolReply reply = env.tools->Call(text, task.tool_timeout());
    r.tools_s += Since(t1);
    r.tool_calls.push_back({reply.tool, reply.ms, reply.error, reply.failure, reply.bytes});
    if (!reply.failure.empty()) {
      // A hung, crashed or OOM-killed server: the model sees the error; the next call gets a
      // fresh server.
      (void)env.tools->Restart();
    }
    if (reply.done) {
      r.done = true;
      break;
    }
    std::vector<int32_t> obs = env.vocab->EncodeLossy(reply.observation);
    room = task.max_tokens - static_cast<int64_t>(t.tokens.size());
    if (static_cast<int64_t>(obs.size()) > room) {
      obs.resize(static_cast<size_t>(std::max<int64_t>(room, 0)));
    }
    observations.push_back(env.vocab->Decode(obs));
    for (int32_t o : obs) {
      t.tokens.push_back(o);
      t.loss_mask.push_back(0);
      t.logprobs.push_back(0.0f);
      t.versions.push_back(-1);
    }
  }
  t.tokens.resize(trained_len);
  t.loss_mask.resize(trained_len);
  t.logprobs.resize(trained_len);
  t.versions.resize(trained_len);
  if (r.turn_count == 0) {
    return Dropped(std::move(r), "generate_failed", "the model produced no turn");
  }
  t.routed_experts = env.gateway->RoutedExperts(id);

  // The verifier: the rollout as JSON on stdin, a number on stdout.
  json in = {{"prompt", prompt.text},
             {"meta", json::parse(prompt.meta_json, nullptr, false)},
             {"turns", r.turns},
             {"observations", observations},
             {"done", r.done}};
  auto t2 = Clock::now();
  auto v = env.verify(in.dump(-1, ' ', false, json::error_handler_t::replace));
  r.verify_s = Since(t2);
  if (!v.ok()) {
    // The call itself failed: the sandbox (or its agent) is gone, not the verifier.
    return Dropped(std::move(r), "sandbox_failed", std::string(v.status().message()));
  }
  if (!v->failure.empty()) {
    return Dropped(std::move(r), "verifier_failed", v->failure);
  }
  double reward = 0;
  absl::string_view text = absl::StripAsciiWhitespace(v->output);
  if (!absl::SimpleAtod(text, &reward) || !std::isfinite(reward)) {
    return Dropped(std::move(r), "verifier_no_number",
                   Cat(task.verifier_in_tool_server ? "the tool server's verify answered "
                                                    : "the verifier printed ",
                       json(std::string(text.substr(0, 80)))
                           .dump(-1, ' ', false, json::error_handler_t::replace)));
  }
  r.reward = reward;
  t.reward = reward;
  return r;
}

}  // namespace bragg::rl
