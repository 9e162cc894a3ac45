#include "gateway/sim/sim_worker.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <chrono>

#include "common/hash.h"
#include "common/logging.h"
#include "gateway/http_util.h"
#include "gateway/router.h"

namespace bragg::gateway {

using nlohmann::json;

namespace {

void SleepUs(double us) {
  if (us >= 1.0) {
    std::this_thread::sleep_for(std::chrono::microseconds(static_cast<int64_t>(us)));
  }
}

// Reads a JSON body; sets a 400 and returns false if it is not an object.
bool ParseBody(const httplib::Request& req, httplib::Response& res, json* out) {
  *out = json::parse(req.body, nullptr, /*allow_exceptions=*/false);
  if (out->is_discarded() || !out->is_object()) {
    SetError(res, 400, "request body must be a JSON object");
    return false;
  }
  return true;
}

void Reply(httplib::Response& res, const json& body, int status = 200) {
  res.status = status;
  res.set_content(body.dump(), "application/json");
}

}  // namespace

struct SimWorker::GenerateJob {
  std::vector<int32_t> input_ids;
  size_t max_new_tokens = 16;
  bool return_routed_experts = false;
  bool return_logprob = false;
  int64_t routed_experts_start_len = 0;
  std::string extra_key;
  std::string rid;
  bool stream = false;
  bool aborted = false;
};

SimWorker::SimWorker(SimWorkerOptions options)
    : options_(std::move(options)),
      cache_(options_.cache_tokens),
      version_(options_.weight_version),
      model_path_(options_.model_path),
      rng_(options_.seed) {
  version_names_[VersionId(version_)] = version_;
  server_.new_task_queue = [n = options_.max_threads] { return new ElasticTaskQueue(n); };
  server_.set_tcp_nodelay(true);
  server_.set_keep_alive_max_count(1 << 30);
  server_.set_keep_alive_timeout(60);
  Register();
}

SimWorker::~SimWorker() { Stop(); }

std::string SimWorker::url() const { return fmt::format("http://{}:{}", options_.host, port_); }

Status SimWorker::Start() {
  BRAGG_ASSIGN_OR_RETURN(port_, BindServer(server_, options_.host, options_.port));
  BRAGG_ASSIGN_OR_RETURN(thread_, ServeInBackground(server_));
  return absl::OkStatus();
}

Status SimWorker::Run() {
  BRAGG_ASSIGN_OR_RETURN(port_, BindServer(server_, options_.host, options_.port));
  spdlog::info("bragg-sim-worker listening on {}", url());
  if (!server_.listen_after_bind()) {
    return absl::InternalError("sim worker server stopped with an error");
  }
  return absl::OkStatus();
}

void SimWorker::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    paused_ = false;
  }
  resumed_.notify_all();
  server_.stop();
  if (thread_.joinable()) {
    thread_.join();
  }
}

std::string SimWorker::VersionName(uint32_t id) {
  auto it = version_names_.find(id);
  return it == version_names_.end() ? std::to_string(id) : it->second;
}

json SimWorker::Generate(GenerateJob& job, const std::function<bool(const json&)>& emit) {
  std::vector<int32_t> salted;
  size_t salt_n = job.extra_key.empty() ? 0 : 1;
  salted.reserve(job.input_ids.size() + job.max_new_tokens + 1);
  if (salt_n == 1) {
    salted.push_back(SaltToken(job.extra_key));
  }
  salted.insert(salted.end(), job.input_ids.begin(), job.input_ids.end());
  std::vector<uint32_t> versions(job.input_ids.size());
  size_t cached = 0;
  {
    std::unique_lock<std::mutex> lock(mu_);
    resumed_.wait(lock, [this] { return !paused_; });
    std::vector<TokenTag> tags;
    size_t m = cache_.Match(salted, &tags);
    cached = m > salt_n ? m - salt_n : 0;
    // As SGLang, at least one prompt token is always computed.
    cached = std::min(cached, job.input_ids.size() - 1);
    uint32_t now = VersionId(version_);
    for (size_t i = 0; i < versions.size(); ++i) {
      versions[i] = i < cached ? tags[salt_n + i] : now;
    }
  }
  SleepUs(options_.prefill_us_per_token * static_cast<double>(job.input_ids.size() - cached));

  uint64_t prompt_hash = options_.seed;
  for (int32_t t : job.input_ids) {
    prompt_hash = SplitMix64(prompt_hash ^ static_cast<uint32_t>(t));
  }
  std::vector<int32_t> out;
  std::vector<uint32_t> out_versions;
  std::string finish = "length";
  for (size_t i = 0; i < job.max_new_tokens; ++i) {
    uint32_t v;
    {
      std::unique_lock<std::mutex> lock(mu_);
      resumed_.wait(lock, [this] { return !paused_; });
      if (aborted_.erase(job.rid) > 0) {
        job.aborted = true;
      }
      v = VersionId(version_);
    }
    if (job.aborted) {
      finish = "abort";
      break;
    }
    out.push_back(
        static_cast<int32_t>(SplitMix64(prompt_hash + i) % static_cast<uint64_t>(options_.vocab)));
    out_versions.push_back(v);
    SleepUs(options_.decode_us_per_token);
    if (emit) {
      json chunk = {{"output_ids", out},
                    {"meta_info",
                     {{"id", job.rid},
                      {"prompt_tokens", job.input_ids.size()},
                      {"completion_tokens", out.size()},
                      {"cached_tokens", cached}}}};
      if (!emit(chunk)) {
        job.aborted = true;
        finish = "abort";
        std::lock_guard<std::mutex> lock(mu_);
        aborts_++;
        break;
      }
    }
  }

  std::vector<uint32_t> all_versions = versions;
  all_versions.insert(all_versions.end(), out_versions.begin(), out_versions.end());
  salted.insert(salted.end(), out.begin(), out.end());
  json spans = json::array();
  std::string version_now;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<TokenTag> tags;
    tags.reserve(salted.size());
    if (salt_n == 1) {
      tags.push_back(0);
    }
    tags.insert(tags.end(), all_versions.begin(), all_versions.end());
    cache_.Insert(salted, tags);
    for (size_t i = 0; i < out_versions.size();) {
      size_t j = i;
      while (j < out_versions.size() && out_versions[j] == out_versions[i]) {
        ++j;
      }
      spans.push_back({{"version", VersionName(out_versions[i])}, {"start", i}, {"end", j}});
      i = j;
    }
    version_now = version_;
  }

  std::string text;
  for (int32_t t : out) {
    text += fmt::format(" t{}", t);
  }
  json meta = {{"id", job.rid},
               {"prompt_tokens", job.input_ids.size()},
               {"completion_tokens", out.size()},
               {"cached_tokens", cached},
               {"weight_version", version_now},
               {"weight_versions", spans},
               {"finish_reason", {{"type", finish}, {"length", out.size()}}}};
  if (job.return_logprob) {
    // SGLang's shape: [logprob, token id, token text (null unless asked)] per output token; a
    // made-up log-prob in [-5, -0.005], fixed by the prompt and the position.
    json lps = json::array();
    for (size_t i = 0; i < out.size(); ++i) {
      double lp = -static_cast<double>(1 + SplitMix64(prompt_hash ^ (i + 1)) % 1000) / 200.0;
      lps.push_back({lp, out[i], nullptr});
    }
    meta["output_token_logprobs"] = std::move(lps);
  }
  if (job.return_routed_experts) {
    std::vector<int32_t> all(job.input_ids);
    all.insert(all.end(), out.begin(), out.end());
    size_t end = all.size() - 1;
    size_t begin = static_cast<size_t>(job.routed_experts_start_len);
    std::vector<int32_t> experts;
    if (begin <= end) {
      AppendSimRoutedExperts(all, all_versions, begin, end, options_.moe, &experts);
    }
    meta["routed_experts"] = EncodeRoutedExperts(experts);
  }
  return {{"text", text}, {"output_ids", out}, {"meta_info", meta}};
}

void SimWorker::HandleGenerate(const httplib::Request& req, httplib::Response& res) {
  if (options_.noop) {
    res.set_content(
        R"({"text":"","output_ids":[1],"meta_info":{"prompt_tokens":1,"cached_tokens":0,"completion_tokens":1}})",
        "application/json");
    return;
  }
  json body;
  if (!ParseBody(req, res, &body)) {
    return;
  }
  bool batch = (body.contains("input_ids") && body["input_ids"].is_array() &&
                !body["input_ids"].empty() && body["input_ids"][0].is_array()) ||
               (!body.contains("input_ids") && body.contains("text") && body["text"].is_array());
  if (batch) {
    // A batch, as SGLang takes it: one generation per element, answered as an array.
    if (body.value("stream", false)) {
      SetError(res, 400, "the simulator does not stream batches");
      return;
    }
    const char* field = body.contains("input_ids") ? "input_ids" : "text";
    json out = json::array();
    for (size_t i = 0; i < body[field].size(); ++i) {
      json one = body;
      one[field] = body[field][i];
      if (body.contains("rid") && body["rid"].is_array()) {
        one["rid"] = i < body["rid"].size() ? body["rid"][i] : json();
      }
      httplib::Request sub;
      sub.body = one.dump();
      httplib::Response sub_res;
      HandleGenerate(sub, sub_res);
      if (sub_res.status != 200 && sub_res.status != -1) {
        res = std::move(sub_res);
        return;
      }
      out.push_back(json::parse(sub_res.body));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      last_request_ = body;
      last_request_.erase("input_ids");
    }
    Reply(res, out);
    return;
  }
  auto job = std::make_shared<GenerateJob>();
  const json& ids = body.contains("input_ids") ? body["input_ids"] : json();
  if (ids.is_array()) {
    for (const json& t : ids) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX) {
        SetError(res, 400, "input_ids must be an array of non-negative 32-bit token ids");
        return;
      }
      job->input_ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
    }
  } else if (body.contains("text") && body["text"].is_string()) {
    for (unsigned char c : body["text"].get<std::string>()) {
      job->input_ids.push_back(c);
    }
  } else {
    SetError(res, 400, "request needs input_ids (an array of token ids) or text");
    return;
  }
  if (job->input_ids.empty()) {
    SetError(res, 400, "input_ids is empty");
    return;
  }
  if (body.contains("sampling_params")) {
    const json& sp = body["sampling_params"];
    if (!sp.is_object()) {
      SetError(res, 400, "sampling_params must be an object");
      return;
    }
    if (sp.contains("max_new_tokens")) {
      if (!sp["max_new_tokens"].is_number_integer() || sp["max_new_tokens"].get<int64_t>() < 0 ||
          sp["max_new_tokens"].get<int64_t>() > (1 << 20)) {
        SetError(res, 400, "sampling_params.max_new_tokens must be an integer in [0, 2^20]");
        return;
      }
      job->max_new_tokens = sp["max_new_tokens"].get<size_t>();
    }
  }
  job->return_routed_experts = body.value("return_routed_experts", false);
  job->return_logprob = body.value("return_logprob", false);
  if (body.contains("routed_experts_start_len")) {
    if (!body["routed_experts_start_len"].is_number_integer() ||
        body["routed_experts_start_len"].get<int64_t>() < 0) {
      SetError(res, 400, "routed_experts_start_len must be a non-negative integer");
      return;
    }
    job->routed_experts_start_len = body["routed_experts_start_len"].get<int64_t>();
    if (static_cast<size_t>(job->routed_experts_start_len) >
        job->input_ids.size() + job->max_new_tokens) {
      SetError(res, 400, "routed_experts_start_len is past the end of the sequence");
      return;
    }
  }
  if (body.contains("extra_key") && body["extra_key"].is_string()) {
    job->extra_key = body["extra_key"].get<std::string>();
  }
  job->rid = body.contains("rid") && body["rid"].is_string()
                 ? body["rid"].get<std::string>()
                 : fmt::format("sim-{}-{}", port_, rid_counter_.fetch_add(1));
  job->stream = body.value("stream", false);
  {
    std::lock_guard<std::mutex> lock(mu_);
    requests_++;
    last_request_ = body;
    last_request_.erase("input_ids");
    if (error_rate_ > 0 && std::uniform_real_distribution<double>(0, 1)(rng_) < error_rate_) {
      SetError(res, 500, "injected failure");
      return;
    }
  }
  if (!job->stream) {
    Reply(res, Generate(*job, nullptr));
    return;
  }
  res.set_chunked_content_provider(
      "text/event-stream", [this, job](size_t, httplib::DataSink& sink) {
        auto emit = [&sink](const json& chunk) {
          std::string s = "data: " + chunk.dump() + "\n\n";
          return sink.write(s.data(), s.size());
        };
        json result = Generate(*job, emit);
        if (!job->aborted) {
          std::string s = "data: " + result.dump() + "\n\ndata: [DONE]\n\n";
          sink.write(s.data(), s.size());
        }
        sink.done();
        return true;
      });
}

void SimWorker::Register() {
  server_.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (options_.api_key.empty() || req.path.rfind("/health", 0) == 0 ||
        req.path.rfind("/sim/", 0) == 0) {
      return httplib::Server::HandlerResponse::Unhandled;
    }
    std::string auth = req.get_header_value("Authorization");
    std::lock_guard<std::mutex> lock(mu_);
    if (auth != "Bearer " + options_.api_key) {
      unauthorized_++;
      SetError(res, 401, "missing or wrong API key");
      return httplib::Server::HandlerResponse::Handled;
    }
    last_authorization_ = auth;
    return httplib::Server::HandlerResponse::Unhandled;
  });
  server_.Post("/generate", [this](const httplib::Request& req, httplib::Response& res) {
    HandleGenerate(req, res);
  });
  auto health = [this](const httplib::Request&, httplib::Response& res) {
    int delay_ms;
    {
      std::lock_guard<std::mutex> lock(mu_);
      delay_ms = health_delay_ms_;
    }
    // A saturated SGLang worker answers /health late: it queues behind the generations.
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    std::lock_guard<std::mutex> lock(mu_);
    res.status = healthy_ ? 200 : 503;
  };
  server_.Get("/health", health);
  server_.Get("/health_generate", health);
  auto info = [this](const httplib::Request&, httplib::Response& res) {
    std::lock_guard<std::mutex> lock(mu_);
    Reply(res, {{"model_path", model_path_}, {"weight_version", version_}, {"paused", paused_}});
  };
  server_.Get("/get_model_info", info);
  server_.Get("/get_server_info", info);
  server_.Post("/pause_generation", [this](const httplib::Request& req, httplib::Response& res) {
    json body = json::parse(req.body.empty() ? "{}" : req.body, nullptr, false);
    std::string mode = body.is_object() ? body.value("mode", "abort") : "abort";
    if (mode != "in_place" && mode != "abort" && mode != "retract") {
      SetError(res, 400, "mode must be in_place, retract or abort");
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    paused_ = true;
    Reply(res, {{"success", true}, {"mode", mode}});
  });
  server_.Post("/continue_generation", [this](const httplib::Request&, httplib::Response& res) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (fail_continue_) {
        SetError(res, 500, "injected continue failure");
        return;
      }
      paused_ = false;
    }
    resumed_.notify_all();
    Reply(res, {{"success", true}});
  });
  server_.Post("/update_weights_from_disk", [this](const httplib::Request& req,
                                                   httplib::Response& res) {
    json body;
    if (!ParseBody(req, res, &body)) {
      return;
    }
    if (!body.contains("model_path") || !body["model_path"].is_string()) {
      Reply(res, {{"success", false}, {"message", "model_path is required"}}, 400);
      return;
    }
    int delay_ms;
    {
      std::lock_guard<std::mutex> lock(mu_);
      delay_ms = update_delay_ms_;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    std::lock_guard<std::mutex> lock(mu_);
    if (fail_update_after_ == 0) {
      fail_update_ = true;
    }
    if (fail_update_after_ >= 0) {
      fail_update_after_--;
    }
    if (fail_update_) {
      Reply(res, {{"success", false}, {"message", "injected load failure"}}, 400);
      return;
    }
    model_path_ = body["model_path"].get<std::string>();
    if (body.contains("weight_version") && body["weight_version"].is_string()) {
      version_ = body["weight_version"].get<std::string>();
      version_names_[VersionId(version_)] = version_;
    }
    if (body.value("flush_cache", true)) {
      cache_.Clear();
    }
    updates_++;
    if (drop_update_replies_ > 0) {
      drop_update_replies_--;
      // Loaded, but the connection breaks before the answer: the caller cannot know.
      res.set_chunked_content_provider("application/json",
                                       [](size_t, httplib::DataSink&) { return false; });
      return;
    }
    Reply(res,
          {{"success", true}, {"message", "loaded " + model_path_}, {"weight_version", version_}});
  });
  server_.Post("/abort_request", [this](const httplib::Request& req, httplib::Response& res) {
    json body;
    if (!ParseBody(req, res, &body)) {
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (body.contains("rid") && body["rid"].is_string()) {
      aborted_.insert(body["rid"].get<std::string>());
      aborted_rids_.push_back(body["rid"].get<std::string>());
      if (aborted_rids_.size() > kAbortedRidsKept) {
        aborted_rids_.pop_front();
      }
      aborts_++;
    }
    Reply(res, {{"success", true}});
  });
  server_.Post("/flush_cache", [this](const httplib::Request&, httplib::Response& res) {
    std::lock_guard<std::mutex> lock(mu_);
    cache_.Clear();
    flushes_++;
    Reply(res, {{"success", true}});
  });
  // A framework pushing weights itself (NCCL, CUDA IPC), bypassing the gateway: the version
  // changes here alone. SGLang flushes the cache unless told not to.
  auto external_update = [this](const httplib::Request& req, httplib::Response& res) {
    json body;
    if (!ParseBody(req, res, &body)) {
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (body.contains("weight_version") && body["weight_version"].is_string()) {
      version_ = body["weight_version"].get<std::string>();
      version_names_[VersionId(version_)] = version_;
    }
    if (body.value("flush_cache", true)) {
      cache_.Clear();
    }
    updates_++;
    Reply(res, {{"success", true}, {"message", "updated"}, {"weight_version", version_}});
  };
  server_.Post("/update_weights_from_distributed", external_update);
  server_.Post("/update_weights_from_tensor", external_update);
  server_.Post("/init_weights_update_group", [](const httplib::Request&, httplib::Response& res) {
    Reply(res, {{"success", true}, {"message", "group initialized"}});
  });
  server_.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    std::lock_guard<std::mutex> lock(mu_);
    Reply(res, {{"object", "list"},
                {"data",
                 {{{"id", model_path_},
                   {"object", "model"},
                   {"owned_by", "sglang"},
                   {"root", model_path_}}}}});
  });
  // Test knobs: {"error_rate": p, "fail_update": bool, "fail_update_after": n, "fail_continue":
  // bool, "update_delay_ms": ms, "drop_update_replies": n, "healthy": bool, "health_delay_ms":
  // ms}.
  server_.Post("/sim/config", [this](const httplib::Request& req, httplib::Response& res) {
    json body;
    if (!ParseBody(req, res, &body)) {
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    error_rate_ = body.value("error_rate", error_rate_);
    fail_update_ = body.value("fail_update", fail_update_);
    fail_update_after_ = body.value("fail_update_after", fail_update_after_);
    fail_continue_ = body.value("fail_continue", fail_continue_);
    update_delay_ms_ = body.value("update_delay_ms", update_delay_ms_);
    drop_update_replies_ = body.value("drop_update_replies", drop_update_replies_);
    healthy_ = body.value("healthy", healthy_);
    health_delay_ms_ = body.value("health_delay_ms", health_delay_ms_);
    Reply(res, {{"success", true}});
  });
  server_.Get("/sim/stats", [this](const httplib::Request&, httplib::Response& res) {
    std::lock_guard<std::mutex> lock(mu_);
    Reply(res, {{"requests", requests_},
                {"aborts", aborts_},
                {"aborted_rids", aborted_rids_},
                {"updates", updates_},
                {"flushes", flushes_},
                {"unauthorized", unauthorized_},
                {"last_authorization", last_authorization_},
                {"cache_tokens", cache_.size_tokens()},
                {"weight_version", version_},
                {"paused", paused_},
                {"last_request", last_request_}});
  });
  auto openai = [this](bool chat) {
    return [this, chat](const httplib::Request& req, httplib::Response& res) {
      json body;
      if (!ParseBody(req, res, &body)) {
        return;
      }
      std::string prompt;
      if (chat && body.contains("messages") && body["messages"].is_array()) {
        for (const json& m : body["messages"]) {
          if (m.is_object() && m.contains("content") && m["content"].is_string()) {
            prompt += m["content"].get<std::string>();
          }
        }
      } else if (!chat && body.contains("prompt") && body["prompt"].is_string()) {
        prompt = body["prompt"].get<std::string>();
      }
      if (prompt.empty()) {
        SetError(res, 400, chat ? "messages with string content required" : "prompt required");
        return;
      }
      auto job = std::make_shared<GenerateJob>();
      for (unsigned char c : prompt) {
        job->input_ids.push_back(c);
      }
      if (body.contains("max_tokens")) {
        if (!body["max_tokens"].is_number_integer() || body["max_tokens"].get<int64_t>() < 0 ||
            body["max_tokens"].get<int64_t>() > (1 << 20)) {
          SetError(res, 400, "max_tokens must be an integer in [0, 2^20]");
          return;
        }
        job->max_new_tokens = body["max_tokens"].get<size_t>();
      }
      job->rid = body.contains("rid") && body["rid"].is_string()
                     ? body["rid"].get<std::string>()
                     : fmt::format("sim-oai-{}", rid_counter_.fetch_add(1));
      job->stream = body.value("stream", false);
      {
        std::lock_guard<std::mutex> lock(mu_);
        requests_++;
        last_request_ = body;
      }
      std::string object = chat ? "chat.completion" : "text_completion";
      auto usage = [](const json& meta) {
        return json{{"prompt_tokens", meta["prompt_tokens"]},
                    {"completion_tokens", meta["completion_tokens"]},
                    {"prompt_tokens_details", {{"cached_tokens", meta["cached_tokens"]}}}};
      };
      if (!job->stream) {
        json out = Generate(*job, nullptr);
        const json& meta = out["meta_info"];
        json choice = {{"index", 0}, {"finish_reason", job->aborted ? "abort" : "length"}};
        if (chat) {
          choice["message"] = {{"role", "assistant"}, {"content", out["text"]}};
        } else {
          choice["text"] = out["text"];
        }
        Reply(res, {{"id", job->rid},
                    {"object", object},
                    {"model", model_path_},
                    {"choices", json::array({choice})},
                    {"usage", usage(meta)}});
        return;
      }
      // OpenAI streaming: one chunk per token, then one with the finish reason and usage.
      res.set_chunked_content_provider(
          "text/event-stream", [this, job, chat, object, usage](size_t, httplib::DataSink& sink) {
            auto piece = [&](const json& delta_or_text, const json& finish) {
              json choice = {{"index", 0}, {"finish_reason", finish}};
              if (chat) {
                choice["delta"] = delta_or_text;
              } else {
                choice["text"] = delta_or_text;
              }
              return json{{"id", job->rid},
                          {"object", object + ".chunk"},
                          {"model", model_path_},
                          {"choices", json::array({choice})}};
            };
            auto emit = [&](const json& chunk) {
              std::string text = fmt::format(" t{}", chunk["output_ids"].back().get<int32_t>());
              json c = piece(chat ? json{{"content", text}} : json(text), nullptr);
              std::string s = "data: " + c.dump() + "\n\n";
              return sink.write(s.data(), s.size());
            };
            json out = Generate(*job, emit);
            if (!job->aborted) {
              json last = piece(chat ? json::object() : json(""), "length");
              last["usage"] = usage(out["meta_info"]);
              std::string s = "data: " + last.dump() + "\n\ndata: [DONE]\n\n";
              sink.write(s.data(), s.size());
            }
            sink.done();
            return true;
          });
    };
  };
  server_.Post("/v1/chat/completions", openai(true));
  server_.Post("/v1/completions", openai(false));
}

}  // namespace bragg::gateway
