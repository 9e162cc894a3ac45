#include "engine/server/server.h"

#include <absl/strings/escaping.h>
#include <absl/strings/str_cat.h>
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <thread>

#include "common/unique_fd.h"

namespace bragg::engine {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

constexpr int kVocab = 1000;
constexpr int kExperts = 8;
constexpr int kTopK = 2;
const std::vector<int> kMoeLayers = {0, 2};

// Token n of a request: a function of its prompt only.
int32_t FakeToken(const std::vector<int32_t>& prompt, size_t n) {
  int64_t sum = 0;
  for (int32_t t : prompt) {
    sum += t;
  }
  return static_cast<int32_t>((sum + 7 * static_cast<int64_t>(n) + 1) % kVocab);
}

class FakeEngine;

// A request of the fake: one token per Wait call while the engine is not held.
class FakeStream : public RequestStream {
 public:
  FakeStream(FakeEngine* engine, GenerateRequest request)
      : engine_(engine), request_(std::move(request)) {}
  GenerateOutput Wait(size_t seen, std::chrono::milliseconds timeout) override;
  void Cancel() override;
  const std::string& rid() const override { return request_.rid; }

 private:
  friend class FakeEngine;
  void StepLocked();
  FakeEngine* engine_;
  GenerateRequest request_;
  GenerateOutput out_;
};

class FakeEngine : public Engine {
 public:
  Result<std::shared_ptr<RequestStream>> Submit(GenerateRequest request) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (submit_error_) {
      return *submit_error_;
    }
    for (size_t i = 0; i < request.input_ids.size(); ++i) {
      if (request.input_ids[i] >= kVocab) {
        return absl::InvalidArgumentError(absl::StrCat(
            "input_ids[", i, "] = ", request.input_ids[i], " is outside the vocabulary"));
      }
    }
    if (request.rid.empty()) {
      request.rid = absl::StrCat("fake-", next_rid_++);
    }
    for (auto& s : streams_) {
      if (!s->out_.finished() && s->request_.rid == request.rid) {
        return absl::InvalidArgumentError("duplicate rid " + request.rid);
      }
    }
    auto s = std::make_shared<FakeStream>(this, request);
    GenerateOutput& o = s->out_;
    o.rid = request.rid;
    o.prompt_tokens = static_cast<int64_t>(request.input_ids.size());
    o.cached_tokens = request.input_ids.size() > 1 ? 1 : 0;
    o.weight_version = version_;
    if (request.logprob_start_len >= 0) {
      for (size_t i = request.logprob_start_len; i < request.input_ids.size(); ++i) {
        o.input_logprobs.push_back(i == 0 ? std::nanf("") : -0.5f);
      }
    }
    if (request.sampling.max_new_tokens == 0) {
      o.finish = FinishReason::kLength;
    }
    last_request_ = request;
    streams_.push_back(s);
    submitted_++;
    cv_.notify_all();
    return std::shared_ptr<RequestStream>(s);
  }
  Status Abort(std::string_view rid) override {
    std::lock_guard<std::mutex> lock(mu_);
    aborted_rids_.emplace_back(rid);
    for (auto& s : streams_) {
      if (!s->out_.finished() && s->request_.rid == rid) {
        FinishLocked(*s, "aborted by /abort_request");
        return absl::OkStatus();
      }
    }
    return absl::NotFoundError("no running or queued request has rid " + std::string(rid));
  }
  void AbortAll() override {
    std::lock_guard<std::mutex> lock(mu_);
    abort_all_calls_++;
    AbortAllLocked("aborted");
  }
  Status Pause(PauseMode mode) override {
    std::lock_guard<std::mutex> lock(mu_);
    pauses_.push_back(mode);
    paused_ = true;
    if (mode == PauseMode::kAbort) {
      AbortAllLocked("paused");
    }
    return absl::OkStatus();
  }
  Status Continue() override {
    std::lock_guard<std::mutex> lock(mu_);
    paused_ = false;
    cv_.notify_all();
    return absl::OkStatus();
  }
  Status UpdateWeightsFromDisk(const std::string& dir, const std::string& version,
                               bool flush) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (fail_update_) {
      return absl::InvalidArgumentError("cannot load " + dir + ": model.safetensors is missing");
    }
    version_ = version;
    model_path_ = dir;
    update_flushes_.push_back(flush);
    return absl::OkStatus();
  }
  Status FlushCache() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (RunningLocked() > 0) {
      return absl::FailedPreconditionError(
          "requests are running; flush_cache needs an idle engine");
    }
    flushes_++;
    return absl::OkStatus();
  }
  ModelInfo model_info() const override {
    std::lock_guard<std::mutex> lock(mu_);
    ModelInfo m;
    m.model_path = model_path_;
    m.served_model_name = "fake-moe";
    m.architecture = "Qwen3MoeForCausalLM";
    m.vocab_size = kVocab;
    m.context_length = 4096;
    m.num_layers = 3;
    m.num_experts = kExperts;
    m.experts_per_token = kTopK;
    m.moe_layers = kMoeLayers;
    m.eos_token_ids = {999};
    m.dtype = "float32";
    m.device = "cpu";
    return m;
  }
  EngineStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    EngineStats s;
    s.running = RunningLocked();
    s.kv_tokens_capacity = 1 << 16;
    s.kv_tokens_used = 16 * s.running;
    s.prompt_tokens_total = 100;
    s.cached_tokens_total = 25;
    s.generation_tokens_total = 7;
    s.requests_total = submitted_;
    s.paused = paused_;
    s.weight_version = version_;
    return s;
  }

  // Test controls and records.
  void Hold(bool hold) {
    std::lock_guard<std::mutex> lock(mu_);
    hold_ = hold;
    cv_.notify_all();
  }
  // Waits (10 s at most) until `pred` holds under the engine's lock.
  bool WaitFor(const std::function<bool()>& pred) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, 10s, pred);
  }
  std::mutex& mu() { return mu_; }

  int submitted_ = 0;
  std::vector<std::string> cancelled_;
  std::vector<std::string> aborted_rids_;
  int abort_all_calls_ = 0;
  std::vector<PauseMode> pauses_;
  std::vector<bool> update_flushes_;
  int flushes_ = 0;
  bool fail_update_ = false;
  std::optional<Status> submit_error_;
  GenerateRequest last_request_;
  std::string version_ = "v0";

 private:
  friend class FakeStream;
  int64_t RunningLocked() const {
    int64_t n = 0;
    for (auto& s : streams_) {
      n += s->out_.finished() ? 0 : 1;
    }
    return n;
  }
  void FinishLocked(FakeStream& s, const std::string& why) {
    s.out_.finish = FinishReason::kAbort;
    s.out_.finish_message = why;
    cv_.notify_all();
  }
  void AbortAllLocked(const std::string& why) {
    for (auto& s : streams_) {
      if (!s->out_.finished()) {
        FinishLocked(*s, why);
      }
    }
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<FakeStream>> streams_;
  bool hold_ = false;
  bool paused_ = false;
  int next_rid_ = 0;
  std::string model_path_ = "/models/fake";
};

void FakeStream::StepLocked() {
  const GenerateRequest& r = request_;
  size_t n = out_.output_ids.size();
  int32_t token = FakeToken(r.input_ids, n);
  out_.output_ids.push_back(token);
  out_.output_logprobs.push_back(-0.25f * static_cast<float>(n + 1));
  out_.weight_version = engine_->version_;
  out_.weight_versions = {{engine_->version_, 0, static_cast<int64_t>(n + 1)}};
  const auto& stops = r.sampling.stop_token_ids;
  std::optional<std::string> matched;
  if (std::find(stops.begin(), stops.end(), token) != stops.end()) {
    out_.finish = FinishReason::kStop;
    out_.matched_stop = token;
  } else if (r.stop_check && (matched = r.stop_check(out_.output_ids))) {
    out_.finish = FinishReason::kStop;  // as the engine: checked after each token
    out_.matched_stop_string = std::move(matched);
  } else if (static_cast<int64_t>(n + 1) >= r.sampling.max_new_tokens) {
    out_.finish = FinishReason::kLength;
  }
  if (out_.finished() && r.return_routed_experts) {
    int64_t end = static_cast<int64_t>(r.input_ids.size() + out_.output_ids.size()) - 1;
    for (int64_t p = r.routed_experts_start_len; p < end; ++p) {
      for (size_t l = 0; l < kMoeLayers.size(); ++l) {
        for (int k = 0; k < kTopK; ++k) {
          out_.routed_experts.push_back(static_cast<int32_t>((p + l + k) % kExperts));
        }
      }
    }
  }
}

GenerateOutput FakeStream::Wait(size_t seen, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(engine_->mu_);
  engine_->cv_.wait_for(lock, timeout,
                        [&] { return out_.finished() || (!engine_->hold_ && !engine_->paused_); });
  if (!out_.finished() && !engine_->hold_ && !engine_->paused_ && out_.output_ids.size() <= seen) {
    StepLocked();
  }
  return out_;
}

void FakeStream::Cancel() {
  std::lock_guard<std::mutex> lock(engine_->mu_);
  engine_->cancelled_.push_back(request_.rid);
  if (!out_.finished()) {
    engine_->FinishLocked(*this, "cancelled");
  }
  engine_->cv_.notify_all();
}

// A byte-level tokenizer: id b is the byte b (GPT-2's byte-to-character table), and ChatML's two
// tokens are 256 and 257. No merges: the text's bytes are its ids.
std::unique_ptr<Tokenizer> ByteTokenizer() {
  json vocab = json::object();
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    bool keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    int c = keep ? b : 256 + extra++;
    std::string utf8 = c < 0x80 ? std::string(1, static_cast<char>(c))
                                : std::string{static_cast<char>(0xC0 | (c >> 6)),
                                              static_cast<char>(0x80 | (c & 0x3F))};
    vocab[utf8] = b;
  }
  json doc = {
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}},
      {"added_tokens", json::array({{{"id", 256}, {"content", "<|im_start|>"}, {"special", true}},
                                    {{"id", 257}, {"content", "<|im_end|>"}, {"special", true}}})}};
  auto t = Tokenizer::FromJson(doc.dump(), "byte tokenizer");
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *std::move(t) : nullptr;
}

class ServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // A write to a client that hung up must fail with EPIPE, not kill the test.
    std::signal(SIGPIPE, SIG_IGN);
    Start({});
  }
  void Start(ServerOptions options) {
    server_.reset();
    options.heartbeat = 20ms;
    server_ = std::make_unique<Server>(engine_, options);
    ASSERT_TRUE(server_->Start().ok());
    client_ = std::make_unique<httplib::Client>("127.0.0.1", server_->port());
    client_->set_read_timeout(30, 0);
  }
  // Start with the byte tokenizer (ByteTokenizer) in `options`.
  void StartWithByteTokenizer(ServerOptions options = {}) {
    tokenizer_ = ByteTokenizer();
    ASSERT_NE(tokenizer_, nullptr);
    options.tokenizer = tokenizer_.get();
    Start(options);
  }
  httplib::Result Post(const std::string& path, const json& body) {
    return client_->Post(path.c_str(), body.dump(), "application/json");
  }
  httplib::Result PostRaw(const std::string& path, const std::string& body) {
    return client_->Post(path.c_str(), body, "application/json");
  }
  json PostOk(const std::string& path, const json& body) {
    auto res = Post(path, body);
    EXPECT_TRUE(res) << path;
    if (!res) {
      return nullptr;
    }
    EXPECT_EQ(res->status, 200) << path << ": " << res->body;
    return json::parse(res->body, nullptr, false);
  }
  static std::string ErrorMessage(const httplib::Result& res) {
    json body = json::parse(res->body, nullptr, false);
    if (body.is_object() && body.contains("error")) {
      return body["error"].value("message", "");
    }
    if (body.is_object() && body.contains("message")) {
      return body["message"].get<std::string>();
    }
    return res->body;
  }

  FakeEngine engine_;
  std::unique_ptr<Tokenizer> tokenizer_;  // before server_: the server points at it
  std::unique_ptr<Server> server_;
  std::unique_ptr<httplib::Client> client_;
};

// A client socket speaking raw HTTP, to hang up at a chosen moment.
UniqueFd SendRaw(int port, const std::string& path, const std::string& body) {
  UniqueFd fd(socket(AF_INET, SOCK_STREAM, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  std::string req = "POST " + path +
                    " HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                    "Content-Length: " +
                    std::to_string(body.size()) + "\r\n\r\n" + body;
  EXPECT_EQ(send(fd.get(), req.data(), req.size(), 0), static_cast<ssize_t>(req.size()));
  return fd;
}

// Reads until `needle` has arrived (10 s at most).
std::string ReadUntil(int fd, const std::string& needle) {
  std::string got;
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (got.find(needle) == std::string::npos && std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) {
      continue;
    }
    char buf[4096];
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) {
      break;
    }
    got.append(buf, static_cast<size_t>(n));
  }
  return got;
}

std::vector<json> SseEvents(const std::string& body, bool* done) {
  std::vector<json> events;
  *done = false;
  size_t pos = 0;
  while ((pos = body.find("data: ", pos)) != std::string::npos) {
    size_t end = body.find("\n\n", pos);
    std::string payload = body.substr(pos + 6, end - pos - 6);
    if (payload == "[DONE]") {
      *done = true;
      EXPECT_EQ(end + 2, body.size()) << "nothing may follow [DONE]";
    } else {
      events.push_back(json::parse(payload));
    }
    pos = end;
  }
  return events;
}

TEST_F(ServerTest, GenerateAnswersSglangShapes) {
  json out = PostOk("/generate", {{"input_ids", {1, 2, 3}},
                                  {"rid", "r1"},
                                  {"sampling_params",
                                   {{"max_new_tokens", 4},
                                    {"temperature", 0},
                                    {"top_p", 0.9},
                                    {"top_k", 20},
                                    {"min_p", 0.05},
                                    {"sampling_seed", 42},
                                    {"ignore_eos", true}}},
                                  {"return_logprob", true},
                                  {"logprob_start_len", 0},
                                  {"return_routed_experts", true},
                                  {"routed_experts_start_len", 1},
                                  {"extra_key", "salt"}});
  ASSERT_TRUE(out.is_object());
  EXPECT_EQ(out["text"], "");
  std::vector<int32_t> prompt = {1, 2, 3};
  std::vector<int32_t> want;
  for (size_t i = 0; i < 4; ++i) {
    want.push_back(FakeToken(prompt, i));
  }
  EXPECT_EQ(out["output_ids"].get<std::vector<int32_t>>(), want);
  const json& meta = out["meta_info"];
  EXPECT_EQ(meta["id"], "r1");
  EXPECT_EQ(meta["prompt_tokens"], 3);
  EXPECT_EQ(meta["completion_tokens"], 4);
  EXPECT_EQ(meta["cached_tokens"], 1);
  EXPECT_EQ(meta["finish_reason"], json({{"type", "length"}, {"length", 4}}));
  EXPECT_EQ(meta["weight_version"], "v0");
  EXPECT_EQ(meta["weight_versions"], json::parse(R"([{"version":"v0","start":0,"end":4}])"));
  EXPECT_TRUE(meta["e2e_latency"].is_number());
  EXPECT_GE(meta["e2e_latency"].get<double>(), 0.0);
  ASSERT_EQ(meta["output_token_logprobs"].size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    const json& e = meta["output_token_logprobs"][i];
    EXPECT_FLOAT_EQ(e[0].get<float>(), -0.25f * static_cast<float>(i + 1));
    EXPECT_EQ(e[1], want[i]);
    EXPECT_TRUE(e[2].is_null());
  }
  const json& in = meta["input_token_logprobs"];
  ASSERT_EQ(in.size(), 3u);
  EXPECT_TRUE(in[0][0].is_null()) << "the first prompt token has no logprob";
  EXPECT_EQ(in[0][1], 1);
  EXPECT_FLOAT_EQ(in[2][0].get<float>(), -0.5f);
  EXPECT_EQ(in[2][1], 3);
  // positions [1, 3 + 4 - 1) x 2 MoE layers x top-2, int32 little-endian.
  std::string bytes;
  ASSERT_TRUE(absl::Base64Unescape(meta["routed_experts"].get<std::string>(), &bytes));
  ASSERT_EQ(bytes.size(), 5u * 2 * 2 * sizeof(int32_t));
  int32_t first;
  std::memcpy(&first, bytes.data(), sizeof(first));
  EXPECT_EQ(first, 1 % kExperts);
  // What reached the engine.
  std::lock_guard<std::mutex> lock(engine_.mu());
  const GenerateRequest& r = engine_.last_request_;
  EXPECT_EQ(r.rid, "r1");
  EXPECT_EQ(r.sampling.max_new_tokens, 4);
  EXPECT_EQ(r.sampling.temperature, 0.0f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
  EXPECT_EQ(r.sampling.top_k, 20);
  EXPECT_FLOAT_EQ(r.sampling.min_p, 0.05f);
  EXPECT_EQ(r.sampling.sampling_seed, std::optional<uint64_t>(42));
  EXPECT_TRUE(r.sampling.ignore_eos);
  EXPECT_EQ(r.extra_key, "salt");
  EXPECT_EQ(r.routed_experts_start_len, 1);
  EXPECT_TRUE(engine_.cancelled_.empty()) << "a request answered in full is not cancelled";
}

TEST_F(ServerTest, StopTokenAndDefaults) {
  std::vector<int32_t> prompt = {5};
  int32_t second = FakeToken(prompt, 1);
  json out = PostOk("/generate",
                    {{"input_ids", prompt}, {"sampling_params", {{"stop_token_ids", {second}}}}});
  EXPECT_EQ(out["output_ids"].size(), 2u);
  EXPECT_EQ(out["meta_info"]["finish_reason"], json({{"type", "stop"}, {"matched", second}}));
  EXPECT_FALSE(out["meta_info"].contains("output_token_logprobs"));
  EXPECT_FALSE(out["meta_info"].contains("routed_experts"));
  std::lock_guard<std::mutex> lock(engine_.mu());
  EXPECT_EQ(engine_.last_request_.sampling.max_new_tokens, 128) << "SGLang's default";
  EXPECT_FALSE(engine_.last_request_.return_logprob);
}

TEST_F(ServerTest, BatchIsAnsweredAsAnArray) {
  json out = PostOk("/generate",
                    {{"input_ids", {{1}, {2, 3}}},
                     {"rid", {"a", "b"}},
                     {"sampling_params", {{{"max_new_tokens", 1}}, {{"max_new_tokens", 2}}}}});
  ASSERT_TRUE(out.is_array());
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0]["meta_info"]["id"], "a");
  EXPECT_EQ(out[1]["meta_info"]["id"], "b");
  EXPECT_EQ(out[0]["output_ids"].size(), 1u);
  EXPECT_EQ(out[1]["output_ids"].size(), 2u);
  EXPECT_EQ(out[1]["output_ids"][0], FakeToken({2, 3}, 0));

  out = PostOk(
      "/generate",
      {{"input_ids", {{1}, {2}, {3}}}, {"rid", "x"}, {"sampling_params", {{"max_new_tokens", 1}}}});
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[2]["meta_info"]["id"], "x_2");

  auto res = Post("/generate", {{"input_ids", {{1}, {2}}}, {"rid", {"only-one"}}});
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_NE(ErrorMessage(res).find("rid has 1 entries for a batch of 2"), std::string::npos);
  // One bad prompt refuses the batch, and what was submitted before it is cancelled.
  res = Post("/generate", {{"input_ids", {{1}, {kVocab + 5}}}});
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_NE(ErrorMessage(res).find("outside the vocabulary"), std::string::npos);
  std::lock_guard<std::mutex> lock(engine_.mu());
  EXPECT_EQ(engine_.cancelled_.size(), 1u);
}

TEST_F(ServerTest, StreamSendsCumulativeChunksThenDone) {
  auto res = Post("/generate", {{"input_ids", {4, 5}},
                                {"stream", true},
                                {"return_logprob", true},
                                {"sampling_params", {{"max_new_tokens", 3}}}});
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200);
  EXPECT_EQ(res->get_header_value("Content-Type"), "text/event-stream");
  bool done = false;
  std::vector<json> events = SseEvents(res->body, &done);
  EXPECT_TRUE(done);
  ASSERT_GE(events.size(), 2u);
  const json& last = events.back();
  EXPECT_EQ(last["output_ids"].size(), 3u);
  EXPECT_EQ(last["meta_info"]["finish_reason"]["type"], "length");
  size_t prev = 0;
  for (size_t i = 0; i < events.size(); ++i) {
    const json& e = events[i];
    size_t n = e["output_ids"].size();
    EXPECT_GT(n, prev) << "chunks are cumulative and grow";
    prev = n;
    for (size_t j = 0; j < n; ++j) {
      EXPECT_EQ(e["output_ids"][j], last["output_ids"][j]);
    }
    EXPECT_EQ(e["meta_info"]["output_token_logprobs"].size(), n);
    if (i + 1 < events.size()) {
      EXPECT_TRUE(e["meta_info"]["finish_reason"].is_null());
    }
  }
}

TEST_F(ServerTest, ClientLeavingAStreamCancelsTheRequest) {
  UniqueFd fd = SendRaw(server_->port(), "/generate",
                        json({{"input_ids", {1}},
                              {"rid", "leaver"},
                              {"stream", true},
                              {"sampling_params", {{"max_new_tokens", 1 << 30}}}})
                            .dump());
  std::string got = ReadUntil(fd.get(), "data: {");
  ASSERT_NE(got.find("data: {"), std::string::npos);
  fd.Reset();
  EXPECT_TRUE(engine_.WaitFor([&] {
    return std::count(engine_.cancelled_.begin(), engine_.cancelled_.end(), "leaver") == 1;
  }));
}

TEST_F(ServerTest, ClientLeavingAnIdleStreamCancelsTheRequest) {
  engine_.Hold(true);
  UniqueFd fd = SendRaw(server_->port(), "/generate",
                        json({{"input_ids", {1}}, {"rid", "idle"}, {"stream", true}}).dump());
  ASSERT_NE(ReadUntil(fd.get(), "\r\n\r\n").find("200"), std::string::npos);
  fd.Reset();
  EXPECT_TRUE(engine_.WaitFor([&] {
    return std::count(engine_.cancelled_.begin(), engine_.cancelled_.end(), "idle") == 1;
  }));
  engine_.Hold(false);
}

TEST_F(ServerTest, ClientLeavingAPlainRequestCancelsIt) {
  engine_.Hold(true);
  UniqueFd fd =
      SendRaw(server_->port(), "/generate", json({{"input_ids", {1}}, {"rid", "plain"}}).dump());
  ASSERT_TRUE(engine_.WaitFor([&] { return engine_.submitted_ == 1; }));
  fd.Reset();
  EXPECT_TRUE(engine_.WaitFor([&] {
    return std::count(engine_.cancelled_.begin(), engine_.cancelled_.end(), "plain") == 1;
  }));
  engine_.Hold(false);
}

TEST_F(ServerTest, HostileBodiesGetA400NamingTheProblem) {
  struct Case {
    std::string body;
    std::string message;  // a part of the error message
  };
  const std::vector<Case> cases = {
      {"", "not valid JSON"},
      {"{", "not valid JSON"},
      {"{\"input_ids\": [1,2,]}", "not valid JSON"},
      {"[1,2,3]", "must be a JSON object"},
      {"\"text\"", "must be a JSON object"},
      {"null", "must be a JSON object"},
      {std::string(100, '[') + std::string(100, ']'), "nests deeper"},
      {"{\"input_ids\": " + std::string(5000, '[') + std::string(5000, ']') + "}", "nests deeper"},
      {R"({"input_ids": [1], "bogus": 1})", "unknown field 'bogus'"},
      {R"({"input_ids": [1], "sampling_params": {"bogus": 1}})", "unknown field 'bogus'"},
      {R"({"text": "hello"})", "this engine takes input_ids (no tokenizer"},
      {R"({})", "input_ids is required"},
      {R"({"input_ids": []})", "input_ids is empty"},
      {R"({"input_ids": [[1], []]})", "input_ids[1] is empty"},
      {R"({"input_ids": "1 2 3"})", "input_ids must be a list"},
      {R"({"input_ids": [1, "2"]})", "input_ids[1] must be a token id"},
      {R"({"input_ids": [1.5]})", "input_ids[0] must be a token id"},
      {R"({"input_ids": [-1]})", "input_ids[0] must be a token id"},
      {R"({"input_ids": [4294967296]})", "input_ids[0] must be a token id"},
      {R"({"input_ids": [1e400]})", "number overflow"},
      {R"({"input_ids": [99999999999999999999999999]})", "input_ids[0] must be a token id"},
      {R"({"input_ids": [1, {"a": [1]}]})", "input_ids[1] must be a token id"},
      {R"({"input_ids": [[1], 2]})", "input_ids[1] must be a list"},
      {R"({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}})",
       "sampling_params.max_new_tokens must be an integer"},
      {R"({"input_ids": [1], "sampling_params": {"max_new_tokens": 1e30}})",
       "sampling_params.max_new_tokens must be an integer"},
      {R"({"input_ids": [1], "sampling_params": {"max_new_tokens": 18446744073709551615}})",
       "sampling_params.max_new_tokens must be an integer"},
      {R"({"input_ids": [1], "sampling_params": {"max_new_tokens": "8"}})",
       "sampling_params.max_new_tokens must be an integer"},
      {R"({"input_ids": [1], "sampling_params": {"temperature": -0.5}})",
       "sampling_params.temperature"},
      {R"({"input_ids": [1], "sampling_params": {"temperature": "hot"}})",
       "sampling_params.temperature"},
      {R"({"input_ids": [1], "sampling_params": {"top_p": 0}})", "sampling_params.top_p"},
      {R"({"input_ids": [1], "sampling_params": {"top_k": 0}})", "sampling_params.top_k"},
      {R"({"input_ids": [1], "sampling_params": {"min_p": 2}})", "sampling_params.min_p"},
      {R"({"input_ids": [1], "sampling_params": {"stop_token_ids": 5}})",
       "sampling_params.stop_token_ids must be a list"},
      {R"({"input_ids": [1], "sampling_params": {"sampling_seed": -3}})",
       "sampling_params.sampling_seed"},
      {R"({"input_ids": [1], "sampling_params": {"ignore_eos": "yes"}})",
       "sampling_params.ignore_eos must be true or false"},
      {R"({"input_ids": [1], "sampling_params": {"stop": ["</s>"]}})", "sampling_params.stop"},
      {R"({"input_ids": [1], "sampling_params": {"n": 2}})", "sampling_params.n"},
      {R"({"input_ids": [1], "sampling_params": [1, 2]})", "sampling_params must be an object"},
      {R"({"input_ids": [1], "sampling_params": "greedy"})", "sampling_params must be an object"},
      {R"({"input_ids": [1], "lora_path": "/tmp/lora"})", "lora_path"},
      {R"({"input_ids": [1], "bootstrap_host": "10.0.0.1"})", "bootstrap_host"},
      {R"({"input_ids": [1], "top_logprobs_num": 5})", "top_logprobs_num"},
      {R"({"input_ids": [1], "stream": "yes"})", "stream must be true or false"},
      {R"({"input_ids": [1], "rid": 7})", "rid must be a string"},
      {R"({"input_ids": [1], "return_logprob": 1})", "return_logprob must be true or false"},
      {R"({"input_ids": [1, 2], "return_logprob": true, "logprob_start_len": 2})",
       "logprob_start_len 2 is not inside the prompt"},
      {R"({"input_ids": [1], "logprob_start_len": -2})", "logprob_start_len must be an integer"},
      {R"({"input_ids": [1], "routed_experts_start_len": 5})", "routed_experts_start_len 5"},
      {R"({"input_ids": [[1], [2]], "stream": true})", "stream is served for one prompt"},
      {R"({"input_ids": [1], "extra_key": ["a"]})", "extra_key must be a string"},
      {"{\"input_ids\": [1], \"bad\xff\": 0}", "not valid JSON"},
      {"{\"input_ids\": [1], \"rid\": \"\xff\xfe\"}", "not valid JSON"},
  };
  for (const Case& c : cases) {
    auto res = PostRaw("/generate", c.body);
    ASSERT_TRUE(res) << c.body.substr(0, 80);
    EXPECT_EQ(res->status, 400) << c.body.substr(0, 80) << " -> " << res->body;
    EXPECT_NE(ErrorMessage(res).find(c.message), std::string::npos)
        << c.body.substr(0, 80) << " -> " << res->body;
    json err = json::parse(res->body, nullptr, false);
    EXPECT_EQ(err["error"]["code"], 400);
  }
  auto health = client_->Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  {
    std::lock_guard<std::mutex> lock(engine_.mu());
    EXPECT_EQ(engine_.submitted_, 0) << "no hostile body reached the engine";
  }
  EXPECT_EQ(PostOk("/generate",
                   {{"input_ids", {1}}, {"sampling_params", {{"max_new_tokens", 2}}}})["output_ids"]
                .size(),
            2u);
}

TEST_F(ServerTest, ControlBodiesAreCheckedToo) {
  for (const std::string path : {"/abort_request", "/update_weights_from_disk", "/pause_generation",
                                 "/continue_generation"}) {
    for (const std::string body : {"{", "[]", R"({"bogus": true})"}) {
      auto res = PostRaw(path, body);
      ASSERT_TRUE(res);
      EXPECT_EQ(res->status, 400) << path << " " << body;
    }
  }
}

TEST_F(ServerTest, EngineErrorsMapToHttpCodes) {
  const std::vector<std::pair<Status, int>> cases = {
      {absl::InvalidArgumentError("bad"), 400},  {absl::FailedPreconditionError("no"), 400},
      {absl::NotFoundError("gone"), 404},        {absl::ResourceExhaustedError("full"), 503},
      {absl::UnavailableError("stopping"), 503}, {absl::InternalError("boom"), 500},
  };
  for (const auto& [status, code] : cases) {
    {
      std::lock_guard<std::mutex> lock(engine_.mu());
      engine_.submit_error_ = status;
    }
    auto res = Post("/generate", {{"input_ids", {1}}});
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, code) << status;
    EXPECT_EQ(ErrorMessage(res), status.message());
  }
}

TEST_F(ServerTest, AbortRequest) {
  auto res = Post("/abort_request", {{"rid", "nobody"}});
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
  EXPECT_NE(ErrorMessage(res).find("nobody"), std::string::npos);

  engine_.Hold(true);
  int answer_status = 0;
  std::string answer_body;
  std::thread t([&] {
    httplib::Client c("127.0.0.1", server_->port());
    auto r = c.Post("/generate", json({{"input_ids", {1}}, {"rid", "victim"}}).dump(),
                    "application/json");
    if (r) {
      answer_status = r->status;
      answer_body = r->body;
    }
  });
  ASSERT_TRUE(engine_.WaitFor([&] { return engine_.submitted_ == 1; }));
  PostOk("/abort_request", {{"rid", "victim"}});
  t.join();
  EXPECT_EQ(answer_status, 200);
  json out = json::parse(answer_body);
  EXPECT_EQ(out["meta_info"]["finish_reason"],
            json({{"type", "abort"}, {"message", "aborted by /abort_request"}}));

  PostOk("/abort_request", {{"abort_all", true}});
  engine_.Hold(false);
  std::lock_guard<std::mutex> lock(engine_.mu());
  EXPECT_EQ(engine_.abort_all_calls_, 1);
  EXPECT_EQ(engine_.aborted_rids_, (std::vector<std::string>{"nobody", "victim"}));
}

TEST_F(ServerTest, PauseAndContinue) {
  json out = PostOk("/pause_generation", json::object());
  EXPECT_EQ(out["status"], "ok");
  PostOk("/pause_generation", {{"mode", "in_place"}});
  PostOk("/pause_generation", {{"mode", "retract"}});
  auto res = Post("/pause_generation", {{"mode", "sideways"}});
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_NE(ErrorMessage(res).find("sideways"), std::string::npos);
  res = client_->Post("/continue_generation", "", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  std::lock_guard<std::mutex> lock(engine_.mu());
  EXPECT_EQ(engine_.pauses_,
            (std::vector<PauseMode>{PauseMode::kAbort, PauseMode::kInPlace, PauseMode::kRetract}));
}

TEST_F(ServerTest, UpdateWeightsFromDisk) {
  {
    std::lock_guard<std::mutex> lock(engine_.mu());
    engine_.fail_update_ = true;
  }
  auto res = Post("/update_weights_from_disk", {{"model_path", "/ckpt/bad"}});
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  json body = json::parse(res->body);
  EXPECT_EQ(body["success"], false);
  EXPECT_NE(body["message"].get<std::string>().find("/ckpt/bad"), std::string::npos);
  {
    std::lock_guard<std::mutex> lock(engine_.mu());
    engine_.fail_update_ = false;
  }
  res = Post("/update_weights_from_disk", {{"weight_version", "v1"}});
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_EQ(json::parse(res->body)["success"], false);
  res = Post("/update_weights_from_disk", {{"model_path", "/ckpt/1"}, {"load_format", "dummy"}});
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_NE(res->body.find("load_format"), std::string::npos);

  json ok =
      PostOk("/update_weights_from_disk", {{"model_path", "/ckpt/1"}, {"weight_version", "v1"}});
  EXPECT_EQ(ok["success"], true);
  PostOk("/update_weights_from_disk",
         {{"model_path", "/ckpt/2"}, {"weight_version", "v2"}, {"flush_cache", false}});
  auto version = client_->Get("/get_weight_version");
  ASSERT_TRUE(version);
  EXPECT_EQ(json::parse(version->body)["weight_version"], "v2");
  auto info = client_->Get("/get_model_info");
  ASSERT_TRUE(info);
  EXPECT_EQ(json::parse(info->body)["model_path"], "/ckpt/2");
  std::lock_guard<std::mutex> lock(engine_.mu());
  EXPECT_EQ(engine_.update_flushes_, (std::vector<bool>{true, false}))
      << "flush_cache: true by default";
}

TEST_F(ServerTest, FlushCache) {
  auto res = client_->Post("/flush_cache", "", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  engine_.Hold(true);
  std::thread t([&] {
    httplib::Client c("127.0.0.1", server_->port());
    c.Post("/generate", json({{"input_ids", {1}}, {"rid", "busy"}}).dump(), "application/json");
  });
  ASSERT_TRUE(engine_.WaitFor([&] { return engine_.submitted_ == 1; }));
  res = client_->Post("/flush_cache", "", "application/json");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_NE(ErrorMessage(res).find("requests are running"), std::string::npos);
  engine_.Hold(false);
  t.join();
  std::lock_guard<std::mutex> lock(engine_.mu());
  EXPECT_EQ(engine_.flushes_, 1);
}

TEST_F(ServerTest, InfoEndpoints) {
  auto res = client_->Get("/get_model_info");
  ASSERT_TRUE(res);
  json info = json::parse(res->body);
  EXPECT_EQ(info["model_path"], "/models/fake");
  EXPECT_TRUE(info["tokenizer_path"].is_null());
  EXPECT_EQ(info["is_generation"], true);
  EXPECT_EQ(info["num_experts"], kExperts);
  EXPECT_EQ(info["moe_layers"], json(kMoeLayers));
  EXPECT_EQ(info["weight_version"], "v0");

  EngineOptions eo;
  eo.max_running = 12;
  eo.deterministic = true;
  Start({.engine_options = eo});
  res = client_->Get("/get_server_info");
  ASSERT_TRUE(res);
  json server = json::parse(res->body);
  EXPECT_EQ(server["max_running_requests"], 12);
  EXPECT_EQ(server["deterministic"], true);
  EXPECT_EQ(server["max_total_num_tokens"], 1 << 16);
  EXPECT_EQ(server["device"], "cpu");
  EXPECT_EQ(server["internal_states"][0]["paused"], false);

  res = client_->Get("/v1/models");
  ASSERT_TRUE(res);
  EXPECT_EQ(json::parse(res->body)["data"][0]["id"], "fake-moe");
}

TEST_F(ServerTest, MetricsAreParseablePrometheusText) {
  auto res = client_->Get("/metrics");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200);
  const std::regex sample(
      R"(^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[a-zA-Z_][a-zA-Z0-9_]*="(\\.|[^"\\])*"(,[a-zA-Z_][a-zA-Z0-9_]*="(\\.|[^"\\])*")*\})? -?[0-9.eE+-]+$)");
  const std::regex comment(R"(^# (HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* .*$)");
  std::set<std::string> names;
  size_t start = 0;
  while (start < res->body.size()) {
    size_t end = res->body.find('\n', start);
    ASSERT_NE(end, std::string::npos) << "the text ends with a newline";
    std::string line = res->body.substr(start, end - start);
    start = end + 1;
    if (line.starts_with("#")) {
      EXPECT_TRUE(std::regex_match(line, comment)) << line;
      continue;
    }
    EXPECT_TRUE(std::regex_match(line, sample)) << line;
    names.insert(line.substr(0, line.find_first_of("{ ")));
  }
  for (const char* want :
       {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total", "sglang:cache_hit_rate", "sglang:token_usage"}) {
    EXPECT_TRUE(names.count(want)) << want;
  }
  EXPECT_NE(res->body.find("sglang:cache_hit_rate{model_name=\"fake-moe\"} 0.25\n"),
            std::string::npos);
}

TEST_F(ServerTest, Completions) {
  json out = PostOk("/v1/completions",
                    {{"model", "anything"}, {"prompt", {1, 2}}, {"max_tokens", 3}, {"seed", 9}});
  EXPECT_EQ(out["object"], "text_completion");
  EXPECT_EQ(out["choices"][0]["text"], "");
  EXPECT_EQ(out["choices"][0]["output_ids"].size(), 3u);
  EXPECT_EQ(out["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(out["usage"]["prompt_tokens"], 2);
  EXPECT_EQ(out["usage"]["total_tokens"], 5);
  auto res = Post("/v1/completions", {{"prompt", "hello"}});
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_NE(ErrorMessage(res).find("no tokenizer"), std::string::npos);
  res = Post("/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "hi"}}}}});
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_NE(ErrorMessage(res).find("no tokenizer"), std::string::npos);
  std::lock_guard<std::mutex> lock(engine_.mu());
  EXPECT_EQ(engine_.last_request_.sampling.sampling_seed, std::optional<uint64_t>(9));
}

TEST_F(ServerTest, ApiKey) {
  Start({.api_key = "sekrit"});
  auto res = Post("/generate", {{"input_ids", {1}}});
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 401);
  res = client_->Get("/health");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  client_->set_bearer_token_auth("sekrit");
  res = Post("/generate", {{"input_ids", {1}}, {"sampling_params", {{"max_new_tokens", 1}}}});
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
}

// Every endpoint of the server, with its method: each one answers (not 404).
TEST_F(ServerTest, EveryEndpointAnswers) {
  struct Endpoint {
    std::string method;
    std::string path;
    json body;
  };
  const std::vector<Endpoint> endpoints = {
      {"POST", "/generate", {{"input_ids", {1}}, {"sampling_params", {{"max_new_tokens", 1}}}}},
      {"GET", "/health", nullptr},
      {"GET", "/health_generate", nullptr},
      {"GET", "/get_model_info", nullptr},
      {"GET", "/get_server_info", nullptr},
      {"GET", "/get_weight_version", nullptr},
      {"GET", "/metrics", nullptr},
      {"POST", "/flush_cache", json::object()},
      {"GET", "/flush_cache", nullptr},
      {"POST", "/abort_request", {{"abort_all", true}}},
      {"POST", "/pause_generation", {{"mode", "in_place"}}},
      {"POST", "/continue_generation", json::object()},
      {"POST", "/update_weights_from_disk", {{"model_path", "/ckpt/x"}}},
      {"GET", "/v1/models", nullptr},
      {"POST", "/v1/completions", {{"prompt", {1}}, {"max_tokens", 1}}},
      {"POST", "/v1/chat/completions", {{"messages", json::array()}}},
  };
  for (const Endpoint& e : endpoints) {
    auto res = e.method == "GET" ? client_->Get(e.path.c_str()) : Post(e.path, e.body);
    ASSERT_TRUE(res) << e.path;
    EXPECT_NE(res->status, 404) << e.method << " " << e.path;
    EXPECT_LT(res->status, 500) << e.method << " " << e.path << ": " << res->body;
  }
  auto res = client_->Get("/no_such_endpoint");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 404);
}

// Every field in the table is accepted with its example value, and nothing outside the table is.
TEST_F(ServerTest, EveryAcceptedFieldIsInTheTable) {
  ASSERT_NO_FATAL_FAILURE(StartWithByteTokenizer());  // the text fields need one
  const json hi = json::array({{{"role", "user"}, {"content", "hi"}}});
  // A value for each served field (a served field added to the table needs one here).
  const std::map<std::pair<std::string, std::string>, json> served = {
      {{"generate", "input_ids"}, {1, 2}},
      {{"generate", "text"}, "hi"},
      {{"sampling_params", "skip_special_tokens"}, false},
      {{"chat_completions", "messages"}, hi},
      {{"chat_completions", "max_tokens"}, 1},
      {{"chat_completions", "max_completion_tokens"}, 1},
      {{"chat_completions", "temperature"}, 0},
      {{"chat_completions", "top_p"}, 1},
      {{"chat_completions", "top_k"}, -1},
      {{"chat_completions", "min_p"}, 0},
      {{"chat_completions", "seed"}, 1},
      {{"chat_completions", "stop_token_ids"}, {2}},
      {{"chat_completions", "ignore_eos"}, false},
      {{"chat_completions", "skip_special_tokens"}, true},
      {{"chat_completions", "rid"}, "c"},
      {{"chat_completions", "extra_key"}, "k"},
      {{"tokenize", "prompt"}, "hi"},
      {{"tokenize", "add_special_tokens"}, false},
      {{"detokenize", "tokens"}, {104, 105}},
      {{"detokenize", "skip_special_tokens"}, true},
      {{"generate", "sampling_params"}, {{"max_new_tokens", 1}}},
      {{"generate", "rid"}, "field-test"},
      {{"generate", "return_logprob"}, true},
      {{"generate", "logprob_start_len"}, 0},
      {{"generate", "return_routed_experts"}, true},
      {{"generate", "routed_experts_start_len"}, 0},
      {{"generate", "extra_key"}, "k"},
      {{"generate", "stream"}, false},
      {{"sampling_params", "max_new_tokens"}, 1},
      {{"sampling_params", "temperature"}, 0.5},
      {{"sampling_params", "top_p"}, 0.5},
      {{"sampling_params", "top_k"}, 5},
      {{"sampling_params", "min_p"}, 0.1},
      {{"sampling_params", "stop_token_ids"}, {3}},
      {{"sampling_params", "stop"}, {"zz", "y"}},
      {{"sampling_params", "stop_regex"}, {"z+z"}},
      {{"sampling_params", "no_stop_trim"}, true},
      {{"completions", "stop"}, "zz"},
      {{"chat_completions", "stop"}, {"zz"}},
      {{"sampling_params", "sampling_seed"}, 7},
      {{"sampling_params", "ignore_eos"}, true},
      {{"completions", "prompt"}, {1}},
      {{"completions", "max_tokens"}, 1},
      {{"completions", "temperature"}, 0},
      {{"completions", "top_p"}, 1},
      {{"completions", "top_k"}, -1},
      {{"completions", "min_p"}, 0},
      {{"completions", "seed"}, 1},
      {{"completions", "stop_token_ids"}, {2}},
      {{"completions", "ignore_eos"}, false},
      {{"completions", "rid"}, "c"},
      {{"completions", "extra_key"}, "k"},
      {{"update_weights_from_disk", "model_path"}, "/ckpt/f"},
      {{"update_weights_from_disk", "weight_version"}, "vf"},
      {{"update_weights_from_disk", "flush_cache"}, true},
      {{"update_weights_from_disk", "abort_all_requests"}, false},
      {{"update_weights_from_disk", "keep_pause"}, false},
      {{"abort_request", "rid"}, nullptr},
      {{"abort_request", "abort_all"}, true},
      {{"pause_generation", "mode"}, "in_place"},
  };
  const std::map<std::string, std::pair<std::string, json>> scopes = {
      {"generate",
       {"/generate", {{"input_ids", {1}}, {"sampling_params", {{"max_new_tokens", 1}}}}}},
      {"sampling_params", {"/generate", {{"input_ids", {1}}}}},
      {"completions", {"/v1/completions", {{"prompt", {1}}, {"max_tokens", 1}}}},
      {"chat_completions", {"/v1/chat/completions", {{"messages", hi}, {"max_tokens", 1}}}},
      {"tokenize", {"/tokenize", {{"prompt", "hi"}}}},
      {"detokenize", {"/detokenize", {{"tokens", {104}}}}},
      {"update_weights_from_disk", {"/update_weights_from_disk", {{"model_path", "/ckpt/f"}}}},
      {"abort_request", {"/abort_request", {{"abort_all", true}}}},
      {"pause_generation", {"/pause_generation", json::object()}},
      {"continue_generation", {"/continue_generation", json::object()}},
  };
  std::set<std::pair<std::string, std::string>> seen;
  for (const FieldSpec& f : RequestFields()) {
    std::pair<std::string, std::string> key{std::string(f.scope), std::string(f.name)};
    EXPECT_TRUE(seen.insert(key).second) << "listed twice: " << f.scope << "." << f.name;
    EXPECT_FALSE(f.note.empty()) << f.name;
    ASSERT_TRUE(scopes.count(key.first)) << "a scope without an endpoint: " << f.scope;
    json value;
    if (f.use == FieldUse::kServed) {
      ASSERT_TRUE(served.count(key))
          << "no example value for served field " << f.scope << "." << f.name;
      value = served.at(key);
    } else if (f.use == FieldUse::kDefaultOnly) {
      std::string first(f.accepted.substr(0, f.accepted.find('|')));
      value = json::parse(first);
    } else {
      value = true;
    }
    auto [path, body] = scopes.at(key.first);
    if (key == std::pair<std::string, std::string>{"generate", "text"}) {
      body.erase("input_ids");
    }
    if (key.first == "sampling_params") {
      body["sampling_params"][key.second] = value;
      body["sampling_params"]["max_new_tokens"] = 1;
    } else {
      body[key.second] = value;
    }
    auto res = Post(path, body);
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200) << f.scope << "." << f.name << " = " << value.dump() << ": "
                                << res->body;
    PostOk("/continue_generation", json::object());
    if (f.use == FieldUse::kDefaultOnly && key.first != "continue_generation") {
      body = scopes.at(key.first).second;
      json odd = {{"not", "the default"}};
      if (key.first == "sampling_params") {
        body["sampling_params"][key.second] = odd;
      } else {
        body[key.second] = odd;
      }
      res = Post(path, body);
      ASSERT_TRUE(res);
      EXPECT_EQ(res->status, 400) << f.scope << "." << f.name;
      EXPECT_NE(res->body.find(key.second), std::string::npos) << res->body;
    }
  }
  EXPECT_EQ(served.size(), static_cast<size_t>(std::count_if(
                               RequestFields().begin(), RequestFields().end(),
                               [](const FieldSpec& f) { return f.use == FieldUse::kServed; })))
      << "an example value names a field the table does not serve";
}

// With a tokenizer: text prompts become the tokenizer's ids, answers carry the decoded text (a
// stream never ends a chunk inside a character), ChatML chat, /tokenize and /detokenize.
TEST_F(ServerTest, TextEndpointsWithATokenizer) {
  ServerOptions options;
  options.tokenizer_path = "/models/x/tokenizer.json";
  ASSERT_NO_FATAL_FAILURE(StartWithByteTokenizer(options));
  const Tokenizer& tok = *tokenizer_;

  json out =
      PostOk("/generate", {{"text", "h\xC3\xA9"}, {"sampling_params", {{"max_new_tokens", 40}}}});
  ASSERT_TRUE(out.is_object());
  std::vector<int32_t> prompt = {'h', 0xC3, 0xA9};
  EXPECT_EQ(out["meta_info"]["prompt_tokens"], 3);
  std::vector<int32_t> ids = out["output_ids"];
  ASSERT_EQ(ids.size(), 40u);
  EXPECT_EQ(ids[0], FakeToken(prompt, 0));
  EXPECT_EQ(out["text"], tok.Decode(ids, true));

  // A batch of texts; both text and input_ids is refused.
  out = PostOk("/generate",
               {{"text", {"a", "<|im_start|>b"}}, {"sampling_params", {{"max_new_tokens", 2}}}});
  ASSERT_TRUE(out.is_array());
  EXPECT_EQ(out[0]["meta_info"]["prompt_tokens"], 1);
  EXPECT_EQ(out[1]["meta_info"]["prompt_tokens"], 2);  // the special token is one id
  EXPECT_EQ(out[1]["output_ids"][0], FakeToken({256, 'b'}, 0));
  auto res = Post("/generate", {{"text", "a"}, {"input_ids", {1}}});
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_NE(ErrorMessage(res).find("not both"), std::string::npos);
  for (json bad : {json(3), json::array({"a", 4}), json::array()}) {
    res = Post("/generate", {{"text", bad}});
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 400) << bad.dump();
    EXPECT_NE(ErrorMessage(res).find("text"), std::string::npos) << res->body;
  }

  // A stream: every chunk's text is the start of the final text, and none ends inside a
  // character (the fake's ids include UTF-8 lead bytes whose continuation comes a token later).
  res = client_->Post(
      "/generate",
      json({{"text", "stream me"}, {"stream", true}, {"sampling_params", {{"max_new_tokens", 60}}}})
          .dump(),
      "application/json");
  ASSERT_TRUE(res);
  std::vector<json> chunks;
  for (size_t at = 0; (at = res->body.find("data: {", at)) != std::string::npos;) {
    size_t end = res->body.find("\n\n", at);
    chunks.push_back(json::parse(res->body.substr(at + 6, end - at - 6)));
    at = end;
  }
  ASSERT_GT(chunks.size(), 10u);
  std::string final_text = chunks.back()["text"];
  EXPECT_EQ(final_text, tok.Decode(chunks.back()["output_ids"].get<std::vector<int32_t>>(), true));
  int held_back = 0;
  for (size_t i = 0; i + 1 < chunks.size(); ++i) {
    std::string text = chunks[i]["text"];
    std::vector<int32_t> so_far = chunks[i]["output_ids"];
    std::string raw = tok.DecodeBytes(so_far, true);
    held_back += IncompleteUtf8Tail(raw) > 0;
    EXPECT_EQ(final_text.compare(0, text.size(), text), 0) << i << ": " << text;
  }
  EXPECT_GT(held_back, 0) << "the fake's ids never cut a character: the check checked nothing";

  // /v1/completions with a string prompt.
  out = PostOk("/v1/completions", {{"prompt", "abc"}, {"max_tokens", 5}});
  ASSERT_TRUE(out.is_object());
  EXPECT_EQ(out["usage"]["prompt_tokens"], 3);
  EXPECT_EQ(out["choices"][0]["text"],
            tok.Decode(out["choices"][0]["output_ids"].get<std::vector<int32_t>>(), true));

  // Chat: ChatML, and <|im_end|> stops.
  json messages = json::array(
      {{{"role", "system"}, {"content", "S"}},
       {{"role", "user"}, {"content", json::array({{{"type", "text"}, {"text", "U"}}})}}});
  out = PostOk("/v1/chat/completions", {{"messages", messages}, {"max_tokens", 4}});
  ASSERT_TRUE(out.is_object());
  std::string chatml =
      "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
      "<|im_start|>assistant\n";
  std::vector<int32_t> chat_ids = *tok.Encode(chatml, false);
  EXPECT_EQ(out["usage"]["prompt_tokens"], chat_ids.size());
  EXPECT_EQ(out["object"], "chat.completion");
  EXPECT_EQ(out["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(out["choices"][0]["output_ids"][0], FakeToken(chat_ids, 0));
  EXPECT_EQ(out["choices"][0]["message"]["content"],
            tok.Decode(out["choices"][0]["output_ids"].get<std::vector<int32_t>>(), true));
  for (json bad :
       {json::array(), json::array({{{"role", "wizard"}, {"content", "x"}}}),
        json::array({{{"content", "x"}}}), json::array({{{"role", "user"}, {"content", 5}}}),
        json::array({{{"role", "user"}, {"content", "x"}, {"tool_calls", 1}}}),
        json::array({{{"role", "user"}, {"content", json::array({{{"type", "image_url"}}})}}})}) {
    res = Post("/v1/chat/completions", {{"messages", bad}});
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 400) << bad.dump();
    EXPECT_NE(ErrorMessage(res).find("messages"), std::string::npos) << res->body;
  }

  // /tokenize and /detokenize, one and a batch, and the /v1 spellings.
  out = PostOk("/tokenize", {{"prompt", "hi<|im_end|>"}});
  EXPECT_EQ(out["tokens"], json({'h', 'i', 257}));
  EXPECT_EQ(out["count"], 3);
  EXPECT_EQ(out["max_model_len"], 4096);
  out = PostOk("/v1/tokenize", {{"prompt", {"a", ""}}});
  EXPECT_EQ(out["tokens"], json({{'a'}, json::array()}));
  EXPECT_EQ(out["count"], json({1, 0}));
  out = PostOk("/detokenize", {{"tokens", {'h', 'i', 257}}});
  EXPECT_EQ(out["text"], "hi<|im_end|>");
  out = PostOk("/v1/detokenize",
               {{"tokens", {{'h', 257}, {0xE2, 0x82}}}, {"skip_special_tokens", true}});
  EXPECT_EQ(out["text"], json({"h", "\xEF\xBF\xBD"}));
  for (auto [path, body] : std::vector<std::pair<std::string, json>>{
           {"/tokenize", {{"prompt", 5}}},
           {"/tokenize", {{"prompt", {"a", 5}}}},
           {"/tokenize", {{"text", "a"}}},
           {"/detokenize", {{"tokens", "abc"}}},
           {"/detokenize", {{"tokens", {1, -1}}}},
       }) {
    res = Post(path, body);
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 400) << path << " " << body.dump();
  }

  out =
      client_->Get("/get_model_info") ? json::parse(client_->Get("/get_model_info")->body) : json();
  EXPECT_EQ(out["tokenizer_path"], "/models/x/tokenizer.json");
}

// Stop strings (sampling_params.stop, OpenAI's stop): the request ends at the token that
// completes one, the text stops before it (or keeps it: no_stop_trim), finish_reason names it;
// a stream never shows the start of a stop string that may yet complete. The fake's tokens for
// the prompt [63] are the bytes "@GNU\\cjqx..." (63 + 1 + 7n).
TEST_F(ServerTest, StopStrings) {
  ASSERT_NO_FATAL_FAILURE(StartWithByteTokenizer());
  auto gen = [&](json sp) {
    sp["max_new_tokens"] = 20;
    return PostOk("/generate", {{"input_ids", {63}}, {"sampling_params", sp}});
  };
  json out = gen({{"stop", "NU"}});
  EXPECT_EQ(out["output_ids"], json({'@', 'G', 'N', 'U'}));
  EXPECT_EQ(out["text"], "@G");
  EXPECT_EQ(out["meta_info"]["finish_reason"], json({{"type", "stop"}, {"matched", "NU"}}));
  EXPECT_EQ(out["meta_info"]["completion_tokens"], 4);
  out = gen({{"stop", "NU"}, {"no_stop_trim", true}});
  EXPECT_EQ(out["text"], "@GNU");
  // The first to complete wins; a string over three tokens; empty strings are none.
  out = gen({{"stop", {"", "zz", "U\\c", "cj"}}});
  EXPECT_EQ(out["output_ids"].size(), 6u);
  EXPECT_EQ(out["text"], "@GN");
  EXPECT_EQ(out["meta_info"]["finish_reason"]["matched"], "U\\c");
  out = gen({{"stop", {"zz"}}});
  EXPECT_EQ(out["output_ids"].size(), 20u);
  EXPECT_EQ(out["meta_info"]["finish_reason"]["type"], "length");
  for (json none : {json(nullptr), json(""), json::array()}) {
    out = gen({{"stop", none}});
    EXPECT_EQ(out["output_ids"].size(), 20u) << none.dump();
  }

  // Streams: "U" is held back while "U\\c" may complete, then never shown; with "Ux" it is
  // shown once "\\" rules that out.
  auto stream = [&](const std::string& stop) {
    auto res = client_->Post("/generate",
                             json({{"input_ids", {63}},
                                   {"stream", true},
                                   {"sampling_params", {{"max_new_tokens", 8}, {"stop", stop}}}})
                                 .dump(),
                             "application/json");
    EXPECT_TRUE(res);
    bool done = false;
    std::vector<std::string> texts;
    for (const json& e : SseEvents(res ? res->body : "", &done)) {
      texts.push_back(e["text"]);
    }
    EXPECT_TRUE(done);
    return texts;
  };
  std::vector<std::string> texts = stream("U\\c");
  ASSERT_FALSE(texts.empty());
  EXPECT_EQ(texts.back(), "@GN");
  for (const std::string& t : texts) {
    EXPECT_EQ(t.find('U'), std::string::npos) << t;
    EXPECT_EQ(texts.back().compare(0, t.size(), t), 0) << t << " is not a start of the text";
  }
  texts = stream("Ux");
  ASSERT_FALSE(texts.empty());
  EXPECT_EQ(texts.back(), "@GNU\\cjq");
  for (size_t i = 0; i + 1 < texts.size(); ++i) {
    EXPECT_EQ(texts[i + 1].compare(0, texts[i].size(), texts[i]), 0) << texts[i];
  }
  EXPECT_NE(std::find(texts.begin(), texts.end(), "@GN"), texts.end());
  EXPECT_NE(std::find(texts.begin(), texts.end(), "@GNU\\"), texts.end());

  // OpenAI's endpoints.
  out = PostOk("/v1/completions", {{"prompt", {63}}, {"max_tokens", 20}, {"stop", {"NU"}}});
  EXPECT_EQ(out["choices"][0]["text"], "@G");
  EXPECT_EQ(out["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(out["choices"][0]["matched_stop"], "NU");
  EXPECT_EQ(out["usage"]["completion_tokens"], 4);

  // Refused, naming the field.
  const std::vector<std::pair<json, std::string>> bad = {
      {json(5), "must be a string or a list of strings"},
      {json::array({"a", 5}), "must be a string or a list of strings"},
      {json(std::vector<std::string>(33, "a")), "more than 32"},
      {json(std::string(1025, 'a')), "longer than 1024 bytes"},
  };
  for (const auto& [value, needle] : bad) {
    auto res = Post("/generate", {{"input_ids", {63}}, {"sampling_params", {{"stop", value}}}});
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 400) << value.dump();
    EXPECT_NE(ErrorMessage(res).find("sampling_params.stop"), std::string::npos) << res->body;
    EXPECT_NE(ErrorMessage(res).find(needle), std::string::npos) << res->body;
  }
  auto res =
      PostRaw("/generate", "{\"input_ids\": [63], \"sampling_params\": {\"stop\": \"a\xff\"}}");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400) << res->body;  // by the JSON parser or as not UTF-8

  // Without a tokenizer a stop string is refused; no stop strings are fine.
  Start({});
  res = Post("/generate", {{"input_ids", {63}}, {"sampling_params", {{"stop", "NU"}}}});
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_NE(ErrorMessage(res).find("need a tokenizer"), std::string::npos) << res->body;
  out = PostOk(
      "/generate",
      {{"input_ids", {63}}, {"sampling_params", {{"stop", json::array()}, {"max_new_tokens", 3}}}});
  EXPECT_EQ(out["output_ids"].size(), 3u);
}

// Stop regexes (sampling_params.stop_regex, SGLang's): the request ends at the token after which
// the output first holds a match, anywhere in it; finish_reason names the pattern, and the text
// is kept whole, as SGLang keeps it. Output bytes as in StopStrings: "@GNU\\cjqx..." and, from
// the 10th token on, bytes that are not UTF-8.
TEST_F(ServerTest, StopRegexes) {
  ASSERT_NO_FATAL_FAILURE(StartWithByteTokenizer());
  auto gen = [&](json sp) {
    sp["max_new_tokens"] = 20;
    return PostOk("/generate", {{"input_ids", {63}}, {"sampling_params", sp}});
  };
  json out = gen({{"stop_regex", "N.\\\\"}});
  EXPECT_EQ(out["output_ids"], json({'@', 'G', 'N', 'U', '\\'}));
  EXPECT_EQ(out["text"], "@GNU\\");
  EXPECT_EQ(out["meta_info"]["finish_reason"], json({{"type", "stop"}, {"matched", "N.\\\\"}}));
  // A list: the first pattern to match, anywhere in the output, over tokens, ends it.
  out = gen({{"stop_regex", {"zz", "[a-z]{3}", "G[A-Z]"}}});
  EXPECT_EQ(out["output_ids"].size(), 3u);
  EXPECT_EQ(out["meta_info"]["finish_reason"]["matched"], "G[A-Z]");
  out = gen({{"stop_regex", {"c[a-z]q", "j"}}});
  EXPECT_EQ(out["output_ids"].size(), 7u);  // "j" completes first
  EXPECT_EQ(out["meta_info"]["finish_reason"]["matched"], "j");
  // Anchors are the output's: "^G" never matches, "^@G" at the second token.
  out = gen({{"stop_regex", "^G"}});
  EXPECT_EQ(out["output_ids"].size(), 20u);
  EXPECT_EQ(out["meta_info"]["finish_reason"]["type"], "length");
  out = gen({{"stop_regex", "^@G"}});
  EXPECT_EQ(out["output_ids"].size(), 2u);
  // With stop strings: whichever completes first; a stop string's text is still cut.
  out = gen({{"stop", "cj"}, {"stop_regex", "U"}});
  EXPECT_EQ(out["output_ids"].size(), 4u);
  EXPECT_EQ(out["text"], "@GNU");
  out = gen({{"stop", "NU"}, {"stop_regex", "q"}});
  EXPECT_EQ(out["text"], "@G");
  EXPECT_EQ(out["meta_info"]["finish_reason"]["matched"], "NU");
  // Past the bytes that are not UTF-8 the check goes on.
  out = gen({{"stop_regex", "\\x7f"}});
  EXPECT_EQ(out["output_ids"].size(), 10u);
  for (json none : {json(nullptr), json(""), json::array()}) {
    out = gen({{"stop_regex", none}});
    EXPECT_EQ(out["output_ids"].size(), 20u) << none.dump();
  }
  // A batch: each prompt its own patterns and its own decoded output.
  out = PostOk("/generate", {{"input_ids", {{63}, {63}}},
                             {"sampling_params",
                              {{{"max_new_tokens", 20}, {"stop_regex", "N"}},
                               {{"max_new_tokens", 20}, {"stop_regex", "x"}}}}});
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0]["output_ids"].size(), 3u);
  EXPECT_EQ(out[1]["output_ids"].size(), 9u);

  // Refused, naming the field: what RE2 does not take (Python's backreferences and lookaround
  // among it), and the limits stop strings have.
  const std::vector<std::pair<json, std::string>> bad = {
      {json("(unclosed"), "missing )"},
      {json("(a)\\1"), "not a regular expression RE2 takes"},
      {json("(?=a)"), "not a regular expression RE2 takes"},
      {json::array({"ok", "[z-a]"}), "[z-a]"},
      {json(5), "must be a string or a list of strings"},
      {json(std::vector<std::string>(33, "a")), "more than 32"},
      {json(std::string(1025, 'a')), "longer than 1024 bytes"},
      // Nested counted repetitions past RE2's limits.
      {json("((((a{100}){100}){100}){100})"), "not a regular expression RE2 takes"},
  };
  for (const auto& [value, needle] : bad) {
    auto res =
        Post("/generate", {{"input_ids", {63}}, {"sampling_params", {{"stop_regex", value}}}});
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 400) << value.dump();
    EXPECT_NE(ErrorMessage(res).find("sampling_params.stop_regex"), std::string::npos) << res->body;
    EXPECT_NE(ErrorMessage(res).find(needle), std::string::npos) << res->body;
  }
  // The engine still serves after them.
  EXPECT_EQ(gen({{"stop_regex", "N"}})["output_ids"].size(), 3u);

  // Without a tokenizer a stop regex is refused; none is fine.
  Start({});
  auto res = Post("/generate", {{"input_ids", {63}}, {"sampling_params", {{"stop_regex", "N"}}}});
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  EXPECT_NE(ErrorMessage(res).find("need a tokenizer"), std::string::npos) << res->body;
  out = PostOk(
      "/generate",
      {{"input_ids", {63}}, {"sampling_params", {{"stop_regex", nullptr}, {"max_new_tokens", 3}}}});
  EXPECT_EQ(out["output_ids"].size(), 3u);
}

// Without a tokenizer every text endpoint says so.
TEST_F(ServerTest, TextEndpointsWithoutATokenizerSaySo) {
  for (auto [path, body] : std::vector<std::pair<std::string, json>>{
           {"/generate", {{"text", "a"}}},
           {"/v1/completions", {{"prompt", "a"}}},
           {"/v1/chat/completions",
            {{"messages", json::array({{{"role", "user"}, {"content", "a"}}})}}},
           {"/tokenize", {{"prompt", "a"}}},
           {"/detokenize", {{"tokens", {1}}}},
       }) {
    auto res = Post(path, body);
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 400) << path;
    EXPECT_NE(ErrorMessage(res).find("no tokenizer"), std::string::npos) << path << res->body;
  }
}

TEST_F(ServerTest, ThirtyTwoClientsAtOnce) {
  constexpr int kThreads = 32;
  constexpr int kEach = 4;
  std::atomic<int> good{0};
  std::mutex failures_mu;
  std::vector<std::string> failures;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      httplib::Client c("127.0.0.1", server_->port());
      for (int i = 0; i < kEach; ++i) {
        std::vector<int32_t> prompt = {t, i, 1};
        bool stream = (t + i) % 2 == 0;
        auto res = c.Post("/generate",
                          json({{"input_ids", prompt},
                                {"stream", stream},
                                {"sampling_params", {{"max_new_tokens", 5}}}})
                              .dump(),
                          "application/json");
        if (!res || res->status != 200) {
          std::lock_guard<std::mutex> lock(failures_mu);
          failures.push_back(res ? res->body : httplib::to_string(res.error()));
          continue;
        }
        json out;
        if (stream) {
          bool done = false;
          std::vector<json> events = SseEvents(res->body, &done);
          if (!done || events.empty()) {
            continue;
          }
          out = events.back();
        } else {
          out = json::parse(res->body);
        }
        if (out["output_ids"].size() == 5 && out["output_ids"][4] == FakeToken(prompt, 4)) {
          good++;
        } else {
          std::lock_guard<std::mutex> lock(failures_mu);
          failures.push_back(res->body);
        }
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  EXPECT_EQ(good.load(), kThreads * kEach);
  for (const std::string& f : failures) {
    ADD_FAILURE() << f.substr(0, 400);
  }
}

TEST_F(ServerTest, StopEndsOpenStreams) {
  engine_.Hold(true);
  std::thread t([&] {
    httplib::Client c("127.0.0.1", server_->port());
    c.Post("/generate", json({{"input_ids", {1}}, {"rid", "open"}, {"stream", true}}).dump(),
           "application/json");
  });
  ASSERT_TRUE(engine_.WaitFor([&] { return engine_.submitted_ == 1; }));
  server_->Stop();
  t.join();
  std::lock_guard<std::mutex> lock(engine_.mu());
  EXPECT_EQ(std::count(engine_.cancelled_.begin(), engine_.cancelled_.end(), "open"), 1);
}

}  // namespace
}  // namespace bragg::engine
