#include "gateway/gateway.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <future>

#include "common/logging.h"

namespace bragg::gateway {

using nlohmann::json;

namespace {

void Reply(httplib::Response& res, const json& body, int status = 200) {
  res.status = status;
  res.set_content(body.dump(), "application/json");
}

// Reads prompt_tokens and cached_tokens from a /generate response body (or SSE data line).
void ReadUsage(std::string_view body, uint64_t* prompt, uint64_t* cached) {
  json j = json::parse(body, nullptr, false);
  if (j.is_array() && !j.empty()) {
    j = j.back();
  }
  if (!j.is_object() || !j.contains("meta_info") || !j["meta_info"].is_object()) {
    return;
  }
  const json& m = j["meta_info"];
  if (m.contains("prompt_tokens") && m["prompt_tokens"].is_number_unsigned()) {
    *prompt = m["prompt_tokens"].get<uint64_t>();
  }
  if (m.contains("cached_tokens") && m["cached_tokens"].is_number_unsigned()) {
    *cached = m["cached_tokens"].get<uint64_t>();
  }
}

// Last complete "data: {...}" JSON of an SSE stream tail.
std::string LastSseJson(const std::string& tail) {
  size_t end = tail.size();
  while (end > 0) {
    size_t start = tail.rfind("data: ", end - 1);
    if (start == std::string::npos) {
      return "";
    }
    size_t stop = tail.find("\n\n", start);
    std::string payload =
        tail.substr(start + 6, (stop == std::string::npos ? end : stop) - (start + 6));
    if (!payload.empty() && payload[0] == '{') {
      return payload;
    }
    if (start == 0) {
      return "";
    }
    end = start;
  }
  return "";
}

}  // namespace

json WeightUpdateReport::ToJson() const {
  json workers_json = json::array();
  for (const WorkerUpdate& w : workers) {
    workers_json.push_back({{"url", w.url},
                            {"previous_version", w.previous_version},
                            {"paused", w.paused},
                            {"loaded", w.loaded},
                            {"rolled_back", w.rolled_back},
                            {"continued", w.continued},
                            {"removed", w.removed},
                            {"error", w.error}});
  }
  return {{"success", success}, {"weight_version", weight_version}, {"workers", workers_json}};
}

Gateway::Gateway(GatewayOptions options)
    : options_(std::move(options)),
      main_(std::make_unique<Pool>("main", options_.router)),
      rng_(std::random_device{}()) {
  RouterOptions pd = options_.router;
  pd.policy = Policy::kSticky;
  prefill_ = std::make_unique<Pool>("prefill", pd);
  decode_ = std::make_unique<Pool>("decode", pd);
  server_.new_task_queue = [n = options_.max_threads] { return new ElasticTaskQueue(n); };
  server_.set_tcp_nodelay(true);
  server_.set_keep_alive_max_count(1 << 30);
  server_.set_keep_alive_timeout(60);
  server_.set_read_timeout(3600, 0);
  Register();
}

Gateway::~Gateway() { Stop(); }

Status Gateway::AddWorker(Pool& pool, const std::string& url) {
  BRAGG_ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(url));
  std::string canonical = fmt::format("http://{}:{}", hp.host, hp.port);
  std::lock_guard<std::mutex> lock(pool.mu);
  int index = pool.router.AddWorker(canonical);
  if (static_cast<size_t>(index) == pool.clients.size()) {
    pool.clients.push_back(std::make_unique<ClientPool>(hp));
    pool.urls.push_back(canonical);
    pool.versions.push_back("");
  }
  return absl::OkStatus();
}

ClientPool* Gateway::Client(Pool& pool, int worker) {
  std::lock_guard<std::mutex> lock(pool.mu);
  return pool.clients.at(worker).get();
}

Gateway::Upstream Gateway::Post(Pool& pool, int worker, const std::string& path,
                                const std::string& body) {
  ClientPool* cp = Client(pool, worker);
  Upstream up;
  // A pooled keep-alive connection may have been closed by the worker; a fresh one decides.
  for (int attempt = 0; attempt < 2; ++attempt) {
    auto client = cp->Acquire();
    auto result = client->Post(path, body, "application/json");
    if (result) {
      up.error = httplib::Error::Success;
      up.status = result->status;
      up.body = std::move(result->body);
      cp->Release(std::move(client));
      return up;
    }
    up.error = result.error();
    if (up.error != httplib::Error::Connection || attempt == 1) {
      return up;
    }
  }
  return up;
}

void Gateway::MarkDown(Pool& pool, int worker, std::string_view why) {
  spdlog::warn("worker {} of pool {} is down: {}", pool.router.Snapshot()[worker].url, pool.name,
               why);
  pool.router.SetHealthy(worker, false);
}

Status Gateway::Start() {
  for (const std::string& w : options_.workers) {
    BRAGG_RETURN_IF_ERROR(Annotate(AddWorker(*main_, w), "--worker"));
  }
  for (const std::string& w : options_.prefill_workers) {
    BRAGG_RETURN_IF_ERROR(Annotate(AddWorker(*prefill_, w), "--prefill"));
  }
  for (const std::string& w : options_.decode_workers) {
    BRAGG_RETURN_IF_ERROR(Annotate(AddWorker(*decode_, w), "--decode"));
  }
  if (options_.prefill_workers.empty() != options_.decode_workers.empty()) {
    return absl::InvalidArgumentError(
        "prefill/decode disaggregation needs both --prefill and --decode workers");
  }
  BRAGG_ASSIGN_OR_RETURN(port_, BindServer(server_, options_.host, options_.port));
  serve_thread_ = std::thread([this] { server_.listen_after_bind(); });
  health_thread_ = std::thread([this] { HealthLoop(); });
  return absl::OkStatus();
}

void Gateway::Stop() {
  {
    std::lock_guard<std::mutex> lock(stop_mu_);
    stopping_ = true;
  }
  stop_cv_.notify_all();
  if (health_thread_.joinable()) {
    health_thread_.join();
  }
  server_.stop();
  if (serve_thread_.joinable()) {
    serve_thread_.join();
  }
}

void Gateway::HealthLoop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(stop_mu_);
      if (stop_cv_.wait_for(lock, std::chrono::milliseconds(options_.health_interval_ms),
                            [this] { return stopping_; })) {
        return;
      }
    }
    for (Pool* pool : {main_.get(), prefill_.get(), decode_.get()}) {
      std::vector<WorkerSnapshot> snap = pool->router.Snapshot();
      for (size_t i = 0; i < snap.size(); ++i) {
        ClientPool* cp = Client(*pool, static_cast<int>(i));
        httplib::Client c(cp->target().host, cp->target().port);
        c.set_connection_timeout(0, 500000);
        c.set_read_timeout(2, 0);
        auto r = c.Get("/health");
        bool ok = r && r->status == 200;
        std::string fleet;
        {
          std::lock_guard<std::mutex> lock(version_mu_);
          fleet = fleet_version_;
        }
        if (ok && !snap[i].healthy && !fleet.empty()) {
          // A worker that missed a fleet update must not serve new turns on old weights.
          auto info = c.Get("/get_model_info");
          json j = info ? json::parse(info->body, nullptr, false) : json();
          std::string v = j.is_object() ? j.value("weight_version", "") : "";
          if (v != fleet) {
            ok = false;
            spdlog::warn("worker {} answers but has weights {} instead of {}; kept out",
                         snap[i].url, v, fleet);
          } else {
            std::lock_guard<std::mutex> lock(pool->mu);
            pool->versions[i] = v;
          }
        }
        if (ok != snap[i].healthy) {
          spdlog::info("worker {} is {}", snap[i].url, ok ? "healthy" : "unhealthy");
          pool->router.SetHealthy(static_cast<int>(i), ok);
        }
      }
    }
  }
}

void Gateway::HandleGenerate(const httplib::Request& req, httplib::Response& res) {
  json body = json::parse(req.body, nullptr, false);
  if (body.is_discarded() || !body.is_object()) {
    SetError(res, 400, "request body must be a JSON object");
    return;
  }
  std::vector<int32_t> tokens;
  if (body.contains("input_ids")) {
    const json& ids = body["input_ids"];
    if (!ids.is_array() || ids.empty()) {
      SetError(res, 400, "input_ids must be a non-empty array of token ids");
      return;
    }
    tokens.reserve(ids.size());
    for (const json& t : ids) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX) {
        SetError(res, 400, "input_ids must hold non-negative 32-bit token ids");
        return;
      }
      tokens.push_back(static_cast<int32_t>(t.get<int64_t>()));
    }
  } else if (body.contains("text") && body["text"].is_string()) {
    for (unsigned char c : body["text"].get<std::string>()) {
      tokens.push_back(c);
    }
  } else {
    SetError(res, 400, "request needs input_ids or text");
    return;
  }
  std::string key;
  for (const char* field : {"routing_key", "rollout_id"}) {
    if (body.contains(field)) {
      if (!body[field].is_string()) {
        SetError(res, 400, fmt::format("{} must be a string", field));
        return;
      }
      key = body[field].get<std::string>();
      body.erase(field);
    }
  }
  if (key.empty() && req.has_header("X-Session-Id")) {
    key = req.get_header_value("X-Session-Id");
  }
  std::string client_salt;
  if (body.contains("extra_key") && body["extra_key"].is_string()) {
    client_salt = body["extra_key"].get<std::string>();
  }
  if (!body.contains("rid")) {
    body["rid"] = fmt::format("gw{}-{}", port_, rid_counter_.fetch_add(1));
  }
  if (options_.dp_size > 1 && !key.empty() && !body.contains("routed_dp_rank")) {
    // A rollout's KV lives on one DP rank: pin it there, spread rollouts by a stable hash.
    body["routed_dp_rank"] =
        static_cast<uint32_t>(static_cast<uint32_t>(-SaltToken(key)) % options_.dp_size);
  }
  bool pd = !options_.prefill_workers.empty();
  if (pd) {
    HandleGeneratePd(std::move(body), key, tokens, client_salt, res);
    return;
  }
  if (body.value("stream", false)) {
    HandleStream(std::move(body), std::move(key), std::move(tokens), std::move(client_salt), res);
    return;
  }
  Pool& pool = *main_;
  size_t tries = std::max<size_t>(1, pool.router.num_workers());
  for (size_t attempt = 0; attempt < tries; ++attempt) {
    Result<RouteDecision> d = pool.router.Route(key, tokens, client_salt);
    if (!d.ok()) {
      SetError(res, 503, std::string(d.status().message()));
      return;
    }
    if (client_salt.empty() && !d->salt.empty()) {
      body["extra_key"] = d->salt;
    }
    Upstream up = Post(pool, d->worker, "/generate", body.dump());
    if (up.error == httplib::Error::Connection) {
      // Nothing reached the worker, so moving the request is safe.
      pool.router.Finish(d->worker, 0, 0);
      MarkDown(pool, d->worker, "connection refused");
      continue;
    }
    if (up.error != httplib::Error::Success) {
      pool.router.Finish(d->worker, 0, 0);
      upstream_errors_++;
      SetError(res, 502,
               fmt::format("worker failed mid-request ({}); /generate is not retried because it "
                           "is not idempotent",
                           httplib::to_string(up.error)));
      return;
    }
    uint64_t prompt = 0;
    uint64_t cached = 0;
    ReadUsage(up.body, &prompt, &cached);
    pool.router.Finish(d->worker, prompt, cached);
    res.status = up.status;
    res.set_header("X-Bragg-Worker", Client(pool, d->worker)->target().host + ":" +
                                         std::to_string(Client(pool, d->worker)->target().port));
    res.set_content(std::move(up.body), "application/json");
    return;
  }
  SetError(res, 503, "no worker accepted the request");
}

void Gateway::HandleStream(json body, std::string key, std::vector<int32_t> tokens,
                           std::string client_salt, httplib::Response& res) {
  auto state = std::make_shared<std::tuple<json, std::string, std::vector<int32_t>, std::string>>(
      std::move(body), std::move(key), std::move(tokens), std::move(client_salt));
  res.set_chunked_content_provider("text/event-stream", [this, state](size_t,
                                                                      httplib::DataSink& sink) {
    auto& [body, key, tokens, client_salt] = *state;
    Pool& pool = *main_;
    size_t tries = std::max<size_t>(1, pool.router.num_workers());
    for (size_t attempt = 0; attempt < tries; ++attempt) {
      Result<RouteDecision> d = pool.router.Route(key, tokens, client_salt);
      if (!d.ok()) {
        std::string s =
            "data: " + json{{"error", std::string(d.status().message())}}.dump() + "\n\n";
        sink.write(s.data(), s.size());
        sink.done();
        return true;
      }
      if (client_salt.empty() && !d->salt.empty()) {
        body["extra_key"] = d->salt;
      }
      httplib::Request up;
      up.method = "POST";
      up.path = "/generate";
      up.body = body.dump();
      up.set_header("Content-Type", "application/json");
      size_t forwarded = 0;
      bool client_gone = false;
      std::string tail;
      up.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
        forwarded += len;
        tail.append(data, len);
        if (tail.size() > (1 << 20)) {
          tail.erase(0, tail.size() - (1 << 19));
        }
        if (!sink.write(data, len)) {
          client_gone = true;
          return false;
        }
        return true;
      };
      ClientPool* cp = Client(pool, d->worker);
      auto client = cp->Acquire();
      auto result = client->send(up);
      if (client_gone) {
        client_aborts_++;
        pool.router.Finish(d->worker, 0, 0);
        Post(pool, d->worker, "/abort_request", json{{"rid", body["rid"]}}.dump());
        return false;
      }
      if (!result && result.error() == httplib::Error::Connection && forwarded == 0) {
        pool.router.Finish(d->worker, 0, 0);
        MarkDown(pool, d->worker, "connection refused");
        continue;
      }
      if (!result) {
        pool.router.Finish(d->worker, 0, 0);
        upstream_errors_++;
        std::string s = "data: " +
                        json{{"error", fmt::format("worker failed mid-stream ({})",
                                                   httplib::to_string(result.error()))}}
                            .dump() +
                        "\n\n";
        sink.write(s.data(), s.size());
        sink.done();
        return true;
      }
      if (forwarded == 0 && !result->body.empty()) {
        sink.write(result->body.data(), result->body.size());
      }
      cp->Release(std::move(client));
      uint64_t prompt = 0;
      uint64_t cached = 0;
      ReadUsage(LastSseJson(tail), &prompt, &cached);
      pool.router.Finish(d->worker, prompt, cached);
      sink.done();
      return true;
    }
    std::string s = "data: " + json{{"error", "no worker accepted the request"}}.dump() + "\n\n";
    sink.write(s.data(), s.size());
    sink.done();
    return true;
  });
}

void Gateway::HandleGeneratePd(json body, const std::string& key,
                               const std::vector<int32_t>& tokens, const std::string& client_salt,
                               httplib::Response& res) {
  Result<RouteDecision> p = prefill_->router.Route(key, tokens, client_salt);
  if (!p.ok()) {
    SetError(res, 503, "prefill pool: " + std::string(p.status().message()));
    return;
  }
  Result<RouteDecision> d = decode_->router.Route(key, tokens, client_salt);
  if (!d.ok()) {
    prefill_->router.Finish(p->worker, 0, 0);
    SetError(res, 503, "decode pool: " + std::string(d.status().message()));
    return;
  }
  if (client_salt.empty() && !d->salt.empty()) {
    body["extra_key"] = d->salt;
  }
  uint64_t room;
  {
    std::lock_guard<std::mutex> lock(rng_mu_);
    room = rng_() & ((uint64_t{1} << 63) - 1);
  }
  body["bootstrap_host"] = Client(*prefill_, p->worker)->target().host;
  body["bootstrap_port"] = options_.bootstrap_port;
  body["bootstrap_room"] = room;
  std::string payload = body.dump();
  auto prefill_future = std::async(
      std::launch::async, [&] { return Post(*prefill_, p->worker, "/generate", payload); });
  Upstream du = Post(*decode_, d->worker, "/generate", payload);
  Upstream pu = prefill_future.get();
  uint64_t prompt = 0;
  uint64_t cached = 0;
  ReadUsage(pu.body, &prompt, &cached);
  prefill_->router.Finish(p->worker, prompt, cached);
  prompt = cached = 0;
  ReadUsage(du.body, &prompt, &cached);
  decode_->router.Finish(d->worker, prompt, cached);
  if (pu.error != httplib::Error::Success || du.error != httplib::Error::Success) {
    upstream_errors_++;
    SetError(res, 502,
             fmt::format("prefill: {}, decode: {}", httplib::to_string(pu.error),
                         httplib::to_string(du.error)));
    return;
  }
  if (pu.status != 200) {
    res.status = pu.status;
    res.set_content(std::move(pu.body), "application/json");
    return;
  }
  res.status = du.status;
  res.set_content(std::move(du.body), "application/json");
}

void Gateway::HandleOpenAi(const httplib::Request& req, httplib::Response& res) {
  json body = json::parse(req.body, nullptr, false);
  if (body.is_discarded() || !body.is_object()) {
    SetError(res, 400, "request body must be a JSON object");
    return;
  }
  std::string key = req.get_header_value("X-Session-Id");
  if (key.empty() && body.contains("user") && body["user"].is_string()) {
    key = body["user"].get<std::string>();
  }
  // Route by the prompt bytes: the approximate tree only needs a stable prefix.
  std::vector<int32_t> tokens;
  std::string prompt =
      body.contains("messages") ? body["messages"].dump() : body.value("prompt", json()).dump();
  for (unsigned char c : prompt) {
    tokens.push_back(c);
  }
  Pool& pool = *main_;
  size_t tries = std::max<size_t>(1, pool.router.num_workers());
  for (size_t attempt = 0; attempt < tries; ++attempt) {
    Result<RouteDecision> d = pool.router.Route(key, tokens);
    if (!d.ok()) {
      SetError(res, 503, std::string(d.status().message()));
      return;
    }
    Upstream up = Post(pool, d->worker, req.path, req.body);
    pool.router.Finish(d->worker, 0, 0);
    if (up.error == httplib::Error::Connection) {
      MarkDown(pool, d->worker, "connection refused");
      continue;
    }
    if (up.error != httplib::Error::Success) {
      upstream_errors_++;
      SetError(res, 502,
               fmt::format("worker failed mid-request ({})", httplib::to_string(up.error)));
      return;
    }
    res.status = up.status;
    res.set_content(std::move(up.body), "application/json");
    return;
  }
  SetError(res, 503, "no worker accepted the request");
}

std::vector<Gateway::Target> Gateway::HealthyTargets() {
  std::vector<Target> out;
  for (Pool* pool : {main_.get(), prefill_.get(), decode_.get()}) {
    std::vector<WorkerSnapshot> snap = pool->router.Snapshot();
    for (size_t i = 0; i < snap.size(); ++i) {
      if (snap[i].healthy) {
        out.push_back({pool, static_cast<int>(i), snap[i].url});
      }
    }
  }
  return out;
}

WeightUpdateReport Gateway::UpdateWeights(const std::string& model_path,
                                          const std::string& version) {
  std::lock_guard<std::mutex> update_lock(update_mu_);
  WeightUpdateReport report;
  report.weight_version = version;
  std::vector<Target> targets = HealthyTargets();
  std::vector<std::string> previous_paths(targets.size());
  report.workers.resize(targets.size());
  bool ok = !targets.empty();
  if (targets.empty()) {
    spdlog::warn("weight update to {} with no healthy worker", version);
  }
  // Each phase runs on all workers at once: the pause is as short as the slowest worker.
  auto each = [&](auto fn) {
    std::vector<std::future<void>> fs;
    for (size_t i = 0; i < targets.size(); ++i) {
      fs.push_back(std::async(std::launch::async, [&, i] { fn(i); }));
    }
    for (auto& f : fs) {
      f.get();
    }
  };
  each([&](size_t i) {
    WorkerUpdate& w = report.workers[i];
    w.url = targets[i].url;
    httplib::Client c(Client(*targets[i].pool, targets[i].worker)->target().host,
                      Client(*targets[i].pool, targets[i].worker)->target().port);
    c.set_connection_timeout(2, 0);
    auto r = c.Get("/get_model_info");
    json info = r ? json::parse(r->body, nullptr, false) : json();
    if (!r || r->status != 200 || !info.is_object()) {
      w.error = "cannot read current weights from /get_model_info";
      return;
    }
    previous_paths[i] = info.value("model_path", "");
    w.previous_version = info.value("weight_version", "");
  });
  for (const WorkerUpdate& w : report.workers) {
    ok = ok && w.error.empty();
  }
  if (ok) {
    each([&](size_t i) {
      Upstream up = Post(*targets[i].pool, targets[i].worker, "/pause_generation",
                         json{{"mode", "in_place"}}.dump());
      report.workers[i].paused = up.error == httplib::Error::Success && up.status == 200;
      if (!report.workers[i].paused) {
        report.workers[i].error =
            fmt::format("pause_generation failed: {} {}", httplib::to_string(up.error), up.status);
      }
    });
    for (const WorkerUpdate& w : report.workers) {
      ok = ok && w.paused;
    }
  }
  if (ok) {
    each([&](size_t i) {
      Upstream up =
          Post(*targets[i].pool, targets[i].worker, "/update_weights_from_disk",
               json{{"model_path", model_path}, {"weight_version", version}, {"flush_cache", false}}
                   .dump());
      json j = json::parse(up.body, nullptr, false);
      report.workers[i].loaded = up.error == httplib::Error::Success && up.status == 200 &&
                                 j.is_object() && j.value("success", false);
      if (!report.workers[i].loaded) {
        report.workers[i].error =
            fmt::format("update_weights_from_disk failed: {} {} {}", httplib::to_string(up.error),
                        up.status, j.is_object() ? j.value("message", "") : up.body);
      }
    });
    for (const WorkerUpdate& w : report.workers) {
      ok = ok && w.loaded;
    }
    if (!ok) {
      // Fail safe: the fleet stays on one version, the old one.
      each([&](size_t i) {
        WorkerUpdate& w = report.workers[i];
        if (!w.loaded) {
          return;
        }
        Upstream up = Post(*targets[i].pool, targets[i].worker, "/update_weights_from_disk",
                           json{{"model_path", previous_paths[i]},
                                {"weight_version", w.previous_version},
                                {"flush_cache", false}}
                               .dump());
        json j = json::parse(up.body, nullptr, false);
        w.rolled_back = up.error == httplib::Error::Success && up.status == 200 && j.is_object() &&
                        j.value("success", false);
        if (!w.rolled_back) {
          w.removed = true;
          MarkDown(*targets[i].pool, targets[i].worker, "could not roll back to old weights");
        }
      });
    }
  }
  each([&](size_t i) {
    WorkerUpdate& w = report.workers[i];
    if (!w.paused) {
      return;
    }
    Upstream up = Post(*targets[i].pool, targets[i].worker, "/continue_generation", "{}");
    w.continued = up.error == httplib::Error::Success && up.status == 200;
    if (!w.continued) {
      w.removed = true;
      MarkDown(*targets[i].pool, targets[i].worker, "continue_generation failed");
    }
  });
  for (size_t i = 0; i < targets.size(); ++i) {
    Pool& pool = *targets[i].pool;
    std::lock_guard<std::mutex> lock(pool.mu);
    const WorkerUpdate& w = report.workers[i];
    pool.versions[targets[i].worker] =
        ok ? version : (w.loaded && !w.rolled_back ? version : w.previous_version);
  }
  report.success = ok;
  if (ok) {
    for (Pool* pool : {main_.get(), prefill_.get(), decode_.get()}) {
      pool->router.SetFleetVersion(version);
    }
    std::lock_guard<std::mutex> lock(version_mu_);
    fleet_version_ = version;
    weight_updates_ok_++;
  } else {
    weight_updates_failed_++;
  }
  return report;
}

std::string Gateway::Metrics() {
  std::string out;
  std::string fleet;
  {
    std::lock_guard<std::mutex> lock(version_mu_);
    fleet = fleet_version_;
  }
  out += "# TYPE bragg_gateway_worker_healthy gauge\n";
  out += "# TYPE bragg_gateway_worker_in_flight gauge\n";
  out += "# TYPE bragg_gateway_worker_rollouts gauge\n";
  out += "# TYPE bragg_gateway_worker_requests_total counter\n";
  out += "# TYPE bragg_gateway_worker_prompt_tokens_total counter\n";
  out += "# TYPE bragg_gateway_worker_cached_tokens_total counter\n";
  out += "# TYPE bragg_gateway_worker_cache_hit_rate gauge\n";
  out += "# TYPE bragg_gateway_worker_rollouts_moved_total counter\n";
  uint64_t prompt_all = 0;
  uint64_t cached_all = 0;
  int skew = 0;
  std::string versions_block;
  for (Pool* pool : {main_.get(), prefill_.get(), decode_.get()}) {
    std::vector<WorkerSnapshot> snap = pool->router.Snapshot();
    std::vector<std::string> versions;
    {
      std::lock_guard<std::mutex> lock(pool->mu);
      versions.assign(pool->versions.begin(), pool->versions.end());
    }
    for (size_t i = 0; i < snap.size(); ++i) {
      const WorkerSnapshot& s = snap[i];
      std::string labels = fmt::format("pool=\"{}\",worker=\"{}\"", pool->name, s.url);
      out += fmt::format("bragg_gateway_worker_healthy{{{}}} {}\n", labels, s.healthy ? 1 : 0);
      out += fmt::format("bragg_gateway_worker_in_flight{{{}}} {}\n", labels, s.in_flight);
      out += fmt::format("bragg_gateway_worker_rollouts{{{}}} {}\n", labels, s.rollouts);
      out += fmt::format("bragg_gateway_worker_requests_total{{{}}} {}\n", labels, s.requests);
      out += fmt::format("bragg_gateway_worker_prompt_tokens_total{{{}}} {}\n", labels,
                         s.prompt_tokens);
      out += fmt::format("bragg_gateway_worker_cached_tokens_total{{{}}} {}\n", labels,
                         s.cached_tokens);
      out += fmt::format("bragg_gateway_worker_cache_hit_rate{{{}}} {:.6f}\n", labels,
                         s.prompt_tokens == 0 ? 0.0
                                              : static_cast<double>(s.cached_tokens) /
                                                    static_cast<double>(s.prompt_tokens));
      out +=
          fmt::format("bragg_gateway_worker_rollouts_moved_total{{{}}} {}\n", labels, s.moved_out);
      std::string v = i < versions.size() ? versions[i] : "";
      versions_block +=
          fmt::format("bragg_gateway_worker_weight_version{{{},version=\"{}\"}} 1\n", labels, v);
      if (s.healthy && !fleet.empty() && v != fleet) {
        ++skew;
      }
      prompt_all += s.prompt_tokens;
      cached_all += s.cached_tokens;
    }
  }
  out += "# TYPE bragg_gateway_worker_weight_version gauge\n" + versions_block;
  out += "# TYPE bragg_gateway_cache_hit_rate gauge\n";
  out += fmt::format(
      "bragg_gateway_cache_hit_rate {:.6f}\n",
      prompt_all == 0 ? 0.0 : static_cast<double>(cached_all) / static_cast<double>(prompt_all));
  out += "# TYPE bragg_gateway_routing_decisions_total counter\n";
  for (Pool* pool : {main_.get(), prefill_.get(), decode_.get()}) {
    for (const auto& [reason, n] : pool->router.DecisionCounts()) {
      out += fmt::format("bragg_gateway_routing_decisions_total{{pool=\"{}\",reason=\"{}\"}} {}\n",
                         pool->name, reason, n);
    }
  }
  out += "# TYPE bragg_gateway_weight_version_skew gauge\n";
  out += fmt::format("bragg_gateway_weight_version_skew {}\n", skew);
  out += "# TYPE bragg_gateway_client_aborts_total counter\n";
  out += fmt::format("bragg_gateway_client_aborts_total {}\n", client_aborts_.load());
  out += "# TYPE bragg_gateway_upstream_errors_total counter\n";
  out += fmt::format("bragg_gateway_upstream_errors_total {}\n", upstream_errors_.load());
  out += "# TYPE bragg_gateway_weight_updates_total counter\n";
  out += fmt::format("bragg_gateway_weight_updates_total{{result=\"ok\"}} {}\n",
                     weight_updates_ok_.load());
  out += fmt::format("bragg_gateway_weight_updates_total{{result=\"failed\"}} {}\n",
                     weight_updates_failed_.load());
  return out;
}

void Gateway::Register() {
  server_.Post("/generate", [this](const httplib::Request& req, httplib::Response& res) {
    HandleGenerate(req, res);
  });
  server_.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    HandleOpenAi(req, res);
  });
  server_.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    HandleOpenAi(req, res);
  });
  server_.Get("/health", [](const httplib::Request&, httplib::Response& res) { res.status = 200; });
  server_.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(Metrics(), "text/plain; version=0.0.4");
  });
  server_.Get("/workers", [this](const httplib::Request&, httplib::Response& res) {
    json out = json::array();
    for (Pool* pool : {main_.get(), prefill_.get(), decode_.get()}) {
      for (const WorkerSnapshot& s : pool->router.Snapshot()) {
        out.push_back({{"pool", pool->name},
                       {"url", s.url},
                       {"healthy", s.healthy},
                       {"in_flight", s.in_flight},
                       {"rollouts", s.rollouts},
                       {"requests", s.requests}});
      }
    }
    Reply(res, out);
  });
  server_.Post("/workers", [this](const httplib::Request& req, httplib::Response& res) {
    json body = json::parse(req.body, nullptr, false);
    if (!body.is_object() || !body.contains("url") || !body["url"].is_string()) {
      SetError(res, 400, "body must be {\"url\": \"http://HOST:PORT\"}");
      return;
    }
    Status s = AddWorker(*main_, body["url"].get<std::string>());
    if (!s.ok()) {
      SetError(res, 400, std::string(s.message()));
      return;
    }
    Reply(res, {{"success", true}});
  });
  server_.Post("/weights/update", [this](const httplib::Request& req, httplib::Response& res) {
    json body = json::parse(req.body, nullptr, false);
    if (!body.is_object() || !body.contains("model_path") || !body["model_path"].is_string() ||
        !body.contains("weight_version") || !body["weight_version"].is_string() ||
        body["weight_version"].get<std::string>().empty()) {
      SetError(res, 400,
               "body must be {\"model_path\": \"...\", \"weight_version\": \"<non-empty>\"}");
      return;
    }
    WeightUpdateReport report = UpdateWeights(body["model_path"].get<std::string>(),
                                              body["weight_version"].get<std::string>());
    Reply(res, report.ToJson(), report.success ? 200 : 500);
  });
  server_.Post("/rollouts/forget", [this](const httplib::Request& req, httplib::Response& res) {
    json body = json::parse(req.body, nullptr, false);
    if (!body.is_object() || !body.contains("routing_key") || !body["routing_key"].is_string()) {
      SetError(res, 400, "body must be {\"routing_key\": \"...\"}");
      return;
    }
    std::string key = body["routing_key"].get<std::string>();
    for (Pool* pool : {main_.get(), prefill_.get(), decode_.get()}) {
      pool->router.Forget(key);
    }
    Reply(res, {{"success", true}});
  });
}

}  // namespace bragg::gateway
