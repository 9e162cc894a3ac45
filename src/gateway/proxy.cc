#include "gateway/proxy.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>

namespace bragg::gateway {

using nlohmann::json;

namespace {

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

Proxy::Proxy(ProxyOptions options, Fleet* fleet, AsyncHttpServer* server)
    : options_(options), fleet_(fleet), server_(server), rng_(std::random_device{}()) {
  rid_instance_ = rng_();
}

// The prefill half of a prefill/decode pair. The decode half runs as the client's exchange; the
// prefill half as a side call whose end may come before or after it.
struct Proxy::PdPrefill {
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
struct Proxy::Generate : Request {
  explicit Generate(Request r) : Request(std::move(r)) {}
  size_t attempts = 0;
  size_t max_attempts = 1;
  std::shared_ptr<PdPrefill> prefill;  // set for a prefill/decode pair
};

Action Proxy::Serve(Request request) {
  auto g = std::make_shared<Generate>(std::move(request));
  if (options_.disaggregated) {
    if (g->batch > 0) {
      // Each element would need its own bootstrap_room on both halves.
      return Action::Respond(ErrorResponse(
          400,
          "batch requests are not supported with prefill/decode disaggregation: send one "
          "request per prompt"));
    }
    g->max_attempts = std::max<size_t>(1, fleet_->decode().router().num_workers());
    return StartPd(std::move(g));
  }
  g->max_attempts = std::max<size_t>(1, fleet_->main().router().num_workers());
  return RouteAndForward(std::move(g));
}

std::string Proxy::NewRid() {
  return fmt::format("gw-{:016x}-{}", rid_instance_, rid_counter_.fetch_add(1));
}

Action Proxy::RouteAndForward(std::shared_ptr<Generate> g) {
  Pool& pool = g->prefill ? fleet_->decode() : fleet_->main();
  if (g->attempts++ >= g->max_attempts) {
    return Action::Respond(ErrorResponse(503, "no worker accepted the request"));
  }
  Result<RouteDecision> d = pool.router().Route(g->key, g->tokens, g->client_salt);
  if (!d.ok()) {
    return Action::Respond(ErrorResponse(503, std::string(d.status().message())));
  }
  return ForwardTo(std::move(g), *d);
}

Action Proxy::StartPd(std::shared_ptr<Generate> g) {
  Result<RouteDecision> p = fleet_->prefill().router().Route(g->key, g->tokens, g->client_salt);
  if (!p.ok()) {
    return Action::Respond(
        ErrorResponse(503, "prefill pool: " + std::string(p.status().message())));
  }
  g->attempts++;
  Result<RouteDecision> d = fleet_->decode().router().Route(g->key, g->tokens, g->client_salt);
  if (!d.ok()) {
    fleet_->prefill().router().Finish(p->worker, 0, 0);
    return Action::Respond(ErrorResponse(503, "decode pool: " + std::string(d.status().message())));
  }
  auto pre = std::make_shared<PdPrefill>();
  pre->worker = p->worker;
  pre->target = fleet_->prefill().Client(p->worker)->target();
  // Known before the prefill half leaves: if it fails at once, its decode half is aborted.
  pre->decode_target = fleet_->decode().Client(d->worker)->target();
  uint64_t room;
  {
    std::lock_guard<std::mutex> lock(rng_mu_);
    room = rng_() & ((uint64_t{1} << 63) - 1);
  }
  g->body["bootstrap_host"] = pre->target.host;
  int own_port = fleet_->prefill().bootstrap_port(p->worker);
  g->body["bootstrap_port"] = own_port >= 0 ? own_port : options_.bootstrap_port;
  g->body["bootstrap_room"] = room;
  g->prefill = pre;
  // Both halves at once: the decode worker waits for the KV the prefill worker computes.
  server_->Call(
      pre->target, "/generate", BodyWithExtraKey(g.get(), d->salt), [this, g](CallResult& r) {
        PdPrefill& pre = *g->prefill;
        uint64_t prompt = 0;
        uint64_t cached = 0;
        if (r.ok) {
          ReadUsage(g->stream ? LastSseJson(r.body) : r.body, &prompt, &cached);
          fleet_->prefill().RecordAnswer(pre.worker, r.status);
        }
        fleet_->prefill().router().Finish(pre.worker, prompt, cached);
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

void Proxy::AbortUpstream(const Generate& g, const HostPort& target) {
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

Action Proxy::ForwardTo(std::shared_ptr<Generate> g, const RouteDecision& d) {
  Pool& pool = g->prefill ? fleet_->decode() : fleet_->main();
  Forward f;
  f.body = BodyWithExtraKey(g.get(), d.salt);
  f.upstream = pool.Client(d.worker)->target();
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
    Pool& pool = g->prefill ? fleet_->decode() : fleet_->main();
    using Outcome = UpstreamResult::Outcome;
    switch (r.outcome) {
      case Outcome::kConnectFailed: {
        pool.router().Finish(worker, 0, 0);
        Action next;
        if (r.local) {
          upstream_errors_++;
          next = Action::Respond(
              ErrorResponse(503, fmt::format("gateway overloaded: {}; retry later", r.error)));
        } else {
          // Nothing reached the worker, so moving the request is safe.
          pool.MarkDown(worker, r.error);
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
        pool.router().Finish(worker, 0, 0);
        AbortUpstream(*g, target);
        return Action::None();
      case Outcome::kFailed: {
        pool.router().Finish(worker, 0, 0);
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
        pool.RecordAnswer(worker, r.status);
        pool.router().Finish(worker, prompt, cached);
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

}  // namespace bragg::gateway
