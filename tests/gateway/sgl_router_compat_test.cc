// bragg-gateway as a drop-in for sgl-router (docs/gateway.md, "Drop-in for sgl-router"): the
// worker-management calls RL frameworks make, the fan-out calls, API keys, sgl-router's command
// line, hostile inputs, and weights changed outside the gateway. Drives the real binaries.

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "gateway_test_util.h"

namespace bragg::gateway {
namespace {

using nlohmann::json;

class SglRouterCompatTest : public GatewayTest {
 protected:
  // A gateway started with sgl-router's spellings only (plus a fast health loop).
  Proc SglGateway(std::vector<std::string> args) {
    std::vector<std::string> argv = {BRAGG_GATEWAY,          "--host", "127.0.0.1", "--port", "0",
                                     "--health-interval-ms", "50"};
    argv.insert(argv.end(), args.begin(), args.end());
    return Start(argv);
  }

  // Runs the gateway with `args` and returns its exit code (it must exit within 10 s).
  int ExitCode(std::vector<std::string> args, std::string* output) {
    std::string out = fmt::format("{}/exit-{}", dir_.path(), counter_++);
    int fd = ::open(out.c_str(), O_CREAT | O_WRONLY | O_TRUNC | O_CLOEXEC, 0600);
    UniqueFd owned(fd);
    SpawnOptions so;
    so.stdout_fd = fd;
    so.stderr_fd = fd;
    args.insert(args.begin(), BRAGG_GATEWAY);
    auto child = Spawn(args, so);
    EXPECT_TRUE(child.ok()) << child.status();
    auto exit = child->Wait(std::chrono::seconds(10));
    EXPECT_TRUE(exit.ok()) << exit.status();
    *output = ReadFileToString(out).value_or("");
    return exit.ok() ? exit->exit_code : -1;
  }
};

struct Answer {
  int status = -1;
  std::string body;
  std::string worker;  // "http://" + X-Bragg-Worker
};

Answer Call(httplib::Client& c, const std::string& method, const std::string& path,
            const std::string& body = "", const std::string& key = "") {
  httplib::Headers h;
  if (!key.empty()) {
    h.emplace("Authorization", "Bearer " + key);
  }
  auto r = method == "GET"      ? c.Get(path, h)
           : method == "DELETE" ? c.Delete(path, h)
                                : c.Post(path, h, body, "application/json");
  if (!r) {
    return {};
  }
  std::string worker = r->get_header_value("X-Bragg-Worker");
  return {r->status, r->body, worker.empty() ? "" : "http://" + worker};
}

std::vector<std::string> ListWorkers(httplib::Client& c) {
  json j = json::parse(Call(c, "GET", "/list_workers").body, nullptr, false);
  return j.is_object() ? j["urls"].get<std::vector<std::string>>() : std::vector<std::string>{};
}

Answer Generate(httplib::Client& c, const std::string& key, int n, const std::string& auth = "") {
  std::vector<int32_t> ids;
  for (int i = 0; i < n; ++i) {
    ids.push_back(1 + (static_cast<int>(key.size()) * 31 + i * 7) % 30000);
  }
  json body = {
      {"input_ids", ids}, {"routing_key", key}, {"sampling_params", {{"max_new_tokens", 2}}}};
  return Call(c, "POST", "/generate", body.dump(), auth);
}

std::string Metrics(httplib::Client& c) {
  auto r = c.Get("/metrics");
  return r ? r->body : "";
}

// Polls until `pred` holds (up to ~10 s).
bool Eventually(const std::function<bool()>& pred) {
  for (int i = 0; i < 400; ++i) {
    if (pred()) {
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  return false;
}

TEST_F(SglRouterCompatTest, AddRemoveListWorkersAndHostileInputs) {
  Proc w0 = Worker(), w1 = Worker();
  Proc gw = SglGateway({"--worker-urls", w0.url, "--policy", "manual"});
  auto c = Http(gw);
  EXPECT_EQ(ListWorkers(*c), std::vector<std::string>{w0.url});

  Answer a = Call(*c, "POST", "/add_worker?url=" + w1.url);
  EXPECT_EQ(a.status, 200);
  EXPECT_EQ(a.body, "Successfully added worker: " + w1.url);
  a = Call(*c, "POST", "/add_worker?url=" + w1.url);  // duplicate: idempotent
  EXPECT_EQ(a.status, 200);
  EXPECT_NE(a.body.find("already registered"), std::string::npos) << a.body;
  EXPECT_EQ(ListWorkers(*c), (std::vector<std::string>{w0.url, w1.url}));
  ASSERT_TRUE(WaitHealthy(*c, w1.url, true));

  // Rollouts spread over both; after w1's removal every turn of every rollout lands on w0.
  std::map<std::string, std::string> where;
  for (int k = 0; k < 8; ++k) {
    Answer g = Generate(*c, fmt::format("r{}", k), 40);
    ASSERT_EQ(g.status, 200) << g.body;
    where[fmt::format("r{}", k)] = g.worker;
  }
  int on_w1 = 0;
  for (const auto& [key, url] : where) {
    on_w1 += url == w1.url;
  }
  EXPECT_GT(on_w1, 0) << "the added worker got no rollout";
  a = Call(*c, "POST", "/remove_worker?url=" + w1.url);
  EXPECT_EQ(a.status, 200);
  EXPECT_EQ(a.body, "Successfully removed worker: " + w1.url);
  EXPECT_EQ(ListWorkers(*c), std::vector<std::string>{w0.url});
  for (const auto& [key, url] : where) {
    Answer g = Generate(*c, key, 50);
    EXPECT_EQ(g.status, 200) << g.body;
    EXPECT_EQ(g.worker, w0.url) << key;
  }
  EXPECT_EQ(Call(*c, "POST", "/remove_worker?url=" + w1.url).status, 404);
  // Registered again: a member once more, admitted by the health loop.
  EXPECT_EQ(Call(*c, "POST", "/add_worker?url=" + w1.url).body,
            "Successfully added worker: " + w1.url);
  EXPECT_TRUE(WaitHealthy(*c, w1.url, true));

  // Hostile and malformed calls: refused with 4xx, and the gateway serves on.
  for (const std::string& path :
       {std::string("/add_worker"), std::string("/add_worker?url="),
        std::string("/add_worker?url=http://no-port"), std::string("/add_worker?url=127.0.0.1:0"),
        std::string("/add_worker?url=https://127.0.0.1:1/x"),
        std::string("/add_worker?url=127.0.0.1:99999"),
        std::string("/add_worker?url=127.0.0.1:1&worker_type=prefill"),
        std::string("/add_worker?url=127.0.0.1:1&worker_type=bogus"),
        std::string("/add_worker?url=127.0.0.1:1&bootstrap_port=9000"),
        std::string("/add_worker?url=%zz%"), std::string("/remove_worker"),
        std::string("/remove_worker?url=127.0.0.1:1"), std::string("/remove_worker?url=%00")}) {
    Answer h = Call(*c, "POST", path);
    EXPECT_GE(h.status, 400) << path << " " << h.body;
    EXPECT_LT(h.status, 500) << path << " " << h.body;
  }
  EXPECT_EQ(Call(*c, "GET", "/add_worker?url=" + w1.url).status, 404);  // POST only
  int status = 0;
  PostJson(*c, "/workers", {{"url", "127.0.0.1:1"}, {"worker_type", 7}}, &status);
  EXPECT_EQ(status, 400);
  PostJson(*c, "/workers", {{"url", "127.0.0.1:1"}, {"worker_type", "decode"}}, &status);
  EXPECT_EQ(status, 400) << "a decode worker on a gateway without prefill/decode pairs";
  std::string huge = "/add_worker?url=" + std::string(200000, 'a');
  Answer h = Call(*c, "POST", huge);
  EXPECT_GE(h.status, 400);
  h = Call(*c, "POST", "/add_worker?url=127.0.0.1:1&pad=" + std::string(30000, 'b'));
  EXPECT_EQ(h.status, 200) << "a long but legal query";
  EXPECT_EQ(Call(*c, "POST", "/remove_worker?url=127.0.0.1:1").status, 200);
  EXPECT_EQ(ListWorkers(*c), (std::vector<std::string>{w0.url, w1.url}));
  EXPECT_EQ(Generate(*c, "after", 10).status, 200);
}

// "%XY" for every byte of `s` that is not unreserved (RFC 3986).
std::string PercentEncode(const std::string& s) {
  std::string out;
  for (unsigned char ch : s) {
    if (std::isalnum(ch) || ch == '-' || ch == '.' || ch == '_' || ch == '~') {
      out.push_back(static_cast<char>(ch));
    } else {
      out += fmt::format("%{:02X}", ch);
    }
  }
  return out;
}

// sgl-router's REST worker API: POST/GET /workers, GET/DELETE /workers/{id or url}, /get_loads.
TEST_F(SglRouterCompatTest, WorkersRestApiAndLoads) {
  Proc w0 = Worker({"--decode-us", "200000"}), w1 = Worker();
  Proc gw = SglGateway({"--worker-urls", w0.url});
  auto c = Http(gw);
  json list = json::parse(Call(*c, "GET", "/workers").body, nullptr, false);
  ASSERT_TRUE(list.is_object()) << list;
  EXPECT_EQ(list["total"], 1);
  EXPECT_EQ(list["stats"], json({{"prefill_count", 0}, {"decode_count", 0}, {"regular_count", 1}}));
  const json& first = list["workers"][0];
  for (const char* field : {"id", "url", "model_id", "priority", "cost", "worker_type",
                            "is_healthy", "load", "connection_mode"}) {
    EXPECT_TRUE(first.contains(field)) << field << " " << first;
  }
  EXPECT_EQ(first["url"], w0.url);
  EXPECT_EQ(first["worker_type"], "regular");
  EXPECT_EQ(first["connection_mode"], "Http");
  EXPECT_EQ(first["id"].get<std::string>().size(), 36u) << first;

  // Add by JSON body; sgl-router's extra fields are taken and ignored.
  int status = 0;
  json added = PostJson(*c, "/workers",
                        {{"url", w1.url},
                         {"worker_type", "regular"},
                         {"model_id", "m"},
                         {"priority", 10},
                         {"labels", {{"tier", "gold"}}},
                         {"api_key", nullptr}},
                        &status);
  EXPECT_EQ(status, 200) << added;
  EXPECT_EQ(added["status"], "accepted");
  EXPECT_EQ(added["url"], w1.url);
  EXPECT_EQ(added["added"], true);
  std::string id = added["worker_id"].get<std::string>();
  EXPECT_EQ(added["location"], "/workers/" + id);
  EXPECT_EQ(PostJson(*c, "/workers", {{"url", w1.url}}, &status)["added"], false);
  EXPECT_EQ(status, 200) << "adding a member again is idempotent";
  ASSERT_TRUE(WaitHealthy(*c, w1.url, true));
  // One worker, three spellings of its key: the id, the url-encoded url, the raw url.
  for (const std::string& key : {id, PercentEncode(w1.url), w1.url}) {
    Answer a = Call(*c, "GET", "/workers/" + key);
    ASSERT_EQ(a.status, 200) << key << " " << a.body;
    json w = json::parse(a.body);
    EXPECT_EQ(w["id"], id);
    EXPECT_EQ(w["url"], w1.url);
    EXPECT_EQ(w["is_healthy"], true);
  }

  // /get_loads: sgl-router's {"workers": [{"worker", "load"}]}, the load in flight requests.
  std::thread slow([&] { Generate(*Http(gw), "slow", 20); });
  bool busy = Eventually([&] {
    json l = json::parse(Call(*c, "GET", "/get_loads").body, nullptr, false);
    if (!l.is_object() || l["workers"].size() != 2) {
      return false;
    }
    int64_t total = 0;
    for (const json& x : l["workers"]) {
      total += x["load"].get<int64_t>();
    }
    return total == 1;
  });
  slow.join();
  EXPECT_TRUE(busy) << Call(*c, "GET", "/get_loads").body;
  json loads = json::parse(Call(*c, "GET", "/get_loads").body);
  EXPECT_EQ(loads["workers"][0]["worker"], w0.url);
  EXPECT_EQ(loads["workers"][1]["worker"], w1.url);
  EXPECT_EQ(loads["workers"][0]["load"], 0);

  // Removal by url-encoded url; a second removal and an unknown worker: 404 in sgl-router's shape.
  Answer d = Call(*c, "DELETE", "/workers/" + PercentEncode(w1.url));
  EXPECT_EQ(d.status, 200) << d.body;
  EXPECT_EQ(json::parse(d.body)["worker_id"], id);
  EXPECT_EQ(ListWorkers(*c), std::vector<std::string>{w0.url});
  for (const char* method : {"DELETE", "GET"}) {
    for (const std::string& key : {id, PercentEncode(w1.url), std::string("127.0.0.1:1"),
                                   std::string("00000000-0000-0000-0000-000000000000")}) {
      Answer gone = Call(*c, method, "/workers/" + key);
      EXPECT_EQ(gone.status, 404) << method << " " << key << " " << gone.body;
      json e = json::parse(gone.body, nullptr, false);
      EXPECT_EQ(e.value("code", ""), "WORKER_NOT_FOUND") << gone.body;
      EXPECT_TRUE(e["error"].is_string()) << gone.body;
    }
  }
  // Added again, removed by id.
  id = PostJson(*c, "/workers", {{"url", w1.url}}, &status)["worker_id"].get<std::string>();
  EXPECT_EQ(Call(*c, "DELETE", "/workers/" + id).status, 200);
  EXPECT_EQ(ListWorkers(*c), std::vector<std::string>{w0.url});

  // Hostile bodies and paths: 4xx, and the gateway serves on.
  for (const std::string& body :
       {std::string("not json"), std::string("[]"), std::string("{}"), std::string("{\"url\": 7}"),
        std::string("{\"url\": \"\"}"), std::string("{\"url\": \"127.0.0.1:0\"}"),
        std::string("{\"url\": \"127.0.0.1:1\", \"worker_type\": 3}"),
        std::string("{\"url\": \"127.0.0.1:1\", \"worker_type\": \"bogus\"}"),
        std::string("{\"url\": \"127.0.0.1:1\", \"bootstrap_port\": \"9\"}"),
        std::string("{\"url\": \"127.0.0.1:1\", \"api_key\": \"other\"}"),
        std::string("{\"url\": \"127.0.0.1:1\", \"api_key\": 5}")}) {
    Answer h = Call(*c, "POST", "/workers", body);
    EXPECT_EQ(h.status, 400) << body << " " << h.body;
  }
  for (const std::string& path :
       {std::string("/workers/%zz"), std::string("/workers/%0"), std::string("/workers/a%00b")}) {
    EXPECT_EQ(Call(*c, "GET", path).status, 400) << path;
    EXPECT_EQ(Call(*c, "DELETE", path).status, 400) << path;
  }
  EXPECT_EQ(Call(*c, "DELETE", "/workers").status, 404);
  EXPECT_EQ(Call(*c, "DELETE", "/workers/").status, 404);
  EXPECT_EQ(Call(*c, "GET", "/workers/" + std::string(5000, 'x')).status, 404);
  EXPECT_EQ(Call(*c, "GET", "/workers/" + std::string(100000, 'x')).status, 413);
  // sgl-router 0.3.2 serves neither /server_info nor /model_info (its /get_* only).
  EXPECT_EQ(Call(*c, "GET", "/server_info").status, 404);
  EXPECT_EQ(Call(*c, "GET", "/model_info").status, 404);
  EXPECT_EQ(ListWorkers(*c), std::vector<std::string>{w0.url});
  EXPECT_EQ(Generate(*c, "after", 10).status, 200);

  // Concurrent adds and removals of one worker: every answer 200 or 404, none lost.
  std::atomic<int> bad{0};
  std::vector<std::thread> admins;
  for (int t = 0; t < 4; ++t) {
    admins.emplace_back([&] {
      auto a = Http(gw);
      for (int i = 0; i < 25; ++i) {
        int s = 0;
        PostJson(*a, "/workers", {{"url", w1.url}}, &s);
        int r = Call(*a, "DELETE", "/workers/" + PercentEncode(w1.url)).status;
        bad += s != 200 || (r != 200 && r != 404);
      }
    });
  }
  for (auto& t : admins) {
    t.join();
  }
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(ListWorkers(*c), std::vector<std::string>{w0.url});
  EXPECT_EQ(Generate(*c, "end", 10).status, 200);
}

TEST_F(SglRouterCompatTest, PrefillDecodeWorkersWithBootstrapPorts) {
  Proc p0 = Worker(), p1 = Worker(), d0 = Worker();
  // sgl-router's command line: --prefill URL PORT, --prefill URL none, --decode URL.
  Proc gw = SglGateway({"--pd-disaggregation", "--prefill", p0.url, "9101", "--decode", d0.url});
  auto c = Http(gw);
  Answer g = Generate(*c, "a", 20);
  ASSERT_EQ(g.status, 200) << g.body;
  // The prefill half is a side call: it may reach its worker after the client's answer.
  auto prefill_port_is = [](const Proc& w, int port) {
    return WaitStats(w, [port](const json& s) {
      return s["last_request"].is_object() &&
             s["last_request"].value("bootstrap_port", -1) == port &&
             s["last_request"].value("bootstrap_host", "") == "127.0.0.1";
    });
  };
  EXPECT_TRUE(prefill_port_is(p0, 9101)) << SimStats(p0);

  // Run-time registration: a regular worker is refused, a prefill worker takes its own port.
  EXPECT_EQ(Call(*c, "POST", "/add_worker?url=" + p1.url).status, 400);
  EXPECT_EQ(
      Call(*c, "POST", "/add_worker?url=" + p1.url + "&worker_type=decode&bootstrap_port=1").status,
      400);
  EXPECT_EQ(Call(*c, "POST", "/add_worker?url=" + d0.url + "&worker_type=prefill").status, 400)
      << "one url in two pools";
  Answer a =
      Call(*c, "POST", "/add_worker?url=" + p1.url + "&worker_type=prefill&bootstrap_port=9202");
  EXPECT_EQ(a.status, 200) << a.body;
  ASSERT_TRUE(WaitHealthy(*c, p1.url, true));
  EXPECT_EQ(Call(*c, "POST", "/remove_worker?url=" + p0.url).status, 200);
  g = Generate(*c, "b", 20);
  ASSERT_EQ(g.status, 200) << g.body;
  EXPECT_TRUE(prefill_port_is(p1, 9202)) << SimStats(p1);
  json workers = WorkerList(*c);
  bool listed = false;
  for (const json& w : workers) {
    if (w["url"] == p1.url) {
      listed = true;
      EXPECT_EQ(w["pool"], "prefill");
      EXPECT_EQ(w["bootstrap_port"], 9202);
    }
  }
  EXPECT_TRUE(listed) << workers.dump();
  EXPECT_EQ(ListWorkers(*c), (std::vector<std::string>{p1.url, d0.url}));

  // An empty prefill/decode gateway filled through POST /workers (Bragg's) and /add_worker.
  Proc empty = SglGateway({"--pd-disaggregation"});
  auto e = Http(empty);
  EXPECT_EQ(Generate(*e, "c", 5).status, 503);
  int status = 0;
  PostJson(*e, "/workers", {{"url", p0.url}, {"worker_type", "prefill"}, {"bootstrap_port", 9303}},
           &status);
  EXPECT_EQ(status, 200);
  EXPECT_EQ(Call(*e, "POST", "/add_worker?url=" + d0.url + "&worker_type=decode").status, 200);
  ASSERT_TRUE(WaitHealthy(*e, p0.url, true));
  ASSERT_TRUE(WaitHealthy(*e, d0.url, true));
  g = Generate(*e, "d", 20);
  ASSERT_EQ(g.status, 200) << g.body;
  EXPECT_TRUE(prefill_port_is(p0, 9303)) << SimStats(p0);
}

TEST_F(SglRouterCompatTest, ModelsServerInfoAndFlushCacheFanOut) {
  Proc w0 = Worker({"--model-path", "m-a"}), w1 = Worker({"--model-path", "m-a"});
  Proc gw = SglGateway({"--worker-urls", w0.url, w1.url});
  auto c = Http(gw);
  json models = json::parse(Call(*c, "GET", "/v1/models").body, nullptr, false);
  ASSERT_TRUE(models.is_object()) << models;
  EXPECT_EQ(models["data"][0]["id"], "m-a");
  json model_info = json::parse(Call(*c, "GET", "/get_model_info").body, nullptr, false);
  EXPECT_EQ(model_info["model_path"], "m-a");
  json info = json::parse(Call(*c, "GET", "/get_server_info").body, nullptr, false);
  ASSERT_TRUE(info.is_object());
  EXPECT_EQ(info["weight_version"], "0");
  ASSERT_EQ(info["bragg_workers"].size(), 2u) << info;
  EXPECT_EQ(info["bragg_workers"][1]["info"]["model_path"], "m-a");

  Answer f = Call(*c, "POST", "/flush_cache");
  EXPECT_EQ(f.status, 200) << f.body;
  json fj = json::parse(f.body);
  EXPECT_EQ(fj["status"], "success");
  EXPECT_EQ(fj["workers_flushed"], 2);
  EXPECT_EQ(SimStats(w0)["flushes"], 1);
  EXPECT_EQ(SimStats(w1)["flushes"], 1);

  ASSERT_TRUE(w1.child.Signal(SIGKILL).ok());
  ASSERT_TRUE(w1.child.Wait(std::chrono::seconds(5)).ok());
  f = Call(*c, "POST", "/flush_cache");
  EXPECT_EQ(f.status, 206) << f.body;
  fj = json::parse(f.body);
  EXPECT_EQ(fj["status"], "partial_success");
  EXPECT_EQ(fj["failed"][0]["worker"], w1.url);
  EXPECT_EQ(fj["successful"][0], w0.url);
  info = json::parse(Call(*c, "GET", "/get_server_info").body, nullptr, false);
  EXPECT_EQ(info["bragg_workers"][1].value("status", -1), 0) << info;

  Proc none = SglGateway({});
  auto n = Http(none);
  EXPECT_EQ(Call(*n, "GET", "/v1/models").status, 503);
  EXPECT_EQ(Call(*n, "POST", "/flush_cache").status, 503);
  EXPECT_EQ(Call(*n, "GET", "/get_server_info").status, 503);
}

TEST_F(SglRouterCompatTest, ApiKeysAreCheckedAndForwarded) {
  Proc w0 = Worker({"--api-key", "wk"}), w1 = Worker({"--api-key", "wk"});
  Proc gw = SglGateway({"--worker-urls", w0.url, "--api-key", "gk", "--worker-api-key", "wk"});
  auto c = Http(gw);
  EXPECT_EQ(Generate(*c, "a", 10).status, 401);
  EXPECT_EQ(Generate(*c, "a", 10, "wrong").status, 401);
  EXPECT_EQ(Generate(*c, "a", 10, "gk-longer").status, 401);
  EXPECT_EQ(Call(*c, "POST", "/add_worker?url=" + w1.url).status, 401);
  EXPECT_EQ(Call(*c, "GET", "/list_workers").status, 401);
  EXPECT_EQ(Call(*c, "GET", "/workers").status, 401);
  EXPECT_EQ(Call(*c, "POST", "/workers", json{{"url", w1.url}}.dump()).status, 401);
  EXPECT_EQ(Call(*c, "GET", "/workers/" + w0.url).status, 401);
  EXPECT_EQ(Call(*c, "DELETE", "/workers/" + w0.url, "", "wrong").status, 401);
  EXPECT_EQ(Call(*c, "GET", "/get_loads").status, 401);
  EXPECT_EQ(Call(*c, "GET", "/workers/" + w0.url, "", "gk").status, 200);
  EXPECT_EQ(Call(*c, "GET", "/get_loads", "", "gk").status, 200);
  EXPECT_EQ(Call(*c, "GET", "/health").status, 200);
  EXPECT_EQ(Call(*c, "GET", "/metrics").status, 200);
  Answer g = Generate(*c, "a", 10, "gk");
  EXPECT_EQ(g.status, 200) << g.body;
  // Added at run time: admitted only if the health loop's version check carried the key too.
  EXPECT_EQ(Call(*c, "POST", "/add_worker?url=" + w1.url, "", "gk").status, 200);
  ASSERT_TRUE(Eventually([&] {
    for (const json& w : WorkerList(*c, {{"Authorization", "Bearer gk"}})) {
      if (w["url"] == w1.url && w["healthy"] == true) {
        return true;
      }
    }
    return false;
  }));
  EXPECT_EQ(Call(*c, "POST", "/flush_cache", "", "gk").status, 200);
  EXPECT_EQ(Call(*c, "GET", "/v1/models").status, 200);
  for (const Proc* w : {&w0, &w1}) {
    json s = SimStats(*w);
    EXPECT_EQ(s["unauthorized"], 0) << s;
    EXPECT_EQ(s["last_authorization"], "Bearer wk") << s;
  }
  // sgl-router's --api-key alone: the same key both ways.
  Proc same = SglGateway({"--worker-urls", w0.url, "--api-key", "wk"});
  auto s = Http(same);
  EXPECT_EQ(Generate(*s, "b", 10, "wk").status, 200);
  EXPECT_EQ(Generate(*s, "b", 10).status, 401);
  // Without a key for the workers, they refuse the gateway, and their 401 reaches the client.
  Proc keyless = SglGateway({"--worker-urls", w0.url});
  EXPECT_EQ(Generate(*Http(keyless), "c", 10).status, 401);
  EXPECT_GT(SimStats(w0)["unauthorized"].get<int>(), 0);
}

TEST_F(SglRouterCompatTest, SglRouterCommandLine) {
  std::string out;
  EXPECT_EQ(ExitCode({"--policy", "random", "--port", "0"}, &out), 2);
  EXPECT_NE(out.find("no counterpart"), std::string::npos) << out;
  EXPECT_EQ(ExitCode({"--prefill", "9000", "--port", "0"}, &out), 2);
  EXPECT_NE(out.find("must follow a url"), std::string::npos) << out;
  EXPECT_EQ(ExitCode({"--prefill", "127.0.0.1:1", "70000", "--port", "0"}, &out), 2);
  EXPECT_NE(ExitCode({"--prefill", "127.0.0.1:1", "--port", "0"}, &out), 0)
      << "prefill without decode and without --pd-disaggregation";
  EXPECT_NE(out.find("--pd-disaggregation"), std::string::npos) << out;
  EXPECT_NE(ExitCode({"--worker-urls", "127.0.0.1:1", "--pd-disaggregation", "--port", "0"}, &out),
            0);
  // Bragg's own spellings and sgl-router's mapped policies still start.
  Proc w0 = Worker();
  for (const char* policy : {"power_of_two", "manual", "cache_aware", "sgl_cache_aware"}) {
    Proc gw = SglGateway({"--worker-urls", w0.url, "--policy", policy});
    EXPECT_EQ(Generate(*Http(gw), "p", 5).status, 200) << policy;
  }
  EXPECT_NE(ExitCode({"--listen", "127.0.0.1:0", "--worker", w0.url, "--prefill", w0.url,
                      "--decode", w0.url},
                     &out),
            0)
      << "--worker mixed with prefill/decode workers must be refused";
  EXPECT_NE(out.find("cannot be mixed"), std::string::npos) << out;
}

// A framework pushes weights to the workers itself (update_weights_from_distributed), one worker
// after another: no worker leaves rotation for it, and once all agree the fleet follows.
TEST_F(SglRouterCompatTest, WeightsChangedOutsideTheGateway) {
  Proc w0 = Worker(), w1 = Worker(), w2 = Worker();
  Proc gw = SglGateway({"--worker-urls", w0.url, w1.url, w2.url});
  auto c = Http(gw);
  auto push = [](const Proc& w, const std::string& version) {
    int status = 0;
    PostJson(*Http(w), "/update_weights_from_distributed",
             {{"names", {"w"}}, {"weight_version", version}}, &status);
    return status;
  };
  ASSERT_EQ(push(w0, "v1"), 200);
  // w0 runs ahead, w1 and w2 lag behind: all three keep serving.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  for (const Proc* w : {&w0, &w1, &w2}) {
    EXPECT_TRUE(Healthy(*c, w->url)) << w->url;
  }
  EXPECT_NE(Metrics(*c).find("bragg_gateway_weight_version_skew 1"), std::string::npos);
  // A worker that restarts mid-push on the new weights comes back (w0 serves them too), one on
  // weights nobody serves stays out.
  Proc late = Worker({"--weight-version", "v1"}), stale = Worker({"--weight-version", "v9"});
  EXPECT_EQ(Call(*c, "POST", "/add_worker?url=" + late.url).status, 200);
  EXPECT_EQ(Call(*c, "POST", "/add_worker?url=" + stale.url).status, 200);
  EXPECT_TRUE(WaitHealthy(*c, late.url, true));
  ASSERT_EQ(push(w1, "v1"), 200);
  ASSERT_EQ(push(w2, "v1"), 200);
  EXPECT_TRUE(Eventually([&] {
    return Metrics(*c).find("bragg_gateway_weight_updates_total{result=\"external\"} 1") !=
           std::string::npos;
  })) << Metrics(*c);
  for (const Proc* w : {&w0, &w1, &w2, &late}) {
    EXPECT_TRUE(Healthy(*c, w->url)) << w->url;
  }
  EXPECT_FALSE(Healthy(*c, stale.url));
  // New rollouts are salted with the version learnt, so they never meet KV of older weights.
  Answer g = Generate(*c, "new-rollout", 30);
  ASSERT_EQ(g.status, 200) << g.body;
  for (const Proc* w : {&w0, &w1, &w2, &late}) {
    if (w->url == g.worker) {
      EXPECT_EQ(SimStats(*w)["last_request"].value("extra_key", ""), "wv:v1");
    }
  }
  EXPECT_NE(Metrics(*c).find("bragg_gateway_weight_version_skew 0"), std::string::npos);
  EXPECT_TRUE(StaysOut(*c, stale.url, 300));
}

// Workers come and go while rollouts run: every request is answered, none by a removed worker
// after its removal returned.
TEST_F(SglRouterCompatTest, AddsAndRemovesWhileRequestsAreInFlight) {
  Proc w0 = Worker({"--decode-us", "2000"}), w1 = Worker({"--decode-us", "2000"}),
       churn = Worker({"--decode-us", "2000"});
  Proc gw = SglGateway({"--worker-urls", w0.url, w1.url});
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, failed{0};
  std::vector<std::thread> clients;
  for (int t = 0; t < 4; ++t) {
    clients.emplace_back([&, t] {
      auto c = Http(gw);
      for (int i = 0; !stop.load() && i < 60; ++i) {
        Answer g = Generate(*c, fmt::format("c{}-{}", t, i % 6), 30 + i);
        (g.status == 200 ? ok : failed)++;
      }
    });
  }
  auto admin = Http(gw);
  for (int round = 0; round < 15; ++round) {
    EXPECT_EQ(Call(*admin, "POST", "/add_worker?url=" + churn.url).status, 200);
    std::this_thread::sleep_for(std::chrono::milliseconds(60));
    EXPECT_EQ(Call(*admin, "POST", "/remove_worker?url=" + churn.url).status, 200);
  }
  for (auto& t : clients) {
    t.join();
  }
  stop = true;
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(ok.load(), 240);
  EXPECT_EQ(ListWorkers(*admin), (std::vector<std::string>{w0.url, w1.url}));
  // Removed for good: no request reaches it any more.
  uint64_t before = SimStats(churn)["requests"].get<uint64_t>();
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(Generate(*admin, fmt::format("c0-{}", i), 20).status, 200);
  }
  EXPECT_EQ(SimStats(churn)["requests"].get<uint64_t>(), before);
}

}  // namespace
}  // namespace bragg::gateway
