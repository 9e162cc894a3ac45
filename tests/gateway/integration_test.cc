// Drives bragg-gateway and bragg-sim-worker binaries over real HTTP on loopback.

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "common/fs.h"
#include "common/process.h"
#include "common/unique_fd.h"
#include "gateway/client.h"
#include "gateway/http_util.h"
#include "gateway_test_util.h"

namespace bragg::gateway {
namespace {

using nlohmann::json;

class GatewayIntegrationTest : public GatewayTest {};

std::vector<int32_t> Tokens(int seed, int n, int base = 0) {
  std::vector<int32_t> v;
  for (int i = 0; i < n; ++i) {
    v.push_back(base + (seed * 131 + i * 7) % 30000);
  }
  return v;
}

std::vector<int32_t> SharedPrompt(int n) { return Tokens(99999, n, 1); }

// Runs `turns` turns of rollout `key`: each turn's prompt is the conversation so far plus a tool
// output. Returns the worker per turn; checks every turn reuses the whole previous conversation
// when `expect_full_reuse`.
std::vector<std::string> RunRollout(httplib::Client& c, const std::string& key, int turns,
                                    std::vector<int32_t> convo, bool expect_full_reuse) {
  std::vector<std::string> where;
  size_t prev_total = 0;
  for (int t = 0; t < turns; ++t) {
    json req = {{"input_ids", convo},
                {"routing_key", key},
                {"sampling_params", {{"max_new_tokens", 8}, {"temperature", 0.7}}}};
    int status = 0;
    std::string worker;
    json res = PostJson(c, "/generate", req, &status, &worker);
    EXPECT_EQ(status, 200) << res.dump();
    if (status != 200) {
      return where;
    }
    const json& m = res["meta_info"];
    EXPECT_EQ(m["prompt_tokens"].get<size_t>(), convo.size());
    EXPECT_EQ(m["completion_tokens"].get<size_t>(), 8u);
    EXPECT_TRUE(m.contains("weight_version"));
    if (expect_full_reuse && t > 0) {
      EXPECT_EQ(m["cached_tokens"].get<size_t>(), prev_total) << key << " turn " << t;
    }
    where.push_back(worker);
    for (int32_t id : res["output_ids"].get<std::vector<int32_t>>()) {
      convo.push_back(id);
    }
    prev_total = convo.size();
    auto tool = Tokens(t + static_cast<int>(key.size()) * 17, 5 + t * 3, 40000);
    convo.insert(convo.end(), tool.begin(), tool.end());
  }
  return where;
}

std::string Metrics(httplib::Client& c) {
  auto r = c.Get("/metrics");
  return r ? r->body : "";
}

TEST_F(GatewayIntegrationTest, EveryPolicyServesRollouts) {
  Proc w0 = Worker(), w1 = Worker(), w2 = Worker();
  for (const std::string policy : {"sticky", "cache_aware", "round_robin", "least_load"}) {
    SCOPED_TRACE(policy);
    Proc gw = Gateway({&w0, &w1, &w2}, policy);
    auto c = Http(gw);
    std::set<std::string> used;
    for (int k = 0; k < 6; ++k) {
      std::string key = policy + "-r" + std::to_string(k);
      bool sticky_like = policy == "sticky" || policy == "cache_aware";
      auto where = RunRollout(*c, key, 4, Tokens(k, 64), sticky_like);
      ASSERT_EQ(where.size(), 4u);
      used.insert(where.begin(), where.end());
      if (sticky_like) {
        EXPECT_EQ(std::set<std::string>(where.begin(), where.end()).size(), 1u)
            << "rollout moved between turns";
      }
      if (policy == "round_robin") {
        EXPECT_NE(where[0], where[1]);
      }
    }
    if (policy != "least_load") {
      EXPECT_EQ(used.size(), 3u) << "all workers should get rollouts";
    }
    std::string m = Metrics(*c);
    EXPECT_NE(m.find("bragg_gateway_cache_hit_rate"), std::string::npos);
    EXPECT_NE(m.find("bragg_gateway_worker_in_flight{pool=\"main\""), std::string::npos);
    if (policy == "sticky") {
      EXPECT_NE(m.find("reason=\"sticky\"} 18"), std::string::npos) << m;
    } else if (policy == "round_robin") {
      EXPECT_NE(m.find("reason=\"round_robin\"} 24"), std::string::npos) << m;
    }
  }
}

TEST_F(GatewayIntegrationTest, SharedSystemPromptSpreadsOverWorkers) {
  Proc w0 = Worker(), w1 = Worker(), w2 = Worker(), w3 = Worker();
  Proc gw = Gateway({&w0, &w1, &w2, &w3}, "sticky");
  auto c = Http(gw);
  std::map<std::string, int> per_worker;
  std::vector<int32_t> shared = SharedPrompt(2000);
  for (int k = 0; k < 40; ++k) {
    std::vector<int32_t> prompt = shared;
    auto own = Tokens(k, 20, 50000);
    prompt.insert(prompt.end(), own.begin(), own.end());
    auto where = RunRollout(*c, "shared-" + std::to_string(k), 2, prompt, true);
    ASSERT_EQ(where.size(), 2u);
    per_worker[where[0]]++;
  }
  ASSERT_EQ(per_worker.size(), 4u);
  int mx = 0, mn = 1 << 30;
  for (auto& [w, n] : per_worker) {
    mx = std::max(mx, n);
    mn = std::min(mn, n);
  }
  EXPECT_LE(static_cast<double>(mx) / mn, 1.5);
}

TEST_F(GatewayIntegrationTest, KilledWorkerRolloutsMoveOnceNoRequestLost) {
  Proc w0 = Worker(), w1 = Worker(), w2 = Worker();
  Proc gw = Gateway({&w0, &w1, &w2}, "sticky");
  auto c = Http(gw);
  std::map<std::string, std::vector<int32_t>> convo;
  std::map<std::string, std::string> home;
  auto turn = [&](const std::string& key) {
    int status = 0;
    std::string worker;
    json res = PostJson(*c, "/generate",
                        {{"input_ids", convo[key]},
                         {"routing_key", key},
                         {"sampling_params", {{"max_new_tokens", 4}}}},
                        &status, &worker);
    EXPECT_EQ(status, 200) << res.dump();
    for (int32_t id : res.value("output_ids", std::vector<int32_t>{})) {
      convo[key].push_back(id);
    }
    convo[key].push_back(7);
    return worker;
  };
  for (int k = 0; k < 12; ++k) {
    std::string key = "kill-" + std::to_string(k);
    convo[key] = Tokens(k, 100);
    home[key] = turn(key);
  }
  std::string victim = fmt::format("127.0.0.1:{}", w1.port);
  int on_victim = 0;
  for (auto& [k, w] : home) {
    on_victim += w == victim;
  }
  ASSERT_GT(on_victim, 0);
  ASSERT_TRUE(w1.child.Signal(SIGKILL).ok());
  ASSERT_TRUE(w1.child.Wait(std::chrono::seconds(5)).ok());
  std::map<std::string, std::string> after;
  for (int round = 0; round < 3; ++round) {
    for (auto& [key, w] : home) {
      std::string now = turn(key);
      EXPECT_NE(now, victim);
      if (w != victim) {
        EXPECT_EQ(now, w) << key << " moved although its worker lives";
      } else if (round == 0) {
        after[key] = now;
      } else {
        EXPECT_EQ(now, after[key]) << key << " moved twice";
      }
    }
  }
  std::string m = Metrics(*c);
  EXPECT_NE(m.find(fmt::format("bragg_gateway_worker_rollouts_moved_total{{pool=\"main\",worker="
                               "\"http://{}\"}} {}",
                               victim, on_victim)),
            std::string::npos)
      << m;
  EXPECT_NE(m.find(fmt::format(
                "bragg_gateway_worker_healthy{{pool=\"main\",worker=\"http://{}\"}} 0", victim)),
            std::string::npos);
}

TEST_F(GatewayIntegrationTest, HealthChecksTakeOutAndBringBackAWorker) {
  Proc w0 = Worker(), w1 = Worker();
  Proc gw = Gateway({&w0, &w1}, "round_robin", {"--health-failures", "3"});
  auto c = Http(gw);
  auto healthy = [&](const Proc& w) {
    for (const json& x : WorkerList(*c)) {
      if (x["url"] == w.url) {
        return x["healthy"].get<bool>();
      }
    }
    return false;
  };
  auto wait_for = [&](const Proc& w, bool want) {
    for (int i = 0; i < 800; ++i) {
      if (healthy(w) == want) {
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    return false;
  };
  ASSERT_TRUE(Http(w1)->Post("/sim/config", R"({"healthy": false})", "application/json"));
  ASSERT_TRUE(wait_for(w1, false)) << "a worker failing its health checks stayed in rotation";
  for (int k = 0; k < 4; ++k) {
    int status = 0;
    std::string worker;
    PostJson(*c, "/generate", {{"input_ids", {1, 2, 3}}}, &status, &worker);
    EXPECT_EQ(status, 200);
    EXPECT_EQ(worker, fmt::format("127.0.0.1:{}", w0.port));
  }
  // Below the threshold a failing worker stays in rotation: one slow or failed answer from a
  // loaded worker must not move its rollouts.
  Proc patient = Gateway({&w1}, "sticky", {"--health-failures", "1000"});
  std::string log = fmt::format("{}/out-{}", dir_.path(), counter_ - 1);
  bool seen = false;
  for (int i = 0; i < 800 && !seen; ++i) {
    auto text = ReadFileToString(log);
    seen = text.ok() && text->find("failed health check 3 of 1000") != std::string::npos;
    if (!seen) {
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
  }
  ASSERT_TRUE(seen) << "the patient gateway never checked the failing worker";
  json listed = WorkerList(*Http(patient));
  ASSERT_FALSE(listed.empty());
  EXPECT_TRUE(listed[0]["healthy"].get<bool>()) << listed;
  ASSERT_TRUE(Http(w1)->Post("/sim/config", R"({"healthy": true})", "application/json"));
  EXPECT_TRUE(wait_for(w1, true)) << "a recovered worker was not brought back";
  // Bad thresholds are refused at startup.
  auto bad = Spawn({BRAGG_GATEWAY, "--listen", "127.0.0.1:0", "--health-failures", "0"});
  ASSERT_TRUE(bad.ok());
  auto exit = bad->Wait(std::chrono::seconds(10));
  ASSERT_TRUE(exit.ok());
  EXPECT_NE(exit->exit_code, 0);
}

// A saturated worker answers /health late: it queues the probe behind its generations. While it
// answers proxied requests, probes that time out must not take it out of rotation (the gateway
// would then refuse every request with "no healthy worker"); once it answers nothing, they count.
TEST_F(GatewayIntegrationTest, ABusyWorkerWhoseProbesTimeOutStaysInRotation) {
  Proc w = Worker();
  ASSERT_TRUE(Http(w)->Post("/sim/config", R"({"health_delay_ms": 2500})", "application/json"));
  Proc gw = Gateway({&w}, "sticky", {"--health-failures", "2"});
  const std::string log = fmt::format("{}/out-{}", dir_.path(), counter_ - 1);
  auto c = Http(gw);
  // About three probes, each waiting out its 2 s read timeout: two counted would take it out.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(7);
  int served = 0;
  while (std::chrono::steady_clock::now() < until) {
    int status = 0;
    json res = PostJson(*c, "/generate", {{"input_ids", {1, 2, 3}}}, &status);
    ASSERT_EQ(status, 200) << "a busy worker was taken out after " << served << " answers: " << res
                           << "\n"
                           << ReadFileToString(log).value_or("");
    served++;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  auto text = ReadFileToString(log);
  ASSERT_TRUE(text.ok());
  EXPECT_NE(text->find("answers proxied requests: busy"), std::string::npos) << *text;
  // Idle now, with probes still timing out: nothing shows it alive, and it leaves rotation.
  bool out = false;
  for (int i = 0; i < 400 && !out; ++i) {
    json listed = WorkerList(*c);
    out = !listed.empty() && !listed[0]["healthy"].get<bool>();
    if (!out) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  EXPECT_TRUE(out) << "a worker that answers nothing stayed in rotation\n"
                   << ReadFileToString(log).value_or("");
}

TEST_F(GatewayIntegrationTest, HostileInputsAreRejected) {
  Proc w0 = Worker();
  Proc gw = Gateway({&w0}, "sticky");
  auto c = Http(gw);
  auto post = [&](const std::string& path, const std::string& body) {
    auto r = c->Post(path, body, "application/json");
    return r ? r->status : -1;
  };
  EXPECT_EQ(post("/generate", "{not json"), 400);
  EXPECT_EQ(post("/generate", "[1,2,3]"), 400);
  EXPECT_EQ(post("/generate", R"({"input_ids": "abc"})"), 400);
  EXPECT_EQ(post("/generate", R"({"input_ids": []})"), 400);
  EXPECT_EQ(post("/generate", R"({"input_ids": [1, -5]})"), 400);
  EXPECT_EQ(post("/generate", R"({"input_ids": [1, 99999999999]})"), 400);
  EXPECT_EQ(post("/generate", R"({"input_ids": [1, 2.5]})"), 400);
  EXPECT_EQ(post("/generate", R"({"input_ids": [1], "routing_key": 5})"), 400);
  EXPECT_EQ(post("/generate", R"({"sampling_params": {}})"), 400);
  // Fields the gateway passes through are checked by the worker.
  EXPECT_EQ(post("/generate", R"({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}})"),
            400);
  EXPECT_EQ(post("/generate", R"({"input_ids": [1], "routed_experts_start_len": 50})"), 400);
  EXPECT_EQ(post("/weights/update", R"({"model_path": "x"})"), 400);
  EXPECT_EQ(post("/weights/update", R"({"model_path": "x", "weight_version": ""})"), 400);
  EXPECT_EQ(post("/workers", R"({"url": "not a url"})"), 400);
  EXPECT_EQ(post("/workers", R"({"url": "http://127.0.0.1:99999"})"), 400);
  EXPECT_EQ(post("/nope", "{}"), 404);
  // Still serving after all of that.
  EXPECT_EQ(post("/generate", R"({"input_ids": [1, 2, 3], "routing_key": "ok"})"), 200);
}

TEST_F(GatewayIntegrationTest, BatchGenerateIsRoutedByItsFirstElement) {
  Proc w0 = Worker(), w1 = Worker();
  Proc gw = Gateway({&w0, &w1}, "sticky");
  auto c = Http(gw);
  int status = 0;
  std::string worker;
  json res = PostJson(*c, "/generate",
                      {{"input_ids", {{1, 2, 3}, {4, 5}}},
                       {"routing_key", "batch"},
                       {"sampling_params", {{"max_new_tokens", 2}}}},
                      &status, &worker);
  ASSERT_EQ(status, 200) << res.dump();
  ASSERT_TRUE(res.is_array());
  ASSERT_EQ(res.size(), 2u);
  EXPECT_EQ(res[1]["meta_info"]["prompt_tokens"], 2);
  // The same rollout's next turn goes where its first turn went.
  std::string again;
  PostJson(*c, "/generate", {{"input_ids", {{1, 2, 3, 9}}}, {"routing_key", "batch"}}, &status,
           &again);
  EXPECT_EQ(status, 200);
  EXPECT_EQ(again, worker);
  Proc& where = worker == fmt::format("127.0.0.1:{}", w0.port) ? w0 : w1;
  json last = json::parse(Http(where)->Get("/sim/stats")->body)["last_request"];
  ASSERT_TRUE(last["rid"].is_array()) << last.dump();
  EXPECT_EQ(last["rid"].size(), 1u);
  res = PostJson(*c, "/generate", {{"text", {"ab", "cde"}}}, &status);
  ASSERT_EQ(status, 200) << res.dump();
  EXPECT_EQ(res.size(), 2u);
  for (const char* bad :
       {R"({"input_ids": [[1], [-1]]})", R"({"input_ids": [[]]})", R"({"input_ids": [[1], 2]})",
        R"({"text": ["a", 1]})", R"({"text": []})"}) {
    auto r = c->Post("/generate", bad, "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << bad;
  }
}

TEST_F(GatewayIntegrationTest, GatewayWithoutWorkersSays503) {
  Proc gw = Gateway({}, "sticky");
  auto c = Http(gw);
  int status = 0;
  json res = PostJson(*c, "/generate", {{"input_ids", {1, 2}}}, &status);
  EXPECT_EQ(status, 503);
  EXPECT_NE(res.dump().find("no healthy worker"), std::string::npos);
  // Register one at run time: it serves once the health loop checked it.
  Proc w0 = Worker();
  PostJson(*c, "/workers", {{"url", w0.url}}, &status);
  EXPECT_EQ(status, 200);
  for (int i = 0; i < 800; ++i) {
    PostJson(*c, "/generate", {{"input_ids", {1, 2}}}, &status);
    if (status == 200) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  EXPECT_EQ(status, 200);
  auto r = c->Get("/workers");
  ASSERT_TRUE(r);
  EXPECT_NE(r->body.find(w0.url), std::string::npos);
}

TEST_F(GatewayIntegrationTest, OpenAiEndpointsPassThrough) {
  Proc w0 = Worker();
  Proc gw = Gateway({&w0}, "sticky");
  auto c = Http(gw);
  int status = 0;
  json res = PostJson(*c, "/v1/chat/completions",
                      {{"model", "m"},
                       {"messages", {{{"role", "user"}, {"content", "hello there"}}}},
                       {"max_tokens", 3}},
                      &status);
  EXPECT_EQ(status, 200);
  EXPECT_EQ(res["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(res["usage"]["completion_tokens"], 3);
  res = PostJson(*c, "/v1/completions", {{"prompt", "abc"}, {"max_tokens", 2}}, &status);
  EXPECT_EQ(status, 200);
  EXPECT_EQ(res["object"], "text_completion");
}

TEST_F(GatewayIntegrationTest, StreamingAndClientDisconnectAborts) {
  Proc w0 = Worker({"--decode-us", "20000"});
  Proc gw = Gateway({&w0}, "sticky");
  auto c = Http(gw);
  {
    httplib::Request req = StreamingGenerate({1, 2, 3}, "s", 5);
    std::string got;
    req.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
      got.append(d, n);
      return true;
    };
    auto r = c->send(req);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200);
    EXPECT_NE(got.find("data: [DONE]"), std::string::npos);
    EXPECT_NE(got.find("\"completion_tokens\":5"), std::string::npos);
  }
  {
    httplib::Request req = StreamingGenerate({4, 5, 6}, "gone", 1000);
    int chunks = 0;
    req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) { return ++chunks < 3; };
    auto c2 = Http(gw);
    auto r = c2->send(req);
    EXPECT_FALSE(r);  // we hung up
    c2->stop();
  }
  // The worker's own failed write to the closed connection may come first; the gateway counts
  // the hang-up before it sends /abort_request, so once the worker has that, the count is in.
  auto wc = Http(w0);
  bool aborted = false;
  for (int i = 0; i < 400 && !aborted; ++i) {
    auto r = wc->Get("/sim/stats");
    json j = r ? json::parse(r->body, nullptr, false) : json();
    aborted = j.is_object() && j["aborts"].get<int>() >= 1 && j["aborted_rids"].size() == 1;
    if (!aborted) {
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
  }
  EXPECT_TRUE(aborted) << "the worker never saw the abort";
  EXPECT_NE(Metrics(*c).find("bragg_gateway_client_aborts_total 1"), std::string::npos);
}

// Opens a plain TCP connection to 127.0.0.1:`port` and sends `request`; the caller hangs up by
// dropping the fd.
UniqueFd SendRaw(int port, const std::string& request);

TEST_F(GatewayIntegrationTest, WorkerLeftOnNewWeightsByAFailedFirstUpdateStaysOut) {
  Proc w0 = Worker(), w1 = Worker(), w2 = Worker();
  Proc gw = Gateway({&w0, &w1, &w2}, "sticky");
  auto c = Http(gw);
  int status = 0;
  PostJson(*Http(w2), "/sim/config", {{"fail_update", true}}, &status);
  // w0 loads the new weights but cannot go back.
  PostJson(*Http(w0), "/sim/config", {{"fail_update_after", 1}}, &status);
  json rep = PostJson(*c, "/weights/update", {{"model_path", "/ckpt/2"}, {"weight_version", "2"}},
                      &status);
  EXPECT_EQ(status, 500);
  ASSERT_EQ(rep["workers"].size(), 3u) << rep.dump();
  for (const json& w : rep["workers"]) {
    EXPECT_EQ(w["removed"].get<bool>(), w["url"] == w0.url) << rep.dump();
    if (w["url"] == w0.url) {
      EXPECT_EQ(w["version_after"], "2");
    }
  }
  EXPECT_TRUE(StaysOut(*c, w0.url)) << "a worker on other weights came back";
  EXPECT_TRUE(Healthy(*c, w1.url));
  for (int k = 0; k < 6; ++k) {
    json res =
        PostJson(*c, "/generate",
                 {{"input_ids", {1, 2, 3}}, {"routing_key", "r" + std::to_string(k)}}, &status);
    ASSERT_EQ(status, 200);
    EXPECT_EQ(res["meta_info"]["weight_version"], "0");
  }
  // Back on the fleet's weights: admitted again.
  PostJson(*Http(w0), "/sim/config", {{"fail_update", false}, {"fail_update_after", -1}}, &status);
  PostJson(*Http(w0), "/update_weights_from_disk",
           {{"model_path", "sim-model"}, {"weight_version", "0"}}, &status);
  ASSERT_EQ(status, 200);
  EXPECT_TRUE(WaitHealthy(*c, w0.url, true));
}

TEST_F(GatewayIntegrationTest, LoadWhoseAnswerWasLostIsRolledBack) {
  Proc w0 = Worker(), w1 = Worker();
  Proc gw = Gateway({&w0, &w1}, "sticky");
  auto c = Http(gw);
  int status = 0;
  // w0 loads the new weights but its answer is lost; w1 fails, so the update fails.
  PostJson(*Http(w0), "/sim/config", {{"drop_update_replies", 1}}, &status);
  PostJson(*Http(w1), "/sim/config", {{"fail_update", true}}, &status);
  json rep = PostJson(*c, "/weights/update", {{"model_path", "/ckpt/2"}, {"weight_version", "2"}},
                      &status);
  EXPECT_EQ(status, 500);
  for (const json& w : rep["workers"]) {
    EXPECT_FALSE(w["removed"].get<bool>()) << rep.dump();
    EXPECT_EQ(w["version_after"], "0") << rep.dump();
    if (w["url"] == w0.url) {
      EXPECT_TRUE(w["rolled_back"].get<bool>()) << rep.dump();
    }
  }
  EXPECT_EQ(json::parse(Http(w0)->Get("/get_model_info")->body)["weight_version"], "0");
  EXPECT_TRUE(Healthy(*c, w0.url));
  EXPECT_NE(Metrics(*c).find("bragg_gateway_weight_version_skew 0"), std::string::npos);
}

TEST_F(GatewayIntegrationTest, WorkerWhoseContinueFailedStaysOutUntilContinued) {
  Proc w0 = Worker(), w1 = Worker();
  Proc gw = Gateway({&w0, &w1}, "sticky");
  auto c = Http(gw);
  int status = 0;
  PostJson(*Http(w1), "/sim/config", {{"fail_continue", true}}, &status);
  json rep = PostJson(*c, "/weights/update", {{"model_path", "/ckpt/2"}, {"weight_version", "v2"}},
                      &status);
  EXPECT_EQ(status, 500);
  EXPECT_FALSE(rep["success"].get<bool>()) << rep.dump();
  for (const json& w : rep["workers"]) {
    bool bad = w["url"] == w1.url;
    EXPECT_EQ(w["continued"].get<bool>(), !bad) << rep.dump();
    EXPECT_EQ(w["removed"].get<bool>(), bad) << rep.dump();
  }
  EXPECT_TRUE(StaysOut(*c, w1.url)) << "a paused worker came back";
  PostJson(*Http(w1), "/sim/config", {{"fail_continue", false}}, &status);
  EXPECT_TRUE(WaitHealthy(*c, w1.url, true));
  json info = json::parse(Http(w1)->Get("/get_model_info")->body);
  EXPECT_FALSE(info["paused"].get<bool>());
  EXPECT_EQ(info["weight_version"], "v2");
}

TEST_F(GatewayIntegrationTest, RolloutStartingDuringTheLoadIsSaltedWithTheNewVersion) {
  Proc w0 = Worker();
  Proc gw = Gateway({&w0}, "sticky");
  auto c = Http(gw);
  int status = 0;
  json res = PostJson(*c, "/generate", {{"input_ids", SharedPrompt(200)}, {"routing_key", "old"}},
                      &status);
  ASSERT_EQ(status, 200);
  PostJson(*Http(w0), "/sim/config", {{"update_delay_ms", 1500}}, &status);
  std::thread update([&] {
    int st = 0;
    PostJson(*Http(gw), "/weights/update", {{"model_path", "/ckpt/2"}, {"weight_version", "v2"}},
             &st);
    EXPECT_EQ(st, 200);
  });
  bool paused = false;
  for (int i = 0; i < 1000 && !paused; ++i) {
    auto r = Http(w0)->Get("/sim/stats");
    paused = r && json::parse(r->body)["paused"].get<bool>();
    if (!paused) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  ASSERT_TRUE(paused);
  // Waits for the continue, then runs on the new weights: it must not reuse the old KV.
  res = PostJson(*c, "/generate", {{"input_ids", SharedPrompt(200)}, {"routing_key", "during"}},
                 &status);
  update.join();
  ASSERT_EQ(status, 200) << res.dump();
  EXPECT_EQ(res["meta_info"]["cached_tokens"], 0) << "a rollout started in the load window "
                                                     "reused KV of the old weights";
  EXPECT_EQ(res["meta_info"]["weight_versions"][0]["version"], "v2");
}

TEST_F(GatewayIntegrationTest, WorkersAreVersionCheckedAtStartAndWhenRegistered) {
  Proc w0 = Worker(), other = Worker({"--weight-version", "5"});
  Proc gw = Gateway({&w0, &other}, "sticky");
  auto c = Http(gw);
  EXPECT_FALSE(Healthy(*c, other.url)) << "a worker on other weights served from the start";
  std::string m = Metrics(*c);
  EXPECT_NE(m.find(fmt::format("worker=\"{}\",version=\"0\"}} 1", w0.url)), std::string::npos) << m;
  Proc late = Worker(), late_other = Worker({"--weight-version", "9"});
  int status = 0;
  PostJson(*c, "/workers", {{"url", late_other.url}}, &status);
  EXPECT_EQ(status, 200);
  PostJson(*c, "/workers", {{"url", late.url}}, &status);
  EXPECT_EQ(status, 200);
  EXPECT_TRUE(WaitHealthy(*c, late.url, true));
  EXPECT_TRUE(StaysOut(*c, late_other.url)) << "a worker registered on other weights served";
}

TEST_F(GatewayIntegrationTest, OversizedBodiesAreRefused) {
  Proc w0 = Worker({"--moe-layers", "8", "--moe-topk", "8"});
  Proc small = Gateway({&w0}, "sticky", {"--max-body-mb", "1", "--max-upstream-response-mb", "1"});
  Proc dflt = Gateway({&w0}, "sticky");
  auto head = [](int port, size_t length) {
    UniqueFd fd = SendRaw(port, fmt::format("POST /generate HTTP/1.1\r\nHost: x\r\n"
                                            "Content-Type: application/json\r\n"
                                            "Content-Length: {}\r\n\r\n{{",
                                            length));
    timeval tv{10, 0};
    EXPECT_EQ(::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)), 0);
    std::string got;
    char buf[4096];
    ssize_t n;
    while ((n = ::recv(fd.get(), buf, sizeof(buf), 0)) > 0) {
      got.append(buf, n);
    }
    return got.substr(0, 12);
  };
  EXPECT_EQ(head(small.port, (size_t{1} << 20) + 1), "HTTP/1.1 413");
  EXPECT_EQ(head(dflt.port, (size_t{64} << 20) + 1), "HTTP/1.1 413");
  // A worker answer above the cap is a 502, one below it passes.
  auto c = Http(small);
  int status = 0;
  json res = PostJson(*c, "/generate",
                      {{"input_ids", Tokens(1, 5000)},
                       {"return_routed_experts", true},
                       {"sampling_params", {{"max_new_tokens", 1}}}},
                      &status);
  EXPECT_EQ(status, 502) << res.dump().substr(0, 300);
  EXPECT_NE(res.dump().find("larger than"), std::string::npos) << res.dump().substr(0, 300);
  PostJson(*c, "/generate",
           {{"input_ids", Tokens(1, 500)},
            {"return_routed_experts", true},
            {"sampling_params", {{"max_new_tokens", 1}}}},
           &status);
  EXPECT_EQ(status, 200);
}

TEST_F(GatewayIntegrationTest, ClientForgetReleasesTheRollout) {
  Proc w0 = Worker(), w1 = Worker();
  Proc gw = Gateway({&w0, &w1}, "sticky");
  auto client = RolloutClient::Create(gw.url, {});
  ASSERT_TRUE(client.ok());
  auto rollouts = [&] {
    int64_t n = 0;
    for (const json& w : WorkerList(*Http(gw))) {
      n += w["rollouts"].get<int64_t>();
    }
    return n;
  };
  for (const char* key : {"a", "b", "c"}) {
    ASSERT_TRUE((*client)->Generate(key, {1, 2, 3}, {{"max_new_tokens", 1}}).ok());
  }
  EXPECT_EQ(rollouts(), 3);
  EXPECT_TRUE((*client)->Forget("b").ok());
  EXPECT_EQ(rollouts(), 2);
  EXPECT_TRUE((*client)->Forget("b").ok());
  EXPECT_EQ(rollouts(), 2);
}

TEST_F(GatewayIntegrationTest, CacheSaltAndDpRankReachTheWorkerOnEveryPath) {
  Proc w0 = Worker();
  Proc gw = Gateway({&w0}, "sticky", {"--dp-size", "4"});
  auto c = Http(gw);
  int status = 0;
  PostJson(*c, "/weights/update", {{"model_path", "/ckpt/2"}, {"weight_version", "v2"}}, &status);
  ASSERT_EQ(status, 200);
  auto last = [&] { return json::parse(Http(w0)->Get("/sim/stats")->body)["last_request"]; };
  PostJson(*c, "/generate", {{"input_ids", {1, 2, 3}}, {"routing_key", "k"}, {"extra_key", "mine"}},
           &status);
  ASSERT_EQ(status, 200);
  EXPECT_EQ(last()["extra_key"], "mine|wv:v2");
  httplib::Headers h = {{"X-Session-Id", "chat-1"}};
  auto r =
      c->Post("/v1/chat/completions", h,
              json{{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 2}}.dump(),
              "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  json got = last();
  EXPECT_EQ(got["extra_key"], "wv:v2") << got.dump();
  EXPECT_TRUE(got.contains("routed_dp_rank")) << got.dump();
  r = c->Post("/v1/completions", h,
              json{{"prompt", "abc"}, {"max_tokens", 2}, {"extra_key", "own"}}.dump(),
              "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(last()["extra_key"], "own|wv:v2");
  // The OpenAI requests' token counts are accounted.
  std::string m = Metrics(*c);
  size_t at = m.find("bragg_gateway_worker_prompt_tokens_total{");
  ASSERT_NE(at, std::string::npos);
  uint64_t prompt = std::stoull(m.substr(m.find("} ", at) + 2));
  EXPECT_GT(prompt, 3u) << m;
}

TEST_F(GatewayIntegrationTest, MetricsEscapeLabelsAndCountOnlyStickyMoves) {
  Proc w0 = Worker(), w1 = Worker();
  Proc gw = Gateway({&w0, &w1}, "round_robin");
  auto c = Http(gw);
  int status = 0;
  PostJson(*c, "/weights/update", {{"model_path", "/ckpt/2"}, {"weight_version", "a\"b\\c\nd"}},
           &status);
  ASSERT_EQ(status, 200);
  for (int k = 0; k < 6; ++k) {
    PostJson(*c, "/generate", {{"input_ids", {1, 2, 3}}, {"routing_key", "rr"}}, &status);
    ASSERT_EQ(status, 200);
  }
  std::string m = Metrics(*c);
  EXPECT_NE(m.find("version=\"a\\\"b\\\\c\\nd\"} 1"), std::string::npos) << m;
  EXPECT_EQ(m.find("rollouts_moved_total{pool=\"main\",worker=\"" + w0.url + "\"} 0"),
            m.find("rollouts_moved_total{pool=\"main\",worker=\"" + w0.url + "\"}"))
      << m;
  EXPECT_NE(m.find("rollouts_moved_total{pool=\"main\",worker=\"" + w1.url + "\"} 0"),
            std::string::npos)
      << m;
}

// A worker that answers the first request on each connection and then, on the next one, closes
// the connection after reading it (kClose: an orderly close, as a worker whose keep-alive timer
// fires as the request arrives, or one that died after reading it) or resets it unread (kReset).
class OneRequestPerConnectionWorker {
 public:
  enum class Mode { kClose, kReset };
  explicit OneRequestPerConnectionWorker(Mode mode) : mode_(mode) {
    listen_ = UniqueFd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(listen_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(::listen(listen_.get(), 64), 0);
    socklen_t len = sizeof(addr);
    ::getsockname(listen_.get(), reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    accept_ = std::thread([this] {
      for (;;) {
        int fd = ::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC);
        if (fd < 0) {
          return;
        }
        std::lock_guard<std::mutex> lock(mu_);
        conns_.emplace_back([this, fd] { Serve(UniqueFd(fd)); });
      }
    });
  }
  ~OneRequestPerConnectionWorker() {
    ::shutdown(listen_.get(), SHUT_RDWR);
    accept_.join();
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& t : conns_) {
      t.join();
    }
  }
  std::string url() const { return fmt::format("http://127.0.0.1:{}", port_); }
  int generates() const { return generates_.load(); }
  int hangups() const { return hangups_.load(); }

 private:
  // One request's head and body; false at EOF or error.
  bool ReadRequest(int fd, std::string* head) {
    std::string buf;
    char c[4096];
    size_t end;
    while ((end = buf.find("\r\n\r\n")) == std::string::npos) {
      ssize_t n = ::recv(fd, c, sizeof(c), 0);
      if (n <= 0) {
        return false;
      }
      buf.append(c, n);
    }
    *head = buf.substr(0, end);
    size_t length = 0;
    size_t at = head->find("Content-Length: ");
    if (at == std::string::npos) {
      at = head->find("content-length: ");
    }
    if (at != std::string::npos) {
      length = std::stoul(head->substr(at + 16));
    }
    size_t have = buf.size() - end - 4;
    while (have < length) {
      ssize_t n = ::recv(fd, c, std::min(sizeof(c), length - have), 0);
      if (n <= 0) {
        return false;
      }
      have += n;
    }
    return true;
  }
  void Serve(UniqueFd fd) {
    std::string head;
    if (!ReadRequest(fd.get(), &head)) {
      return;
    }
    bool generate = head.rfind("POST /generate", 0) == 0;
    if (generate) {
      generates_++;
    }
    std::string body =
        R"({"text":"","output_ids":[1],"weight_version":"0","model_path":"m",)"
        R"("meta_info":{"prompt_tokens":1,"cached_tokens":0,"completion_tokens":1}})";
    std::string res = fmt::format(
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{}",
        body.size(), body);
    if (::send(fd.get(), res.data(), res.size(), MSG_NOSIGNAL) < 0) {
      return;
    }
    pollfd p{fd.get(), POLLIN, 0};
    if (::poll(&p, 1, 30000) <= 0) {
      return;
    }
    if (mode_ == Mode::kReset) {
      linger l{1, 0};
      ::setsockopt(fd.get(), SOL_SOCKET, SO_LINGER, &l, sizeof(l));
      return;  // closed with the request unread: a reset
    }
    if (!ReadRequest(fd.get(), &head)) {
      hangups_ += generate ? 1 : 0;  // the gateway closed the idle /generate connection
    } else if (head.rfind("POST /generate", 0) == 0) {
      generates_++;
    }
  }

  Mode mode_;
  UniqueFd listen_;
  int port_ = 0;
  std::thread accept_;
  std::mutex mu_;
  std::vector<std::thread> conns_;
  std::atomic<int> generates_{0};
  std::atomic<int> hangups_{0};
};

TEST_F(GatewayIntegrationTest, StaleKeepAliveConnectionsAreNotReused) {
  // Idle connections older than 200 ms are dropped: the worker closing one as it is reused
  // cannot fail the request.
  OneRequestPerConnectionWorker w(OneRequestPerConnectionWorker::Mode::kClose);
  Proc fake{ChildProcess(), w.url(), 0};
  Proc gw = Gateway({&fake}, "round_robin", {"--upstream-idle-ms", "200", "--io-threads", "1"});
  auto c = Http(gw);
  int status = 0;
  PostJson(*c, "/generate", {{"input_ids", {1, 2}}}, &status);
  ASSERT_EQ(status, 200);
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  json res = PostJson(*c, "/generate", {{"input_ids", {1, 2}}}, &status);
  EXPECT_EQ(status, 200) << res.dump();
  EXPECT_EQ(w.generates(), 2);
}

TEST_F(GatewayIntegrationTest, IdleWorkerConnectionsAreClosedNotHeld) {
  // A pooled connection too old to reuse is closed by the gateway's sweep, not held until the
  // next request to that worker: each one holds a worker thread in thread-per-connection
  // servers (bragg-sim-worker at 10,000 rollouts ran out of them).
  OneRequestPerConnectionWorker w(OneRequestPerConnectionWorker::Mode::kClose);
  Proc fake{ChildProcess(), w.url(), 0};
  Proc gw = Gateway({&fake}, "round_robin", {"--upstream-idle-ms", "200", "--io-threads", "1"});
  auto c = Http(gw);
  int status = 0;
  PostJson(*c, "/generate", {{"input_ids", {1, 2}}}, &status);
  ASSERT_EQ(status, 200);
  for (int i = 0; i < 100 && w.hangups() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(w.hangups(), 1);  // within 5 s, not the worker's keep-alive timeout
  EXPECT_EQ(w.generates(), 1);
}

TEST_F(GatewayIntegrationTest, ResetReusedConnectionIsRetriedOnceOrderlyCloseIsNot) {
  {
    // Reset with the request unread: it never ran, so it goes again on a fresh connection.
    OneRequestPerConnectionWorker w(OneRequestPerConnectionWorker::Mode::kReset);
    Proc fake{ChildProcess(), w.url(), 0};
    Proc gw = Gateway({&fake}, "round_robin", {"--io-threads", "1"});
    auto c = Http(gw);
    int status = 0;
    for (int k = 0; k < 3; ++k) {
      json res = PostJson(*c, "/generate", {{"input_ids", {1, 2}}}, &status);
      EXPECT_EQ(status, 200) << k << " " << res.dump();
    }
    EXPECT_EQ(w.generates(), 3);
  }
  {
    // Read, then closed without an answer: the worker may have run it; not sent again.
    OneRequestPerConnectionWorker w(OneRequestPerConnectionWorker::Mode::kClose);
    Proc fake{ChildProcess(), w.url(), 0};
    Proc gw = Gateway({&fake}, "round_robin", {"--io-threads", "1", "--health-failures", "1000"});
    auto c = Http(gw);
    int status = 0;
    PostJson(*c, "/generate", {{"input_ids", {1, 2}}}, &status);
    ASSERT_EQ(status, 200);
    PostJson(*c, "/generate", {{"input_ids", {1, 2}}}, &status);
    EXPECT_EQ(status, 502);
    EXPECT_EQ(w.generates(), 2);
  }
}

UniqueFd SendRaw(int port, const std::string& request) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  EXPECT_GE(fd.get(), 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  EXPECT_EQ(::send(fd.get(), request.data(), request.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(request.size()));
  return fd;
}

TEST_F(GatewayIntegrationTest, NonStreamingClientDisconnectAborts) {
  // 1,000 tokens at 20 ms each: the request runs for 20 s unless the gateway aborts it.
  Proc w0 = Worker({"--decode-us", "20000"});
  Proc gw = Gateway({&w0}, "sticky");
  auto c = Http(gw);
  std::string body = json{{"input_ids", {7, 8, 9}},
                          {"routing_key", "hangup"},
                          {"rid", "hangup-1"},
                          {"sampling_params", {{"max_new_tokens", 1000}}}}
                         .dump();
  {
    UniqueFd fd = SendRaw(gw.port, fmt::format("POST /generate HTTP/1.1\r\nHost: x\r\n"
                                               "Content-Type: application/json\r\n"
                                               "Content-Length: {}\r\n\r\n{}",
                                               body.size(), body));
    // Hang up once the gateway has the request in flight on the worker.
    bool in_flight = false;
    for (int i = 0; i < 200 && !in_flight; ++i) {
      json j = WorkerList(*c);
      in_flight = !j.empty() && j[0]["in_flight"].get<int>() == 1;
      if (!in_flight) {
        std::this_thread::sleep_for(std::chrono::milliseconds(25));
      }
    }
    ASSERT_TRUE(in_flight) << "the request never reached the worker";
  }
  auto wc = Http(w0);
  bool aborted = false;
  for (int i = 0; i < 200 && !aborted; ++i) {
    auto r = wc->Get("/sim/stats");
    aborted = r && json::parse(r->body)["aborts"].get<int>() >= 1;
    if (!aborted) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  EXPECT_TRUE(aborted) << "the worker never saw the abort";
  // The gateway forgot the request and still serves.
  bool idle = false;
  for (int i = 0; i < 200 && !idle; ++i) {
    json j = WorkerList(*c);
    idle = !j.empty() && j[0]["in_flight"].get<int>() == 0;
    if (!idle) {
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
  }
  EXPECT_TRUE(idle);
  EXPECT_NE(Metrics(*c).find("bragg_gateway_client_aborts_total 1"), std::string::npos);
  int status = 0;
  json res =
      PostJson(*c, "/generate",
               {{"input_ids", {1, 2}}, {"sampling_params", {{"max_new_tokens", 2}}}}, &status);
  EXPECT_EQ(status, 200) << res.dump();
  EXPECT_EQ(res["meta_info"]["completion_tokens"], 2);
}

bool LastRidIs(const json& stats, const std::string& rid) {
  return stats["last_request"].is_object() && stats["last_request"].value("rid", "") == rid;
}

bool Aborted(const json& stats, const std::string& rid) {
  for (const json& r : stats["aborted_rids"]) {
    if (r == rid) {
      return true;
    }
  }
  return false;
}

// The first "id" of an SSE stream's events (SGLang's meta_info.id and OpenAI's id: the rid).
std::string FirstStreamId(const std::string& sse) {
  size_t at = sse.find("data: ");
  if (at == std::string::npos) {
    return "";
  }
  size_t end = sse.find("\n\n", at);
  json j = json::parse(sse.substr(at + 6, end == std::string::npos ? end : end - at - 6), nullptr,
                       false);
  if (!j.is_object()) {
    return "";
  }
  if (j.contains("meta_info")) {
    return j["meta_info"].value("id", "");
  }
  return j.value("id", "");
}

// Sends `req` streaming, hangs up after `chunks` chunks; returns what arrived.
std::string StreamThenHangUp(const Proc& gw, httplib::Request req, int chunks) {
  std::string got;
  int seen = 0;
  req.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
    got.append(d, n);
    return ++seen < chunks;
  };
  auto c = Http(gw);
  auto r = c->send(req);
  EXPECT_FALSE(r) << "the client hung up, the request cannot have completed";
  c->stop();
  return got;
}

std::string RawPost(const std::string& path, const std::string& body) {
  return fmt::format(
      "POST {} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      "Content-Length: {}\r\n\r\n{}",
      path, body.size(), body);
}

TEST_F(GatewayIntegrationTest, PrefillDecodeHangUpAbortsBothHalves) {
  // 1,000 tokens at 20 ms each on both halves: 20 s unless the gateway aborts them.
  Proc p0 = Worker({"--decode-us", "20000"}), d0 = Worker({"--decode-us", "20000"});
  Proc gw = Gateway({}, "sticky", {"--prefill", p0.url, "--decode", d0.url});
  auto c = Http(gw);
  // Not streaming, the client's own rid: the hang-up is seen while both halves run.
  {
    std::string body = json{{"input_ids", {7, 8, 9}},
                            {"routing_key", "pd-hangup"},
                            {"rid", "pd-hangup-1"},
                            {"sampling_params", {{"max_new_tokens", 1000}}}}
                           .dump();
    UniqueFd fd = SendRaw(gw.port, RawPost("/generate", body));
    for (const Proc* w : {&p0, &d0}) {
      ASSERT_TRUE(WaitStats(*w, [](const json& s) { return LastRidIs(s, "pd-hangup-1"); }))
          << "a half never reached its worker";
    }
  }
  for (const Proc* w : {&p0, &d0}) {
    EXPECT_TRUE(WaitStats(*w, [](const json& s) { return Aborted(s, "pd-hangup-1"); }))
        << w->url << " never saw the abort: " << SimStats(*w).dump();
  }
  // Streaming, no rid: the gateway's own rid names the request on both halves.
  std::string got = StreamThenHangUp(gw, StreamingGenerate({4, 5, 6}, "pd-stream", 1000), 3);
  std::string rid = FirstStreamId(got);
  ASSERT_FALSE(rid.empty()) << got;
  EXPECT_EQ(rid.rfind("gw-", 0), 0u) << rid;
  EXPECT_TRUE(WaitStats(p0, [&](const json& s) { return LastRidIs(s, rid); }));
  for (const Proc* w : {&p0, &d0}) {
    EXPECT_TRUE(WaitStats(*w, [&](const json& s) { return Aborted(s, rid); }))
        << w->url << " never saw the abort of " << rid << ": " << SimStats(*w).dump();
  }
  bool counted = false;
  for (int i = 0; i < 400 && !counted; ++i) {
    counted = Metrics(*c).find("bragg_gateway_client_aborts_total 2") != std::string::npos;
    if (!counted) {
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
  }
  EXPECT_TRUE(counted) << Metrics(*c);
  // The pair still serves, and a finished pair is not aborted.
  int status = 0;
  json res = PostJson(
      *c, "/generate",
      {{"input_ids", {1, 2}}, {"rid", "pd-ok"}, {"sampling_params", {{"max_new_tokens", 2}}}},
      &status);
  EXPECT_EQ(status, 200) << res.dump();
  EXPECT_EQ(res["meta_info"]["completion_tokens"], 2);
  EXPECT_FALSE(Aborted(SimStats(d0), "pd-ok"));
}

TEST_F(GatewayIntegrationTest, PrefillFailureAbortsDecodeHalf) {
  Proc p0 = Worker(), d0 = Worker({"--decode-us", "20000"});
  Proc gw = Gateway({}, "sticky", {"--prefill", p0.url, "--decode", d0.url});
  ASSERT_TRUE(Http(p0)->Post("/sim/config", R"({"error_rate": 1.0})", "application/json"));
  auto c = Http(gw);
  int status = 0;
  auto start = std::chrono::steady_clock::now();
  json res = PostJson(*c, "/generate",
                      {{"input_ids", {1, 2, 3}},
                       {"rid", "pd-bad-prefill"},
                       {"sampling_params", {{"max_new_tokens", 1000}}}},
                      &status);
  // The prefill worker's error, at once: not the 20 s of a decode half left waiting.
  EXPECT_EQ(status, 500) << res.dump();
  EXPECT_NE(res.dump().find("injected failure"), std::string::npos) << res.dump();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15));
  EXPECT_TRUE(WaitStats(d0, [](const json& s) { return Aborted(s, "pd-bad-prefill"); }));
}

TEST_F(GatewayIntegrationTest, OpenAiHangUpAborts) {
  Proc w0 = Worker({"--decode-us", "20000"});
  Proc gw = Gateway({&w0}, "sticky");
  auto c = Http(gw);
  // Streaming chat completion, no rid: the gateway gives one and aborts it by that id.
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/chat/completions";
  req.body = json{
      {"model", "m"},
      {"messages", {{{"role", "user"}, {"content", "solve it"}}}},
      {"max_tokens", 1000},
      {"stream",
       true}}.dump();
  req.set_header("Content-Type", "application/json");
  std::string got = StreamThenHangUp(gw, req, 3);
  EXPECT_NE(got.find("chat.completion.chunk"), std::string::npos) << got;
  std::string rid = FirstStreamId(got);
  ASSERT_FALSE(rid.empty()) << got;
  EXPECT_EQ(rid.rfind("gw-", 0), 0u) << rid;
  EXPECT_TRUE(WaitStats(w0, [&](const json& s) { return Aborted(s, rid); })) << SimStats(w0).dump();
  // Not streaming, the client's rid: /v1/completions.
  {
    std::string body = json{{"prompt", "abc"}, {"max_tokens", 1000}, {"rid", "oai-hangup"}}.dump();
    UniqueFd fd = SendRaw(gw.port, RawPost("/v1/completions", body));
    ASSERT_TRUE(WaitStats(w0, [](const json& s) { return LastRidIs(s, "oai-hangup"); }));
  }
  EXPECT_TRUE(WaitStats(w0, [](const json& s) { return Aborted(s, "oai-hangup"); }))
      << SimStats(w0).dump();
  // Completed OpenAI requests: the rid is spliced in, the rest of the body goes through.
  int status = 0;
  json res =
      PostJson(*c, "/v1/completions", {{"prompt", "x"}, {"max_tokens", 1}, {"n", 1}}, &status);
  EXPECT_EQ(status, 200) << res.dump();
  json last = SimStats(w0)["last_request"];
  EXPECT_EQ(last["n"], 1);
  EXPECT_EQ(last["rid"], res["id"]);
  res = PostJson(*c, "/v1/completions", json::object(), &status);
  EXPECT_EQ(status, 400) << res.dump();
  EXPECT_EQ(SimStats(w0)["aborted_rids"].size(), 2u);
}

TEST_F(GatewayIntegrationTest, ExpectContinueIsAnswered) {
  Proc w0 = Worker();
  Proc gw = Gateway({&w0}, "sticky");
  std::string body =
      json{{"input_ids", {1, 2, 3}}, {"sampling_params", {{"max_new_tokens", 2}}}}.dump();
  UniqueFd fd = SendRaw(gw.port, fmt::format("POST /generate HTTP/1.1\r\nHost: x\r\n"
                                             "Content-Type: application/json\r\n"
                                             "Expect: 100-continue\r\nConnection: close\r\n"
                                             "Content-Length: {}\r\n\r\n",
                                             body.size()));
  timeval tv{10, 0};
  ASSERT_EQ(::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)), 0);
  char buf[4096];
  ssize_t n = ::recv(fd.get(), buf, sizeof(buf), 0);
  ASSERT_GT(n, 0) << "no interim response before the body";
  EXPECT_EQ(std::string(buf, n).rfind("HTTP/1.1 100 Continue\r\n\r\n", 0), 0u);
  ASSERT_EQ(::send(fd.get(), body.data(), body.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(body.size()));
  std::string got;
  while ((n = ::recv(fd.get(), buf, sizeof(buf), 0)) > 0) {
    got.append(buf, n);
  }
  EXPECT_EQ(got.rfind("HTTP/1.1 200", 0), 0u) << got;
  EXPECT_NE(got.find("\"completion_tokens\":2"), std::string::npos) << got;
}

TEST_F(GatewayIntegrationTest, MalformedHttpGets400AndGatewayServesOn) {
  Proc w0 = Worker();
  Proc gw = Gateway({&w0}, "sticky");
  for (const char* junk :
       {"GARBAGE\r\n\r\n", "POST /generate HTTP/1.1\r\nContent-Length: x\r\n\r\n",
        "POST /generate HTTP/9.9\r\n\r\n"}) {
    UniqueFd fd = SendRaw(gw.port, junk);
    timeval tv{10, 0};
    ASSERT_EQ(::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)), 0);
    std::string got;
    char buf[4096];
    ssize_t n;
    while ((n = ::recv(fd.get(), buf, sizeof(buf), 0)) > 0) {
      got.append(buf, n);
    }
    EXPECT_EQ(got.rfind("HTTP/1.1 400", 0), 0u) << junk << " -> " << got;
  }
  auto c = Http(gw);
  int status = 0;
  json res =
      PostJson(*c, "/generate",
               {{"input_ids", {1, 2}}, {"sampling_params", {{"max_new_tokens", 2}}}}, &status);
  EXPECT_EQ(status, 200) << res.dump();
}

TEST_F(GatewayIntegrationTest, WorkerDyingMidStreamEndsStreamWithError) {
  Proc w0 = Worker({"--decode-us", "20000"});
  Proc gw = Gateway({&w0}, "sticky");
  auto c = Http(gw);
  httplib::Request req = StreamingGenerate({3, 1, 4}, "dies", 1000);
  std::string got;
  bool killed = false;
  req.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
    got.append(d, n);
    if (!killed && got.find("data: ") != std::string::npos) {
      killed = true;
      EXPECT_TRUE(w0.child.Signal(SIGKILL).ok());
    }
    return true;
  };
  auto r = c->send(req);
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_TRUE(killed);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(got.find("data: [DONE]"), std::string::npos);
  EXPECT_NE(got.find("worker failed mid-request"), std::string::npos) << got.substr(0, 300);
  EXPECT_NE(Metrics(*c).find("bragg_gateway_upstream_errors_total 1"), std::string::npos);
}

TEST_F(GatewayIntegrationTest, PrefillDecodePairing) {
  Proc p0 = Worker(), p1 = Worker(), d0 = Worker(), d1 = Worker();
  Proc gw = Gateway({}, "sticky",
                    {"--prefill", p0.url, "--prefill", p1.url, "--decode", d0.url, "--decode",
                     d1.url, "--bootstrap-port", "9123"});
  auto c = Http(gw);
  std::map<std::string, std::pair<int, int>> pair_of;
  auto last = [&](const Proc& w) {
    auto r = Http(w)->Get("/sim/stats");
    return json::parse(r->body);
  };
  for (int turn = 0; turn < 2; ++turn) {
    for (int k = 0; k < 4; ++k) {
      std::string key = "pd-" + std::to_string(k);
      int status = 0;
      json res =
          PostJson(*c, "/generate",
                   {{"input_ids", Tokens(k, 30 + turn * 10)}, {"routing_key", key}}, &status);
      ASSERT_EQ(status, 200) << res.dump();
      // Which pair served it: the workers whose last request has this rid. The prefill half
      // is a side call of its own: it may reach its worker after the decode half answered.
      std::string rid = res["meta_info"]["id"];
      int pi = -1, di = -1;
      json seen;
      for (int poll = 0; poll < 400 && pi < 0; ++poll) {
        for (int i = 0; i < 2; ++i) {
          json ps = last(i == 0 ? p0 : p1);
          if (ps["last_request"].is_object() && ps["last_request"].value("rid", "") == rid) {
            pi = i;
            seen = ps["last_request"];
          }
        }
        if (pi < 0) {
          std::this_thread::sleep_for(std::chrono::milliseconds(25));
        }
      }
      for (int i = 0; i < 2; ++i) {
        json ds = last(i == 0 ? d0 : d1);
        if (ds["last_request"].is_object() && ds["last_request"].value("rid", "") == rid) {
          di = i;
          EXPECT_EQ(ds["last_request"]["bootstrap_room"],
                    seen.is_object() ? seen["bootstrap_room"] : json());
          EXPECT_EQ(ds["last_request"]["bootstrap_host"], "127.0.0.1");
        }
      }
      ASSERT_GE(pi, 0);
      ASSERT_GE(di, 0);
      EXPECT_EQ(seen["bootstrap_host"], "127.0.0.1");
      EXPECT_EQ(seen["bootstrap_port"], 9123);
      ASSERT_TRUE(seen["bootstrap_room"].is_number_unsigned());
      EXPECT_LT(seen["bootstrap_room"].get<uint64_t>(), uint64_t{1} << 63);
      if (turn == 0) {
        pair_of[key] = {pi, di};
      } else {
        EXPECT_EQ(pair_of[key], std::make_pair(pi, di)) << "pair not sticky for " << key;
      }
    }
  }
}

TEST_F(GatewayIntegrationTest, DpRankPinnedPerRollout) {
  Proc w0 = Worker();
  Proc gw = Gateway({&w0}, "sticky", {"--dp-size", "4"});
  auto c = Http(gw);
  auto wc = Http(w0);
  std::map<std::string, int> rank_of;
  std::set<int> ranks;
  for (int turn = 0; turn < 2; ++turn) {
    for (int k = 0; k < 16; ++k) {
      std::string key = "dp-" + std::to_string(k);
      int status = 0;
      PostJson(*c, "/generate", {{"input_ids", Tokens(k, 20 + turn)}, {"routing_key", key}},
               &status);
      ASSERT_EQ(status, 200);
      json last = json::parse(wc->Get("/sim/stats")->body)["last_request"];
      ASSERT_TRUE(last.contains("routed_dp_rank")) << last.dump();
      int rank = last["routed_dp_rank"].get<int>();
      EXPECT_GE(rank, 0);
      EXPECT_LT(rank, 4);
      ranks.insert(rank);
      if (turn == 0) {
        rank_of[key] = rank;
      } else {
        EXPECT_EQ(rank_of[key], rank) << key;
      }
      EXPECT_FALSE(last.contains("routing_key")) << "gateway-only field leaked to the worker";
    }
  }
  EXPECT_GE(ranks.size(), 2u);
  // The client's own rank passes through untouched.
  int status = 0;
  PostJson(*c, "/generate", {{"input_ids", {1, 2}}, {"routing_key", "x"}, {"routed_dp_rank", 3}},
           &status);
  EXPECT_EQ(json::parse(wc->Get("/sim/stats")->body)["last_request"]["routed_dp_rank"], 3);
  // Bad --dp-size is refused at startup.
  auto bad = Spawn({BRAGG_GATEWAY, "--listen", "127.0.0.1:0", "--dp-size", "0"});
  ASSERT_TRUE(bad.ok());
  auto exit = bad->Wait(std::chrono::seconds(10));
  ASSERT_TRUE(exit.ok());
  EXPECT_NE(exit->exit_code, 0);
}

TEST_F(GatewayIntegrationTest, DeltaRouterReplayEqualsFullEveryTurn) {
  Proc w0 = Worker({"--moe-layers", "6", "--moe-topk", "4"});
  Proc w1 = Worker({"--moe-layers", "6", "--moe-topk", "4"});
  Proc gw = Gateway({&w0, &w1}, "sticky");
  ClientOptions delta_opts{.return_routed_experts = true, .delta_routed_experts = true};
  ClientOptions full_opts{.return_routed_experts = true, .delta_routed_experts = false};
  auto delta = RolloutClient::Create(fmt::format("http://127.0.0.1:{}", gw.port), delta_opts);
  auto full = RolloutClient::Create(fmt::format("http://127.0.0.1:{}", gw.port), full_opts);
  ASSERT_TRUE(delta.ok() && full.ok());
  EXPECT_FALSE(RolloutClient::Create("nonsense", delta_opts).ok());
  std::vector<int32_t> convo = Tokens(3, 500);
  for (int turn = 0; turn < 6; ++turn) {
    auto d = (*delta)->Generate("delta", convo, {{"max_new_tokens", 16}});
    auto f = (*full)->Generate("full", convo, {{"max_new_tokens", 16}});
    ASSERT_TRUE(d.ok()) << d.status();
    ASSERT_TRUE(f.ok()) << f.status();
    ASSERT_EQ(d->output_ids, f->output_ids);
    size_t total = convo.size() + d->output_ids.size();
    const auto& a = (*delta)->RoutedExperts("delta");
    const auto& b = (*full)->RoutedExperts("full");
    ASSERT_EQ(a.size(), (total - 1) * 6 * 4);
    ASSERT_EQ(a, b) << "turn " << turn;
    if (turn > 0) {
      EXPECT_LT(d->routed_experts_bytes * 5, f->routed_experts_bytes);
    }
    convo.insert(convo.end(), d->output_ids.begin(), d->output_ids.end());
    auto tool = Tokens(turn, 40, 20000);
    convo.insert(convo.end(), tool.begin(), tool.end());
  }
  // A conversation that shrinks cannot be delta-replayed.
  auto bad = (*delta)->Generate("delta", Tokens(3, 10), {{"max_new_tokens", 1}});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(GatewayIntegrationTest, WeightUpdateFailsSafe) {
  Proc w0 = Worker(), w1 = Worker(), w2 = Worker();
  Proc gw = Gateway({&w0, &w1, &w2}, "sticky");
  auto c = Http(gw);
  int status = 0;
  PostJson(*Http(w2), "/sim/config", {{"fail_update", true}}, &status);
  ASSERT_EQ(status, 200);
  json rep = PostJson(*c, "/weights/update", {{"model_path", "/ckpt/2"}, {"weight_version", "2"}},
                      &status);
  EXPECT_EQ(status, 500);
  EXPECT_FALSE(rep["success"].get<bool>());
  ASSERT_EQ(rep["workers"].size(), 3u);
  int rolled_back = 0;
  for (const json& w : rep["workers"]) {
    EXPECT_TRUE(w["paused"].get<bool>());
    EXPECT_TRUE(w["continued"].get<bool>());
    EXPECT_FALSE(w["removed"].get<bool>());
    rolled_back += w["rolled_back"].get<bool>();
  }
  EXPECT_EQ(rolled_back, 2);
  for (Proc* w : {&w0, &w1, &w2}) {
    auto r = Http(*w)->Get("/get_model_info");
    json info = json::parse(r->body);
    EXPECT_EQ(info["weight_version"], "0");
    EXPECT_EQ(info["model_path"], "sim-model");
    EXPECT_FALSE(info["paused"].get<bool>());
  }
  json res =
      PostJson(*c, "/generate", {{"input_ids", {1, 2, 3}}, {"routing_key", "after"}}, &status);
  EXPECT_EQ(status, 200);
  EXPECT_EQ(res["meta_info"]["weight_version"], "0");
  EXPECT_NE(Metrics(*c).find("bragg_gateway_weight_updates_total{result=\"failed\"} 1"),
            std::string::npos);
}

TEST_F(GatewayIntegrationTest, WeightUpdateDuring1000RunningRollouts) {
  std::vector<Proc> workers;
  for (int i = 0; i < 4; ++i) {
    workers.push_back(Worker({"--decode-us", "1500"}));
  }
  std::vector<Proc*> ptrs;
  for (auto& w : workers) {
    ptrs.push_back(&w);
  }
  Proc gw = Gateway(ptrs, "sticky");
  constexpr int kRollouts = 1000;
  constexpr int kThreads = 100;
  constexpr int kTurns = 3;
  std::atomic<int> ok{0}, failed{0}, spans_bad{0}, mixed{0}, turn_done{0}, first_turns_done{0};
  std::atomic<int> cached_after{0};
  std::mutex first_failure_mu;
  std::string first_failure;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto c = Http(gw);
      std::map<int, std::vector<int32_t>> convo;
      for (int turn = 0; turn < kTurns; ++turn) {
        for (int k = t; k < kRollouts; k += kThreads) {
          if (turn == 0) {
            convo[k] = SharedPrompt(200);
            auto own = Tokens(k, 30, 30000);
            convo[k].insert(convo[k].end(), own.begin(), own.end());
          }
          int status = 0;
          json res = PostJson(*c, "/generate",
                              {{"input_ids", convo[k]},
                               {"routing_key", "wu-" + std::to_string(k)},
                               {"sampling_params", {{"max_new_tokens", 6}}}},
                              &status);
          if (status != 200 || res["meta_info"]["finish_reason"]["type"] != "length") {
            if (failed++ == 0) {
              std::lock_guard<std::mutex> lock(first_failure_mu);
              first_failure = fmt::format("HTTP {}: {}", status, res.dump());
            }
            continue;
          }
          ok++;
          const json& m = res["meta_info"];
          size_t covered = 0;
          for (const json& s : m["weight_versions"]) {
            if (s["start"].get<size_t>() != covered) {
              spans_bad++;
            }
            covered = s["end"].get<size_t>();
          }
          if (covered != m["completion_tokens"].get<size_t>()) {
            spans_bad++;
          }
          mixed += m["weight_versions"].size() > 1;
          if (turn > 0 && m["cached_tokens"].get<size_t>() + 1 >= convo[k].size() - 3) {
            cached_after++;
          }
          for (int32_t id : res["output_ids"].get<std::vector<int32_t>>()) {
            convo[k].push_back(id);
          }
          convo[k].insert(convo[k].end(), {1, 2, 3});
        }
        turn_done++;
        if (turn == 0) {
          first_turns_done++;
        }
      }
    });
  }
  // Update in the middle of the second turn, once every rollout has started.
  while (first_turns_done.load() < kThreads || ok.load() + failed.load() < kRollouts * 3 / 2) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  auto c = Http(gw);
  int status = 0;
  json rep = PostJson(*c, "/weights/update", {{"model_path", "/ckpt/v2"}, {"weight_version", "v2"}},
                      &status);
  for (auto& th : threads) {
    th.join();
  }
  EXPECT_EQ(status, 200) << rep.dump();
  EXPECT_TRUE(rep.value("success", false));
  EXPECT_EQ(failed.load(), 0) << first_failure;
  EXPECT_EQ(ok.load(), kRollouts * kTurns);
  EXPECT_EQ(spans_bad.load(), 0);
  // Running rollouts kept their KV across the update (flush_cache=false).
  EXPECT_GE(cached_after.load(), kRollouts * (kTurns - 1) * 9 / 10);
  for (Proc& w : workers) {
    auto r = Http(w)->Get("/get_model_info");
    EXPECT_EQ(json::parse(r->body)["weight_version"], "v2");
  }
  // A rollout that starts now is salted with the version it started on; an old one is not.
  json res = PostJson(*c, "/generate", {{"input_ids", SharedPrompt(200)}, {"routing_key", "fresh"}},
                      &status);
  ASSERT_EQ(status, 200);
  EXPECT_EQ(res["meta_info"]["cached_tokens"], 0) << "new rollout reused KV from old weights";
  EXPECT_EQ(res["meta_info"]["weight_versions"][0]["version"], "v2");
  std::string m = Metrics(*c);
  EXPECT_NE(m.find("bragg_gateway_weight_version_skew 0"), std::string::npos) << m;
  // Requests in flight across the pause finish on the new weights: their spans show both.
  EXPECT_GE(mixed.load(), 1);
  std::printf("requests with output from two versions: %d\n", mixed.load());
}

}  // namespace
}  // namespace bragg::gateway
