#include "gateway/request.h"

#include <fmt/format.h>

#include <utility>

#include "gateway/router.h"

namespace bragg::gateway {

using nlohmann::json;

namespace {

bool IsTrue(const json& body, const char* field) {
  return body.contains(field) && body[field].is_boolean() && body[field].get<bool>();
}

// /generate's prompt: input_ids (a list, or a list of lists for a batch) or text (a string, or a
// list of strings). A batch is routed by its first element.
Status ReadGenerateTokens(const json& body, Request* r) {
  if (body.contains("input_ids")) {
    const json& ids = body["input_ids"];
    if (!ids.is_array() || ids.empty()) {
      return absl::InvalidArgumentError("input_ids must be a non-empty array of token ids");
    }
    bool nested = ids[0].is_array();
    auto read = [&](const json& one, std::vector<int32_t>* out) {
      if (!one.is_array() || one.empty()) {
        return false;
      }
      for (const json& t : one) {
        if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX) {
          return false;
        }
        if (out != nullptr) {
          out->push_back(static_cast<int32_t>(t.get<int64_t>()));
        }
      }
      return true;
    };
    bool ok = true;
    if (nested) {
      r->batch = ids.size();
      r->tokens.reserve(ids[0].size());
      for (size_t i = 0; i < ids.size() && ok; ++i) {
        ok = read(ids[i], i == 0 ? &r->tokens : nullptr);
      }
    } else {
      r->tokens.reserve(ids.size());
      ok = read(ids, &r->tokens);
    }
    if (!ok) {
      return absl::InvalidArgumentError(
          "input_ids must hold non-negative 32-bit token ids (a list, or a non-empty list "
          "of non-empty lists for a batch)");
    }
  } else if (body.contains("text") && body["text"].is_string()) {
    for (unsigned char c : body["text"].get<std::string>()) {
      r->tokens.push_back(c);
    }
  } else if (body.contains("text") && body["text"].is_array() && !body["text"].empty()) {
    for (const json& t : body["text"]) {
      if (!t.is_string()) {
        return absl::InvalidArgumentError("text must be a string or a list of strings");
      }
    }
    r->batch = body["text"].size();
    for (unsigned char c : body["text"][0].get_ref<const std::string&>()) {
      r->tokens.push_back(c);
    }
  } else {
    return absl::InvalidArgumentError("request needs input_ids or text");
  }
  return absl::OkStatus();
}

Status ParseGenerate(json body, const HttpRequest& http, int dp_size,
                     const std::function<std::string()>& new_rid, Request* r) {
  BRAGG_RETURN_IF_ERROR(ReadGenerateTokens(body, r));
  BRAGG_ASSIGN_OR_RETURN(r->key,
                         RoutingKey(Endpoint::kGenerate, &body, http.Header("X-Session-Id")));
  if (body.contains("extra_key") && body["extra_key"].is_string()) {
    r->client_salt = body["extra_key"].get<std::string>();
  }
  if (!body.contains("rid")) {
    // As SGLang's router: every request gets an id, so that a hang-up can abort it by id; a
    // batch one per element.
    if (r->batch > 0) {
      json rids = json::array();
      for (size_t i = 0; i < r->batch; ++i) {
        rids.push_back(new_rid());
      }
      body["rid"] = std::move(rids);
    } else {
      body["rid"] = new_rid();
    }
  }
  if (std::optional<uint32_t> rank = RoutedDpRankToAdd(body, r->key, dp_size)) {
    body["routed_dp_rank"] = *rank;
  }
  r->stream = IsTrue(body, "stream");
  r->rid = body["rid"];
  r->body = std::move(body);
  r->path = "/generate";
  return absl::OkStatus();
}

Status ParseOpenAi(json body, HttpRequest& http, int dp_size,
                   const std::function<std::string()>& new_rid, Request* r) {
  BRAGG_ASSIGN_OR_RETURN(r->key, RoutingKey(Endpoint::kOpenAi, &body, http.Header("X-Session-Id")));
  // Route by the prompt bytes: the approximate tree only needs a stable prefix.
  std::string prompt =
      body.contains("messages") ? body["messages"].dump() : body.value("prompt", json()).dump();
  for (unsigned char c : prompt) {
    r->tokens.push_back(c);
  }
  r->stream = IsTrue(body, "stream");
  r->path = http.path;
  r->raw_body = std::move(http.body);
  if (body.contains("extra_key") && body["extra_key"].is_string()) {
    r->client_salt = body["extra_key"].get<std::string>();
  }
  // SGLang's OpenAI requests take rid, routed_dp_rank and extra_key as /generate does. Fields
  // the gateway adds are spliced in after the opening brace, so the rest of the client's body
  // goes through byte for byte.
  std::string fields;
  bool client_empty = body.empty();
  if (body.contains("rid")) {
    r->rid = body["rid"];
  } else {
    r->rid = new_rid();
    body["rid"] = r->rid;
    fields += "\"rid\":" + r->rid.dump() + ",";
  }
  if (std::optional<uint32_t> rank = RoutedDpRankToAdd(body, r->key, dp_size)) {
    body["routed_dp_rank"] = *rank;
    fields += fmt::format("\"routed_dp_rank\":{},", *rank);
  }
  if (!fields.empty()) {
    if (client_empty) {
      fields.pop_back();  // no member of the client's follows: no comma before its '}'
    }
    r->raw_body.insert(r->raw_body.find('{') + 1, fields);
  }
  r->body = std::move(body);
  return absl::OkStatus();
}

}  // namespace

Result<std::string> RoutingKey(Endpoint endpoint, json* body, std::string_view session_id) {
  std::string key;
  switch (endpoint) {
    case Endpoint::kGenerate:
      for (const char* field : {"routing_key", "rollout_id"}) {
        if (body->contains(field)) {
          if (!(*body)[field].is_string()) {
            return absl::InvalidArgumentError(fmt::format("{} must be a string", field));
          }
          key = (*body)[field].get<std::string>();
          body->erase(field);
        }
      }
      if (key.empty()) {
        key = session_id;
      }
      break;
    case Endpoint::kOpenAi:
      key = session_id;
      if (key.empty() && body->contains("user") && (*body)["user"].is_string()) {
        key = (*body)["user"].get<std::string>();
      }
      break;
  }
  return key;
}

uint32_t DpRank(std::string_view key, int dp_size) {
  return static_cast<uint32_t>(-SaltToken(key)) % static_cast<uint32_t>(dp_size);
}

std::optional<uint32_t> RoutedDpRankToAdd(const json& body, std::string_view key, int dp_size) {
  if (dp_size <= 1 || key.empty() || body.contains("routed_dp_rank")) {
    return std::nullopt;
  }
  // A rollout's KV lives on one DP rank: pin it there, spread rollouts by a stable hash.
  return DpRank(key, dp_size);
}

Result<Request> ParseRequest(Endpoint endpoint, HttpRequest& http, int dp_size,
                             const std::function<std::string()>& new_rid) {
  json body = json::parse(http.body, nullptr, false);
  if (body.is_discarded() || !body.is_object()) {
    return absl::InvalidArgumentError("request body must be a JSON object");
  }
  Request r;
  r.endpoint = endpoint;
  switch (endpoint) {
    case Endpoint::kGenerate:
      BRAGG_RETURN_IF_ERROR(ParseGenerate(std::move(body), http, dp_size, new_rid, &r));
      break;
    case Endpoint::kOpenAi:
      BRAGG_RETURN_IF_ERROR(ParseOpenAi(std::move(body), http, dp_size, new_rid, &r));
      break;
  }
  return r;
}

std::string BodyWithExtraKey(Request* request, std::string_view salt) {
  if (request->endpoint == Endpoint::kGenerate) {
    if (!salt.empty()) {
      request->body["extra_key"] = std::string(salt);
    }
    return request->body.dump();
  }
  if (salt.empty()) {
    return request->raw_body;
  }
  if (!request->body.contains("extra_key")) {
    // Spliced in after the opening brace, as the rid: the rest passes through byte for byte.
    std::string out = request->raw_body;
    out.insert(out.find('{') + 1, "\"extra_key\":" + json(std::string(salt)).dump() + ",");
    return out;
  }
  // The client's own extra_key is replaced by the combined one.
  json b = request->body;
  b["extra_key"] = std::string(salt);
  return b.dump();
}

}  // namespace bragg::gateway
