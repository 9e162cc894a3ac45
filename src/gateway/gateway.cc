#include "gateway/gateway.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <map>
#include <optional>

#include "common/logging.h"
#include "common/prometheus.h"
#include "gateway/request.h"

namespace bragg::gateway {

using nlohmann::json;

namespace {

HttpResponse JsonResponse(const json& body, int status = 200) {
  HttpResponse r;
  r.status = status;
  r.body = body.dump();
  return r;
}

// The value of the last key `quoted` ("\"name\"") holding an unsigned integer, outside JSON
// strings: a quote inside a string is always escaped, so a real key's opening quote follows '{',
// ',' or whitespace. Scanning instead of parsing keeps the proxy path cheap for large bodies.
bool LastUnsigned(std::string_view body, std::string_view quoted, uint64_t* out) {
  size_t at = body.size();
  while (at > 0) {
    at = body.rfind(quoted, at - 1);
    if (at == std::string_view::npos) {
      return false;
    }
    char before = at == 0 ? '{' : body[at - 1];
    if (before != '{' && before != ',' && !std::isspace(static_cast<unsigned char>(before))) {
      continue;
    }
    size_t p = at + quoted.size();
    while (p < body.size() && std::isspace(static_cast<unsigned char>(body[p]))) {
      ++p;
    }
    if (p >= body.size() || body[p] != ':') {
      continue;
    }
    ++p;
    while (p < body.size() && std::isspace(static_cast<unsigned char>(body[p]))) {
      ++p;
    }
    uint64_t v = 0;
    size_t digits = 0;
    while (p < body.size() && body[p] >= '0' && body[p] <= '9' && digits < 19) {
      v = v * 10 + static_cast<uint64_t>(body[p] - '0');
      ++p;
      ++digits;
    }
    if (digits == 0) {
      return false;
    }
    *out = v;
    return true;
  }
  return false;
}

// Reads prompt_tokens and cached_tokens of a /generate response body (or SSE data line); for a
// batch, those of its last element.
void ReadUsage(std::string_view body, uint64_t* prompt, uint64_t* cached) {
  uint64_t p = 0;
  uint64_t c = 0;
  if (LastUnsigned(body, "\"prompt_tokens\"", &p)) {
    *prompt = p;
  }
  if (LastUnsigned(body, "\"cached_tokens\"", &c)) {
    *cached = c;
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
                            {"version_after", w.version_after},
                            {"error", w.error}});
  }
  return {{"success", success}, {"weight_version", weight_version}, {"workers", workers_json}};
}

Gateway::Gateway(GatewayOptions options)
    : options_(std::move(options)),
      main_(std::make_unique<Pool>("main", options_.router)),
      rng_(std::random_device{}()) {
  rid_instance_ = rng_();
  RouterOptions pd = options_.router;
  pd.policy = Policy::kSticky;
  prefill_ = std::make_unique<Pool>("prefill", pd);
  decode_ = std::make_unique<Pool>("decode", pd);
  AsyncHttpOptions ho;
  ho.host = options_.host;
  ho.port = options_.port;
  ho.io_threads = options_.io_threads;
  ho.max_blocking_threads = options_.max_threads;
  ho.max_request_body = options_.max_body_bytes;
  ho.max_upstream_response = options_.max_upstream_response_bytes;
  ho.upstream_max_idle_ms = options_.upstream_idle_ms;
  server_ = std::make_unique<AsyncHttpServer>(std::move(ho));
  Register();
}

Gateway::~Gateway() { Stop(); }

int Gateway::io_threads() const { return server_->io_threads(); }

Status Gateway::AddWorker(Pool& pool, const std::string& url, bool healthy) {
  BRAGG_ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(url));
  std::string canonical = fmt::format("http://{}:{}", hp.host, hp.port);
  std::lock_guard<std::mutex> lock(pool.mu);
  int index = pool.router.AddWorker(canonical, healthy);
  if (static_cast<size_t>(index) == pool.clients.size()) {
    pool.clients.push_back(std::make_unique<ClientPool>(hp));
    pool.urls.push_back(canonical);
    pool.versions.push_back("");
    pool.health_failures.push_back(0);
    pool.quarantined.push_back(false);
    pool.needs_continue.push_back(false);
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

void Gateway::Quarantine(Pool& pool, int worker, std::string_view why, bool needs_continue) {
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    pool.quarantined[worker] = true;
    pool.needs_continue[worker] = pool.needs_continue[worker] || needs_continue;
  }
  MarkDown(pool, worker, why);
}

namespace {

// weight_version (and paused, where the worker says) from GET /get_model_info; nullopt when the
// worker does not answer it.
struct ModelInfo {
  std::string model_path;
  std::string weight_version;
  bool paused = false;
};

std::optional<ModelInfo> GetModelInfo(httplib::Client& c) {
  auto r = c.Get("/get_model_info");
  if (!r || r->status != 200) {
    return std::nullopt;
  }
  json j = json::parse(r->body, nullptr, false);
  if (!j.is_object()) {
    return std::nullopt;
  }
  ModelInfo info;
  if (j.contains("model_path") && j["model_path"].is_string()) {
    info.model_path = j["model_path"].get<std::string>();
  }
  if (j.contains("weight_version") && j["weight_version"].is_string()) {
    info.weight_version = j["weight_version"].get<std::string>();
  }
  // SGLang's /get_model_info does not say; the simulator does.
  info.paused = j.contains("paused") && j["paused"].is_boolean() && j["paused"].get<bool>();
  return info;
}

}  // namespace

void Gateway::ReadFleetVersion() {
  std::vector<Target> targets = HealthyTargets();
  std::vector<std::optional<ModelInfo>> infos(targets.size());
  std::vector<std::future<void>> fs;
  for (size_t i = 0; i < targets.size(); ++i) {
    fs.push_back(std::async(std::launch::async, [&, i] {
      const HostPort& hp = Client(*targets[i].pool, targets[i].worker)->target();
      httplib::Client c(hp.host, hp.port);
      c.set_connection_timeout(1, 0);
      c.set_read_timeout(5, 0);
      infos[i] = GetModelInfo(c);
    }));
  }
  for (auto& f : fs) {
    f.get();
  }
  // The fleet's version is the one most workers report; a worker that does not answer yet is
  // left to the health loop.
  std::map<std::string, int> votes;
  for (const auto& info : infos) {
    if (info) {
      votes[info->weight_version]++;
    }
  }
  if (votes.empty()) {
    return;
  }
  std::string fleet =
      std::max_element(votes.begin(), votes.end(), [](const auto& a, const auto& b) {
        return a.second < b.second;
      })->first;
  {
    std::lock_guard<std::mutex> lock(version_mu_);
    fleet_version_ = fleet;
  }
  for (size_t i = 0; i < targets.size(); ++i) {
    if (!infos[i]) {
      continue;
    }
    Pool& pool = *targets[i].pool;
    {
      std::lock_guard<std::mutex> lock(pool.mu);
      pool.versions[targets[i].worker] = infos[i]->weight_version;
    }
    if (infos[i]->weight_version != fleet) {
      Quarantine(
          pool, targets[i].worker,
          fmt::format("has weights {} while the fleet has {}", infos[i]->weight_version, fleet),
          false);
    }
  }
}

bool Gateway::Admit(Pool& pool, int worker, httplib::Client& c) {
  std::string url;
  bool needs_continue;
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    url = pool.urls[worker];
    needs_continue = pool.needs_continue[worker];
  }
  if (needs_continue) {
    auto r = c.Post("/continue_generation", "{}", "application/json");
    if (!r || r->status != 200) {
      spdlog::warn("worker {} may still be paused and continue_generation failed ({}); kept out",
                   url, r ? fmt::format("status {}", r->status) : httplib::to_string(r.error()));
      return false;
    }
    std::lock_guard<std::mutex> lock(pool.mu);
    pool.needs_continue[worker] = false;
  }
  std::optional<ModelInfo> info = GetModelInfo(c);
  if (!info) {
    spdlog::warn("worker {} answers /health but not /get_model_info; kept out", url);
    return false;
  }
  if (info->paused) {
    // Paused by someone else or by an update whose continue was lost: continue it next round.
    std::lock_guard<std::mutex> lock(pool.mu);
    pool.needs_continue[worker] = true;
    spdlog::warn("worker {} is paused; kept out", url);
    return false;
  }
  std::string fleet;
  {
    std::lock_guard<std::mutex> lock(version_mu_);
    if (fleet_version_.empty()) {
      fleet_version_ = info->weight_version;
    }
    fleet = fleet_version_;
  }
  if (info->weight_version != fleet) {
    spdlog::warn("worker {} answers but has weights {} instead of {}; kept out", url,
                 info->weight_version, fleet);
    return false;
  }
  std::lock_guard<std::mutex> lock(pool.mu);
  pool.versions[worker] = info->weight_version;
  pool.quarantined[worker] = false;
  return true;
}

Status Gateway::Start() {
  for (const std::string& w : options_.workers) {
    BRAGG_RETURN_IF_ERROR(Annotate(AddWorker(*main_, w, true), "--worker"));
  }
  for (const std::string& w : options_.prefill_workers) {
    BRAGG_RETURN_IF_ERROR(Annotate(AddWorker(*prefill_, w, true), "--prefill"));
  }
  for (const std::string& w : options_.decode_workers) {
    BRAGG_RETURN_IF_ERROR(Annotate(AddWorker(*decode_, w, true), "--decode"));
  }
  if (options_.prefill_workers.empty() != options_.decode_workers.empty()) {
    return absl::InvalidArgumentError(
        "prefill/decode disaggregation needs both --prefill and --decode workers");
  }
  ReadFleetVersion();
  BRAGG_RETURN_IF_ERROR(server_->Start());
  port_ = server_->port();
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
  server_->Stop();
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
        {
          // A worker being registered is in the router a moment before its client.
          std::lock_guard<std::mutex> lock(pool->mu);
          if (i >= pool->clients.size()) {
            break;
          }
        }
        ClientPool* cp = Client(*pool, static_cast<int>(i));
        httplib::Client c(cp->target().host, cp->target().port);
        c.set_connection_timeout(0, 500000);
        c.set_read_timeout(2, 0);
        auto r = c.Get("/health");
        bool ok = r && r->status == 200;
        int failures = 0;
        {
          std::lock_guard<std::mutex> lock(pool->mu);
          failures = ok ? 0 : ++pool->health_failures[i];
          if (ok) {
            pool->health_failures[i] = 0;
          }
        }
        if (!ok && snap[i].healthy && failures < options_.health_failures) {
          spdlog::info("worker {} failed health check {} of {}: {}", snap[i].url, failures,
                       options_.health_failures,
                       r ? fmt::format("status {}", r->status) : httplib::to_string(r.error()));
          continue;
        }
        bool quarantined;
        {
          std::lock_guard<std::mutex> lock(pool->mu);
          quarantined = pool->quarantined[i];
        }
        if (ok && (!snap[i].healthy || quarantined)) {
          // A worker that missed a fleet update, or that a failed one left on other weights or
          // paused, must not serve new turns. While an update runs it decides.
          std::unique_lock<std::mutex> updating(update_mu_, std::try_to_lock);
          if (!updating.owns_lock()) {
            continue;
          }
          ok = Admit(*pool, static_cast<int>(i), c);
          snap[i].healthy = pool->router.Snapshot()[i].healthy;
        }
        if (ok != snap[i].healthy) {
          spdlog::info("worker {} is {}", snap[i].url, ok ? "healthy" : "unhealthy");
          pool->router.SetHealthy(static_cast<int>(i), ok);
        }
      }
    }
  }
}

// The prefill half of a prefill/decode pair. The decode half runs as the client's exchange; the
// prefill half as a side call whose end may come before or after it.
struct Gateway::PdPrefill {
  int worker = -1;
  HostPort target;
  std::mutex mu;
  bool done = false;    // the prefill worker answered (or the call failed)
  bool failed = false;  // ... with an error, answered to the client instead of the decode output
  HttpResponse error;
  bool decode_over = false;  // the decode exchange ended
  std::optional<HostPort> decode_target;
};

// A routed request: the parsed request and where it went.
struct Gateway::Generate : Request {
  explicit Generate(Request r) : Request(std::move(r)) {}
  size_t attempts = 0;
  size_t max_attempts = 1;
  std::shared_ptr<PdPrefill> prefill;  // set for a prefill/decode pair
};

std::string Gateway::NewRid() {
  return fmt::format("gw-{:016x}-{}", rid_instance_, rid_counter_.fetch_add(1));
}

Action Gateway::HandleGenerate(HttpRequest& req) {
  Result<Request> r =
      ParseRequest(Endpoint::kGenerate, req, options_.dp_size, [this] { return NewRid(); });
  if (!r.ok()) {
    return Action::Respond(ErrorResponse(400, std::string(r.status().message())));
  }
  auto g = std::make_shared<Generate>(std::move(*r));
  if (!options_.prefill_workers.empty()) {
    if (g->batch > 0) {
      // Each element would need its own bootstrap_room on both halves.
      return Action::Respond(ErrorResponse(
          400,
          "batch requests are not supported with prefill/decode disaggregation: send one "
          "request per prompt"));
    }
    g->max_attempts = std::max<size_t>(1, decode_->router.num_workers());
    return StartPd(std::move(g));
  }
  g->max_attempts = std::max<size_t>(1, main_->router.num_workers());
  return RouteAndForward(std::move(g));
}

Action Gateway::RouteAndForward(std::shared_ptr<Generate> g) {
  Pool& pool = g->prefill ? *decode_ : *main_;
  if (g->attempts++ >= g->max_attempts) {
    return Action::Respond(ErrorResponse(503, "no worker accepted the request"));
  }
  Result<RouteDecision> d = pool.router.Route(g->key, g->tokens, g->client_salt);
  if (!d.ok()) {
    return Action::Respond(ErrorResponse(503, std::string(d.status().message())));
  }
  return ForwardTo(std::move(g), *d);
}

Action Gateway::StartPd(std::shared_ptr<Generate> g) {
  Result<RouteDecision> p = prefill_->router.Route(g->key, g->tokens, g->client_salt);
  if (!p.ok()) {
    return Action::Respond(
        ErrorResponse(503, "prefill pool: " + std::string(p.status().message())));
  }
  g->attempts++;
  Result<RouteDecision> d = decode_->router.Route(g->key, g->tokens, g->client_salt);
  if (!d.ok()) {
    prefill_->router.Finish(p->worker, 0, 0);
    return Action::Respond(ErrorResponse(503, "decode pool: " + std::string(d.status().message())));
  }
  auto pre = std::make_shared<PdPrefill>();
  pre->worker = p->worker;
  pre->target = Client(*prefill_, p->worker)->target();
  // Known before the prefill half leaves: if it fails at once, its decode half is aborted.
  pre->decode_target = Client(*decode_, d->worker)->target();
  uint64_t room;
  {
    std::lock_guard<std::mutex> lock(rng_mu_);
    room = rng_() & ((uint64_t{1} << 63) - 1);
  }
  g->body["bootstrap_host"] = pre->target.host;
  g->body["bootstrap_port"] = options_.bootstrap_port;
  g->body["bootstrap_room"] = room;
  g->prefill = pre;
  // Both halves at once: the decode worker waits for the KV the prefill worker computes.
  server_->Call(pre->target, "/generate", BodyWithExtraKey(g.get(), d->salt),
                [this, g](CallResult& r) {
    PdPrefill& pre = *g->prefill;
    uint64_t prompt = 0;
    uint64_t cached = 0;
    if (r.ok) {
      ReadUsage(g->stream ? LastSseJson(r.body) : r.body, &prompt, &cached);
    }
    prefill_->router.Finish(pre.worker, prompt, cached);
    HttpResponse error;
    if (!r.ok) {
      upstream_errors_++;
      error = ErrorResponse(502, fmt::format("prefill worker failed: {}; /generate is not "
                                             "retried because it is not idempotent",
                                             r.error));
    } else if (r.status != 200) {
      error.status = r.status;
      error.body = std::move(r.body);
    }
    std::optional<HostPort> decode;
    {
      std::lock_guard<std::mutex> lock(pre.mu);
      pre.done = true;
      if (error.status == 200) {
        return;
      }
      pre.failed = true;
      pre.error = std::move(error);
      if (!pre.decode_over) {
        decode = pre.decode_target;
      }
    }
    if (decode) {
      // Without its prefill the decode half would wait for KV that never comes.
      server_->Send(*decode, "/abort_request", json{{"rid", g->rid}}.dump());
    }
  });
  return ForwardTo(std::move(g), *d);
}

void Gateway::AbortUpstream(const Generate& g, const HostPort& target) {
  // SGLang's /abort_request names one rid: a batch's are aborted one by one.
  std::vector<std::string> aborts;
  if (g.rid.is_array()) {
    for (const json& r : g.rid) {
      aborts.push_back(json{{"rid", r}}.dump());
    }
  } else {
    aborts.push_back(json{{"rid", g.rid}}.dump());
  }
  bool prefill_running = false;
  if (g.prefill) {
    std::lock_guard<std::mutex> lock(g.prefill->mu);
    prefill_running = !g.prefill->done;
  }
  for (const std::string& abort : aborts) {
    server_->Send(target, "/abort_request", abort);
    if (prefill_running) {
      server_->Send(g.prefill->target, "/abort_request", abort);
    }
  }
}

Action Gateway::ForwardTo(std::shared_ptr<Generate> g, const RouteDecision& d) {
  Pool& pool = g->prefill ? *decode_ : *main_;
  Forward f;
  f.body = BodyWithExtraKey(g.get(), d.salt);
  f.upstream = Client(pool, d.worker)->target();
  f.path = g->path;
  f.stream = g->stream;
  if (g->endpoint == Endpoint::kGenerate) {
    f.response_headers.emplace_back("X-Bragg-Worker",
                                    fmt::format("{}:{}", f.upstream.host, f.upstream.port));
  }
  if (g->prefill) {
    std::lock_guard<std::mutex> lock(g->prefill->mu);
    g->prefill->decode_target = f.upstream;
  }
  int worker = d.worker;
  HostPort target = f.upstream;
  f.done = [this, g, worker, target](UpstreamResult& r) -> Action {
    Pool& pool = g->prefill ? *decode_ : *main_;
    using Outcome = UpstreamResult::Outcome;
    switch (r.outcome) {
      case Outcome::kConnectFailed: {
        pool.router.Finish(worker, 0, 0);
        Action next;
        if (r.local) {
          upstream_errors_++;
          next = Action::Respond(
              ErrorResponse(503, fmt::format("gateway overloaded: {}; retry later", r.error)));
        } else {
          // Nothing reached the worker, so moving the request is safe.
          MarkDown(pool, worker, r.error);
          next = RouteAndForward(g);
        }
        if (next.kind != Action::Kind::kForward && g->prefill) {
          // No decode worker takes the pair: its prefill half is useless.
          std::lock_guard<std::mutex> lock(g->prefill->mu);
          g->prefill->decode_over = true;
          if (!g->prefill->done) {
            server_->Send(g->prefill->target, "/abort_request", json{{"rid", g->rid}}.dump());
          }
        }
        return next;
      }
      case Outcome::kClientGone:
        client_aborts_++;
        pool.router.Finish(worker, 0, 0);
        AbortUpstream(*g, target);
        return Action::None();
      case Outcome::kFailed: {
        pool.router.Finish(worker, 0, 0);
        upstream_errors_++;
        if (g->prefill) {
          AbortUpstream(*g, target);
        }
        std::string why = fmt::format(
            "worker failed mid-request ({}); {} is not retried because it is not "
            "idempotent",
            r.error, g->path);
        if (r.started) {
          HttpResponse sse;
          sse.body = "data: " + json{{"error", why}}.dump() + "\n\n";
          return Action::Respond(std::move(sse));
        }
        return Action::Respond(ErrorResponse(502, why));
      }
      case Outcome::kOk: {
        uint64_t prompt = 0;
        uint64_t cached = 0;
        // SGLang's OpenAI answers carry usage.prompt_tokens and, with --enable-cache-report,
        // usage.prompt_tokens_details.cached_tokens (in the last event when streaming with
        // stream_options.include_usage).
        ReadUsage(g->stream ? LastSseJson(r.body) : r.body, &prompt, &cached);
        pool.router.Finish(worker, prompt, cached);
        if (!g->prefill) {
          return Action::None();
        }
        HttpResponse error;
        {
          std::lock_guard<std::mutex> lock(g->prefill->mu);
          g->prefill->decode_over = true;
          if (!g->prefill->failed) {
            return Action::None();
          }
          error = g->prefill->error;
        }
        // The decode half ended (aborted) because its prefill half failed: say why.
        if (r.started) {
          HttpResponse sse;
          json e = json::parse(error.body, nullptr, false);
          sse.body =
              "data: " + (e.is_discarded() ? json{{"error", error.body}} : e).dump() + "\n\n";
          return Action::Respond(std::move(sse));
        }
        return Action::Respond(std::move(error));
      }
    }
    return Action::None();
  };
  return Action::Proxy(std::move(f));
}

Action Gateway::HandleOpenAi(HttpRequest& req) {
  Result<Request> r =
      ParseRequest(Endpoint::kOpenAi, req, options_.dp_size, [this] { return NewRid(); });
  if (!r.ok()) {
    return Action::Respond(ErrorResponse(400, std::string(r.status().message())));
  }
  auto g = std::make_shared<Generate>(std::move(*r));
  g->max_attempts = std::max<size_t>(1, main_->router.num_workers());
  return RouteAndForward(std::move(g));
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
  std::string old_fleet;
  {
    std::lock_guard<std::mutex> lock(version_mu_);
    old_fleet = fleet_version_;
  }
  std::vector<Target> targets = HealthyTargets();
  std::vector<std::string> previous_paths(targets.size());
  // The load's answer was lost (transport error): the worker may hold either version.
  std::vector<bool> load_unknown(targets.size(), false);
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
  auto control_client = [&](size_t i) {
    const HostPort& hp = Client(*targets[i].pool, targets[i].worker)->target();
    auto c = std::make_unique<httplib::Client>(hp.host, hp.port);
    c->set_connection_timeout(2, 0);
    c->set_read_timeout(10, 0);
    return c;
  };
  each([&](size_t i) {
    WorkerUpdate& w = report.workers[i];
    w.url = targets[i].url;
    std::optional<ModelInfo> info = GetModelInfo(*control_client(i));
    if (!info) {
      w.error = "cannot read current weights from /get_model_info";
      return;
    }
    previous_paths[i] = info->model_path;
    w.previous_version = info->weight_version;
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
  std::string previous_salt = salt_version_;
  if (ok) {
    // Every worker is paused: nothing computes until continue_generation, after the load. A
    // rollout that starts from now on waits for the new weights, so it must not reuse KV the
    // old ones computed: salt it with the new version before the load, not after the continue.
    // (Switching before the pause would let a rollout starting in between compute KV on the old
    // weights under the new salt.)
    salt_version_ = version;
    for (Pool* pool : {main_.get(), prefill_.get(), decode_.get()}) {
      pool->router.SetFleetVersion(version);
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
      load_unknown[i] = up.error != httplib::Error::Success;
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
      // Fail safe: the fleet stays on one version, the old one. A worker whose answer was lost
      // may have loaded: it goes back too (loading the weights it has is harmless).
      each([&](size_t i) {
        WorkerUpdate& w = report.workers[i];
        if (!w.loaded && !load_unknown[i]) {
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
          w.error += (w.error.empty() ? "" : "; ") + std::string("could not roll back");
          Quarantine(*targets[i].pool, targets[i].worker, "could not roll back to old weights",
                     false);
        }
      });
    }
  }
  // The version the workers in rotation must have from now on.
  bool moved = ok;
  std::string fleet = moved ? version : old_fleet;
  bool continued_all = true;
  each([&](size_t i) {
    WorkerUpdate& w = report.workers[i];
    if (!w.paused) {
      return;
    }
    Upstream up = Post(*targets[i].pool, targets[i].worker, "/continue_generation", "{}");
    w.continued = up.error == httplib::Error::Success && up.status == 200;
    if (!w.continued) {
      w.removed = true;
      w.error +=
          (w.error.empty() ? "" : "; ") +
          fmt::format("continue_generation failed: {} {}", httplib::to_string(up.error), up.status);
      // It may still be paused: the health loop continues it before it serves again.
      Quarantine(*targets[i].pool, targets[i].worker, "continue_generation failed", true);
    }
  });
  for (const WorkerUpdate& w : report.workers) {
    continued_all = continued_all && (w.continued || !w.paused);
  }
  report.success = ok && continued_all;
  if (!report.success) {
    // Whatever each call answered, ask every worker which weights it holds now; a worker not on
    // the fleet's version (or that does not say) leaves rotation until it is.
    each([&](size_t i) {
      WorkerUpdate& w = report.workers[i];
      std::optional<ModelInfo> info = GetModelInfo(*control_client(i));
      std::string expected = fleet.empty() ? w.previous_version : fleet;
      w.version_after = info ? info->weight_version : "";
      if (!info || info->weight_version != expected) {
        if (!w.removed) {
          w.removed = true;
          w.error +=
              (w.error.empty() ? "" : "; ") +
              (info ? fmt::format("holds weights {} instead of {}", info->weight_version, expected)
                    : std::string("cannot read its weights from /get_model_info"));
        }
        Quarantine(*targets[i].pool, targets[i].worker,
                   fmt::format("not on the fleet's weights {} after a failed update", expected),
                   false);
      }
    });
  }
  for (size_t i = 0; i < targets.size(); ++i) {
    Pool& pool = *targets[i].pool;
    std::lock_guard<std::mutex> lock(pool.mu);
    const WorkerUpdate& w = report.workers[i];
    pool.versions[targets[i].worker] =
        report.success ? version : (w.version_after.empty() ? "" : w.version_after);
  }
  if (!moved && salt_version_ != previous_salt) {
    // The fleet stays on the old weights: new rollouts go back to the old salt. The few that
    // started during the failed load keep the new salt on old weights; a later update should
    // use a new version name, so that none of its rollouts meets their KV.
    salt_version_ = previous_salt;
    for (Pool* pool : {main_.get(), prefill_.get(), decode_.get()}) {
      pool->router.SetFleetVersion(previous_salt);
    }
  }
  {
    std::lock_guard<std::mutex> lock(version_mu_);
    fleet_version_ = fleet;
  }
  if (report.success) {
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
      std::string labels =
          fmt::format("pool=\"{}\",worker=\"{}\"", pool->name, PrometheusLabelValue(s.url));
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
      versions_block += fmt::format("bragg_gateway_worker_weight_version{{{},version=\"{}\"}} 1\n",
                                    labels, PrometheusLabelValue(v));
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
                         pool->name, PrometheusLabelValue(reason), n);
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
  AsyncHttpServer& s = *server_;
  s.Route("POST", "/generate", [this](HttpRequest& req) { return HandleGenerate(req); });
  s.Route("POST", "/v1/chat/completions", [this](HttpRequest& req) { return HandleOpenAi(req); });
  s.Route("POST", "/v1/completions", [this](HttpRequest& req) { return HandleOpenAi(req); });
  s.Route("GET", "/health", [](HttpRequest&) {
    HttpResponse r;
    r.content_type = "text/plain";
    return Action::Respond(std::move(r));
  });
  s.Route("GET", "/metrics", [this](HttpRequest&) {
    HttpResponse r;
    r.content_type = "text/plain; version=0.0.4";
    r.body = Metrics();
    return Action::Respond(std::move(r));
  });
  s.Route("GET", "/workers", [this](HttpRequest&) {
    json out = json::array();
    for (Pool* pool : {main_.get(), prefill_.get(), decode_.get()}) {
      for (const WorkerSnapshot& w : pool->router.Snapshot()) {
        out.push_back({{"pool", pool->name},
                       {"url", w.url},
                       {"healthy", w.healthy},
                       {"in_flight", w.in_flight},
                       {"rollouts", w.rollouts},
                       {"requests", w.requests}});
      }
    }
    return Action::Respond(JsonResponse(out));
  });
  s.Route("POST", "/workers", [this](HttpRequest& req) {
    json body = json::parse(req.body, nullptr, false);
    if (!body.is_object() || !body.contains("url") || !body["url"].is_string()) {
      return Action::Respond(ErrorResponse(400, "body must be {\"url\": \"http://HOST:PORT\"}"));
    }
    // Out of rotation until the health loop checked its weight version.
    Status st = AddWorker(*main_, body["url"].get<std::string>(), false);
    if (!st.ok()) {
      return Action::Respond(ErrorResponse(400, std::string(st.message())));
    }
    return Action::Respond(JsonResponse({{"success", true}}));
  });
  s.Route("POST", "/weights/update", [this](HttpRequest& req) {
    json body = json::parse(req.body, nullptr, false);
    if (!body.is_object() || !body.contains("model_path") || !body["model_path"].is_string() ||
        !body.contains("weight_version") || !body["weight_version"].is_string() ||
        body["weight_version"].get<std::string>().empty()) {
      return Action::Respond(ErrorResponse(
          400, "body must be {\"model_path\": \"...\", \"weight_version\": \"<non-empty>\"}"));
    }
    // Pauses, loads and continues the fleet with blocking calls: off the io threads.
    return Action::Blocking([this, path = body["model_path"].get<std::string>(),
                             version = body["weight_version"].get<std::string>()] {
      WeightUpdateReport report = UpdateWeights(path, version);
      return JsonResponse(report.ToJson(), report.success ? 200 : 500);
    });
  });
  s.Route("POST", "/rollouts/forget", [this](HttpRequest& req) {
    json body = json::parse(req.body, nullptr, false);
    if (!body.is_object() || !body.contains("routing_key") || !body["routing_key"].is_string()) {
      return Action::Respond(ErrorResponse(400, "body must be {\"routing_key\": \"...\"}"));
    }
    std::string key = body["routing_key"].get<std::string>();
    for (Pool* pool : {main_.get(), prefill_.get(), decode_.get()}) {
      pool->router.Forget(key);
    }
    return Action::Respond(JsonResponse({{"success", true}}));
  });
}

}  // namespace bragg::gateway
