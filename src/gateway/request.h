#pragma once

// An incoming request the gateway routes to a worker (/generate and the OpenAI-compatible
// endpoints): what it is, which rollout it belongs to (the routing key), the tokens it is routed
// by, its DP rank, and the body each worker gets with the cache salt (extra_key) added. Pure
// logic, no I/O.

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "gateway/async_http.h"

namespace bragg::gateway {

enum class Endpoint {
  kGenerate,  // POST /generate: SGLang's native API; the body is JSON-parsed and re-serialized
  kOpenAi,    // POST /v1/chat/completions, /v1/completions: passed through byte for byte
};

// A request parsed for routing. Plain data; not thread-safe.
struct Request {
  Endpoint endpoint = Endpoint::kGenerate;
  // /generate: the body sent to the workers (routing_key/rollout_id removed, rid added).
  // OpenAI: the parsed client body with the added fields, read for extra_key only.
  nlohmann::json body;
  std::string key;              // routing key (rollout); empty: not part of a rollout
  std::vector<int32_t> tokens;  // routed by: token ids, or the prompt's bytes
  std::string client_salt;      // the client's own extra_key, empty for none
  std::string path;             // upstream path
  std::string raw_body;         // OpenAI: the client's bytes with the added fields spliced in
  // The request id the workers know the request by (SGLang's `rid`), for /abort_request: the
  // client's, or one the gateway added (a list of ids for a /generate batch).
  nlohmann::json rid;
  bool stream = false;
  size_t batch = 0;  // /generate: elements of a batch request, 0 for a single prompt
};

// The routing key of a request, the one rule for every endpoint:
// - kGenerate: body field `routing_key`, then `rollout_id` (the later one present wins), both
//   removed from `*body`; when that leaves it empty, header X-Session-Id (`session_id`).
//   InvalidArgument when either field is present and not a string.
// - kOpenAi: header X-Session-Id, then body field `user` when it is a string; `*body` unchanged.
Result<std::string> RoutingKey(Endpoint endpoint, nlohmann::json* body,
                               std::string_view session_id);

// The data-parallel rank every request of rollout `key` goes to: a stable hash of the key mod
// `dp_size` (> 0).
uint32_t DpRank(std::string_view key, int dp_size);

// The routed_dp_rank the gateway adds to `body`: DpRank(key, dp_size), or nullopt when
// `dp_size` <= 1, the request has no routing key, or the client set its own routed_dp_rank.
std::optional<uint32_t> RoutedDpRankToAdd(const nlohmann::json& body, std::string_view key,
                                          int dp_size);

// Parses `http` (whose body is moved from) as a request to `endpoint`: JSON object body, tokens,
// routing key, the client's extra_key, a rid from `new_rid` when the client sent none (one per
// element of a /generate batch), and routed_dp_rank (RoutedDpRankToAdd). For kOpenAi the added
// fields are spliced in after the opening brace of the client's bytes. InvalidArgument, with the
// message the client gets in a 400, for a malformed request.
Result<Request> ParseRequest(Endpoint endpoint, HttpRequest& http, int dp_size,
                             const std::function<std::string()>& new_rid);

// The body to send to a worker: `*request`'s with cache salt `salt` as its extra_key (none when
// `salt` is empty). The one place extra_key is added. kGenerate: set in request->body (so that
// later fields and both halves of a prefill/decode pair carry it) and serialized. kOpenAi:
// spliced in after the opening brace of raw_body, or, when the client sent its own extra_key,
// the body re-serialized with `salt` in its place.
std::string BodyWithExtraKey(Request* request, std::string_view salt);

}  // namespace bragg::gateway
