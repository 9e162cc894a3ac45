#include "gateway/request.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

#include "gateway/router.h"

namespace bragg::gateway {
namespace {

using nlohmann::json;

HttpRequest Http(std::string path, std::string body, std::string session_id = "") {
  HttpRequest h;
  h.method = "POST";
  h.path = std::move(path);
  h.body = std::move(body);
  if (!session_id.empty()) {
    h.headers.emplace_back("X-Session-Id", std::move(session_id));
  }
  return h;
}

// Rids "r0", "r1", ... in the order asked for.
struct Rids {
  int next = 0;
  std::function<std::string()> fn() {
    return [this] { return "r" + std::to_string(next++); };
  }
};

Result<Request> Parse(Endpoint endpoint, std::string path, std::string body,
                      std::string session_id = "", int dp_size = 1) {
  HttpRequest h = Http(std::move(path), std::move(body), std::move(session_id));
  Rids rids;
  return ParseRequest(endpoint, h, dp_size, rids.fn());
}

// --- RoutingKey: the one rule, per endpoint --------------------------------------------------

TEST(RoutingKeyTest, GenerateReadsRoutingKeyAndRemovesIt) {
  json body = {{"routing_key", "a"}, {"input_ids", {1}}};
  Result<std::string> key = RoutingKey(Endpoint::kGenerate, &body, "header");
  ASSERT_TRUE(key.ok());
  EXPECT_EQ(*key, "a");
  EXPECT_FALSE(body.contains("routing_key"));
  EXPECT_TRUE(body.contains("input_ids"));
}

TEST(RoutingKeyTest, GenerateReadsRolloutId) {
  json body = {{"rollout_id", "b"}};
  Result<std::string> key = RoutingKey(Endpoint::kGenerate, &body, "");
  ASSERT_TRUE(key.ok());
  EXPECT_EQ(*key, "b");
  EXPECT_FALSE(body.contains("rollout_id"));
}

TEST(RoutingKeyTest, GenerateRolloutIdWinsOverRoutingKeyBothRemoved) {
  json body = {{"routing_key", "a"}, {"rollout_id", "b"}};
  Result<std::string> key = RoutingKey(Endpoint::kGenerate, &body, "header");
  ASSERT_TRUE(key.ok());
  EXPECT_EQ(*key, "b");
  EXPECT_FALSE(body.contains("routing_key"));
  EXPECT_FALSE(body.contains("rollout_id"));
}

TEST(RoutingKeyTest, GenerateFallsBackToSessionHeader) {
  json body = json::object();
  Result<std::string> key = RoutingKey(Endpoint::kGenerate, &body, "header");
  ASSERT_TRUE(key.ok());
  EXPECT_EQ(*key, "header");
  json empty_field = {{"routing_key", ""}};
  key = RoutingKey(Endpoint::kGenerate, &empty_field, "header");
  ASSERT_TRUE(key.ok());
  EXPECT_EQ(*key, "header");
}

TEST(RoutingKeyTest, GenerateIgnoresUser) {
  json body = {{"user", "u"}};
  Result<std::string> key = RoutingKey(Endpoint::kGenerate, &body, "");
  ASSERT_TRUE(key.ok());
  EXPECT_EQ(*key, "");
  EXPECT_TRUE(body.contains("user"));
}

TEST(RoutingKeyTest, GenerateRefusesNonStringKeys) {
  for (const char* field : {"routing_key", "rollout_id"}) {
    json body = {{field, 7}};
    Result<std::string> key = RoutingKey(Endpoint::kGenerate, &body, "header");
    ASSERT_FALSE(key.ok()) << field;
    EXPECT_EQ(key.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(key.status().message(), std::string(field) + " must be a string");
  }
}

TEST(RoutingKeyTest, OpenAiSessionHeaderWinsOverUser) {
  json body = {{"user", "u"}};
  Result<std::string> key = RoutingKey(Endpoint::kOpenAi, &body, "header");
  ASSERT_TRUE(key.ok());
  EXPECT_EQ(*key, "header");
  EXPECT_TRUE(body.contains("user"));
}

TEST(RoutingKeyTest, OpenAiFallsBackToUserAndIgnoresRoutingFields) {
  json body = {{"user", "u"}, {"routing_key", "a"}, {"rollout_id", "b"}};
  Result<std::string> key = RoutingKey(Endpoint::kOpenAi, &body, "");
  ASSERT_TRUE(key.ok());
  EXPECT_EQ(*key, "u");
  // The OpenAI body passes through: nothing is removed.
  EXPECT_TRUE(body.contains("routing_key"));
  EXPECT_TRUE(body.contains("rollout_id"));
}

TEST(RoutingKeyTest, OpenAiNonStringUserIsNoKey) {
  json body = {{"user", 5}};
  Result<std::string> key = RoutingKey(Endpoint::kOpenAi, &body, "");
  ASSERT_TRUE(key.ok());
  EXPECT_EQ(*key, "");
}

// --- DP rank ---------------------------------------------------------------------------------

TEST(DpRankTest, StableHashModSize) {
  std::set<uint32_t> seen;
  for (int i = 0; i < 200; ++i) {
    std::string key = "rollout-" + std::to_string(i);
    uint32_t rank = DpRank(key, 4);
    EXPECT_LT(rank, 4u);
    EXPECT_EQ(rank, DpRank(key, 4));
    EXPECT_EQ(rank, static_cast<uint32_t>(-SaltToken(key)) % 4u);
    seen.insert(rank);
  }
  EXPECT_EQ(seen.size(), 4u);  // rollouts spread over the ranks
}

TEST(DpRankTest, AddedOnlyWithSizeKeyAndNoClientRank) {
  json body = json::object();
  EXPECT_EQ(RoutedDpRankToAdd(body, "k", 4), DpRank("k", 4));
  EXPECT_EQ(RoutedDpRankToAdd(body, "k", 1), std::nullopt);
  EXPECT_EQ(RoutedDpRankToAdd(body, "k", 0), std::nullopt);
  EXPECT_EQ(RoutedDpRankToAdd(body, "", 4), std::nullopt);
  json client = {{"routed_dp_rank", 3}};
  EXPECT_EQ(RoutedDpRankToAdd(client, "k", 4), std::nullopt);
}

TEST(DpRankTest, SameRankOnEveryEndpoint) {
  Result<Request> g =
      Parse(Endpoint::kGenerate, "/generate", R"({"input_ids":[1,2],"routing_key":"k"})", "", 8);
  Result<Request> o = Parse(Endpoint::kOpenAi, "/v1/completions", R"({"prompt":"x"})", "k", 8);
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(g->body["routed_dp_rank"], DpRank("k", 8));
  EXPECT_EQ(o->body["routed_dp_rank"], DpRank("k", 8));
  json raw = json::parse(o->raw_body);
  EXPECT_EQ(raw["routed_dp_rank"], DpRank("k", 8));
}

// --- ParseRequest ----------------------------------------------------------------------------

TEST(ParseRequestTest, GenerateSingle) {
  Result<Request> r = Parse(Endpoint::kGenerate, "/generate",
                            R"({"input_ids":[5,6,7],"rollout_id":"ro","stream":true,
                                "extra_key":"mine","sampling_params":{"max_new_tokens":3}})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->endpoint, Endpoint::kGenerate);
  EXPECT_EQ(r->key, "ro");
  EXPECT_EQ(r->tokens, (std::vector<int32_t>{5, 6, 7}));
  EXPECT_EQ(r->client_salt, "mine");
  EXPECT_TRUE(r->stream);
  EXPECT_EQ(r->path, "/generate");
  EXPECT_EQ(r->batch, 0u);
  EXPECT_EQ(r->rid, "r0");
  EXPECT_EQ(r->body["rid"], "r0");
  EXPECT_FALSE(r->body.contains("rollout_id"));
  EXPECT_FALSE(r->body.contains("routed_dp_rank"));  // dp_size 1
  EXPECT_EQ(r->body["sampling_params"]["max_new_tokens"], 3);
}

TEST(ParseRequestTest, GenerateKeepsClientRid) {
  Result<Request> r = Parse(Endpoint::kGenerate, "/generate", R"({"text":"ab","rid":"c1"})");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->rid, "c1");
  EXPECT_EQ(r->tokens, (std::vector<int32_t>{'a', 'b'}));
}

TEST(ParseRequestTest, GenerateBatchGetsOneRidPerElementAndRoutesByFirst) {
  Result<Request> r =
      Parse(Endpoint::kGenerate, "/generate", R"({"input_ids":[[1,2],[3],[4,5,6]]})");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->batch, 3u);
  EXPECT_EQ(r->tokens, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(r->rid, json({"r0", "r1", "r2"}));
  Result<Request> t = Parse(Endpoint::kGenerate, "/generate", R"({"text":["xy","z"]})");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->batch, 2u);
  EXPECT_EQ(t->tokens, (std::vector<int32_t>{'x', 'y'}));
}

TEST(ParseRequestTest, GenerateSessionHeader) {
  Result<Request> r = Parse(Endpoint::kGenerate, "/generate", R"({"input_ids":[1]})", "sess");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->key, "sess");
}

TEST(ParseRequestTest, HostileBodies) {
  struct Case {
    Endpoint endpoint;
    std::string body;
    std::string message;
  };
  const Case cases[] = {
      {Endpoint::kGenerate, "not json", "request body must be a JSON object"},
      {Endpoint::kGenerate, "[1,2]", "request body must be a JSON object"},
      {Endpoint::kOpenAi, "{\"a\":", "request body must be a JSON object"},
      {Endpoint::kOpenAi, "\"s\"", "request body must be a JSON object"},
      {Endpoint::kGenerate, "{}", "request needs input_ids or text"},
      {Endpoint::kGenerate, R"({"input_ids":[]})",
       "input_ids must be a non-empty array of token ids"},
      {Endpoint::kGenerate, R"({"input_ids":[1,-2]})",
       "input_ids must hold non-negative 32-bit token ids (a list, or a non-empty list of "
       "non-empty lists for a batch)"},
      {Endpoint::kGenerate, R"({"input_ids":[4294967296]})",
       "input_ids must hold non-negative 32-bit token ids (a list, or a non-empty list of "
       "non-empty lists for a batch)"},
      {Endpoint::kGenerate, R"({"input_ids":[[1],[]]})",
       "input_ids must hold non-negative 32-bit token ids (a list, or a non-empty list of "
       "non-empty lists for a batch)"},
      {Endpoint::kGenerate, R"({"input_ids":[1.5]})",
       "input_ids must hold non-negative 32-bit token ids (a list, or a non-empty list of "
       "non-empty lists for a batch)"},
      {Endpoint::kGenerate, R"({"text":["a",1]})", "text must be a string or a list of strings"},
      {Endpoint::kGenerate, R"({"text":5})", "request needs input_ids or text"},
      {Endpoint::kGenerate, R"({"input_ids":[1],"routing_key":["x"]})",
       "routing_key must be a string"},
  };
  for (const Case& c : cases) {
    Result<Request> r = Parse(c.endpoint, "/x", c.body);
    ASSERT_FALSE(r.ok()) << c.body;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.body;
    EXPECT_EQ(r.status().message(), c.message) << c.body;
  }
}

TEST(ParseRequestTest, OpenAiSplicesRidAndKeepsTheRestByteForByte) {
  std::string client = R"({ "messages" : [{"role":"user","content":"hi"}],  "user":"u" })";
  Result<Request> r = Parse(Endpoint::kOpenAi, "/v1/chat/completions", client, "", 4);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->endpoint, Endpoint::kOpenAi);
  EXPECT_EQ(r->path, "/v1/chat/completions");
  EXPECT_EQ(r->key, "u");
  EXPECT_EQ(r->rid, "r0");
  std::string fields = "\"rid\":\"r0\",\"routed_dp_rank\":" + std::to_string(DpRank("u", 4)) + ",";
  EXPECT_EQ(r->raw_body, "{" + fields + client.substr(1));
  std::string prompt = json::parse(client)["messages"].dump();
  EXPECT_EQ(r->tokens, std::vector<int32_t>(prompt.begin(), prompt.end()));
}

TEST(ParseRequestTest, OpenAiEmptyObjectStaysValidJson) {
  Result<Request> r = Parse(Endpoint::kOpenAi, "/v1/completions", "{}");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->raw_body, R"({"rid":"r0"})");
  EXPECT_EQ(r->tokens, (std::vector<int32_t>{'n', 'u', 'l', 'l'}));
}

TEST(ParseRequestTest, OpenAiClientRidAndRankPassUntouched) {
  std::string client = R"({"prompt":"p","rid":"mine","routed_dp_rank":1,"stream":true})";
  Result<Request> r = Parse(Endpoint::kOpenAi, "/v1/completions", client, "k", 4);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->raw_body, client);
  EXPECT_EQ(r->rid, "mine");
  EXPECT_TRUE(r->stream);
}

// --- BodyWithExtraKey: the one place extra_key is added --------------------------------------

TEST(ExtraKeyTest, GenerateSetsItInTheBody) {
  Result<Request> r = Parse(Endpoint::kGenerate, "/generate", R"({"input_ids":[1]})");
  ASSERT_TRUE(r.ok());
  json none = json::parse(BodyWithExtraKey(&*r, ""));
  EXPECT_FALSE(none.contains("extra_key"));
  json salted = json::parse(BodyWithExtraKey(&*r, "wv:2"));
  EXPECT_EQ(salted["extra_key"], "wv:2");
  EXPECT_EQ(r->body["extra_key"], "wv:2");  // kept for the other half of a pair
}

TEST(ExtraKeyTest, GenerateReplacesTheClientsOwn) {
  Result<Request> r =
      Parse(Endpoint::kGenerate, "/generate", R"({"input_ids":[1],"extra_key":"mine"})");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(json::parse(BodyWithExtraKey(&*r, "mine|wv:2"))["extra_key"], "mine|wv:2");
}

TEST(ExtraKeyTest, OpenAiSplicedOrReserialized) {
  std::string client = R"({"prompt":"p","rid":"x"})";
  Result<Request> r = Parse(Endpoint::kOpenAi, "/v1/completions", client);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(BodyWithExtraKey(&*r, ""), client);
  EXPECT_EQ(BodyWithExtraKey(&*r, "wv:\"2"), R"({"extra_key":"wv:\"2","prompt":"p","rid":"x"})");
  EXPECT_EQ(r->raw_body, client);  // the salt is per attempt, not stored

  Result<Request> own =
      Parse(Endpoint::kOpenAi, "/v1/completions", R"({"prompt":"p","rid":"x","extra_key":"m"})");
  ASSERT_TRUE(own.ok());
  json b = json::parse(BodyWithExtraKey(&*own, "m|wv:2"));
  EXPECT_EQ(b["extra_key"], "m|wv:2");
  EXPECT_EQ(b["prompt"], "p");
  EXPECT_EQ(b["rid"], "x");
}

}  // namespace
}  // namespace bragg::gateway
