// bragg-rl-controller-bench: what bragg-rl's agent loops cost the controller per turn, and the
// controller memory each live rollout holds (docs/benchmarks.md, "rl").
//
// --loops agent loops run at once, one thread each as bragg-rl runs them (fleet.concurrency),
// through a real bragg-gateway to bragg-sim-worker processes. Mode "controller" runs RunRollout,
// the loop bragg-rl runs (the gateway client with log-probs and delta router replay, the
// vocabulary, the trajectory with per-token versions, tool calls and the verifier), with an
// in-process stub tool server and verifier: everything this process spends is the
// controller's. Mode "bare" is the floor under it: the same loops making only the /generate
// calls, with the same client and the same growing inputs. The gateway and the workers are
// other processes; their CPU is not counted. Prints one JSON object on stdout.

#include <fmt/format.h>
#include <httplib.h>
#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "bench/common/listening_child.h"
#include "common/fs.h"
#include "common/serve.h"
#include "gateway/client.h"
#include "rl/config.h"
#include "rl/rollout.h"
#include "rl/tool_server.h"
#include "rl/vocab.h"

namespace bragg::rl {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// Answers every turn at once; says done after `turns` calls, as a task's server does when the
// model answers.
class StubTools : public ToolChannel {
 public:
  explicit StubTools(int turns) : turns_(turns) {}
  ToolReply Call(std::string_view text, std::chrono::milliseconds) override {
    ToolReply r;
    r.tool = "lattice";
    r.observation = fmt::format("structure fcc a=4.0495 ({} chars read)\n", text.size());
    r.bytes = r.observation.size();
    r.done = ++calls_ >= turns_;
    return r;
  }
  Status Restart() override { return absl::OkStatus(); }

 private:
  int turns_;
  int calls_ = 0;
};

int64_t RssBytes() {
  auto statm = ReadFileToString("/proc/self/statm");
  long pages = 0, resident = 0;
  if (!statm.ok() || std::sscanf(statm->c_str(), "%ld %ld", &pages, &resident) != 2) {
    return -1;
  }
  return static_cast<int64_t>(resident) * ::sysconf(_SC_PAGESIZE);
}

double CpuSeconds() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         static_cast<double>(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

Result<Vocab> BenchVocab() {
  std::vector<std::string> tokens = {"<eos>", "\n", " ", ".", ",", "=", "(", ")", "-", "+"};
  for (char c = 'a'; c <= 'z'; ++c) tokens.emplace_back(1, c);
  for (char c = 'A'; c <= 'Z'; ++c) tokens.emplace_back(1, c);
  for (char c = '0'; c <= '9'; ++c) tokens.emplace_back(1, c);
  return Vocab::FromTokens(std::move(tokens));
}

struct Counters {
  std::atomic<int64_t> turns{0};
  std::atomic<int64_t> rollouts{0};
  std::atomic<int64_t> retries{0};  // /generate calls asked again (RunRollout's failover)
  std::atomic<int> live{0};         // loops inside a rollout now
  std::mutex mu;
  std::map<std::string, int64_t> dropped;  // by reason
  std::string last_detail;
};

struct LoopSetup {
  const Vocab* vocab;
  const TaskConfig* task;
  SamplingConfig sampling;
  std::vector<int32_t> stop_ids;
  std::vector<std::string> gateway_urls;  // loop i uses i % size()
  std::string prompt;
  int turns;
  bool bare;
};

// Loop `index`'s gateway client, as bragg-rl's loops make theirs; a failure is counted.
Result<std::unique_ptr<gateway::RolloutClient>> LoopClient(const LoopSetup& s, int index,
                                                           Counters& c) {
  gateway::ClientOptions co;
  co.return_logprob = true;
  co.return_routed_experts = true;
  auto client = gateway::RolloutClient::Create(
      s.gateway_urls[static_cast<size_t>(index) % s.gateway_urls.size()], co);
  if (!client.ok()) {
    std::lock_guard<std::mutex> l(c.mu);
    c.dropped["client"]++;
  }
  return client;
}

void ControllerLoop(const LoopSetup& s, int index, const std::atomic<bool>& stop, Counters& c) {
  auto client = LoopClient(s, index, c);
  if (!client.ok()) {
    return;
  }
  Verifier verify = [](const std::string&) -> Result<VerifierOutput> {
    return VerifierOutput{"", "1\n"};
  };
  Prompt prompt{s.prompt, "{}", ""};
  for (uint64_t n = 0; !stop.load(std::memory_order_relaxed); ++n) {
    std::string id = fmt::format("loop{}-{}", index, n);
    c.live.fetch_add(1);
    StubTools tools(s.turns);
    RolloutEnv env{s.vocab, s.task, s.stop_ids, client->get(), &tools, verify, nullptr};
    auto r = RunRollout(env, id, "g", prompt, s.sampling, n);
    (void)(*client)->Forget(id);
    c.live.fetch_sub(1);
    if (r.ok()) {
      c.retries.fetch_add(r->generate_retries);
    }
    if (!r.ok() || !r->dropped.empty()) {
      std::lock_guard<std::mutex> l(c.mu);
      c.dropped[r.ok() ? r->dropped : "error"]++;
      c.last_detail = r.ok() ? r->detail : std::string(r.status().message());
      continue;
    }
    c.turns.fetch_add(r->turn_count);
    c.rollouts.fetch_add(1);
  }
}

// The floor: the /generate calls of the same rollouts, and nothing else.
void BareLoop(const LoopSetup& s, int index, const std::atomic<bool>& stop, Counters& c) {
  auto client = LoopClient(s, index, c);
  if (!client.ok()) {
    return;
  }
  std::vector<int32_t> prompt = *s.vocab->Encode(s.prompt);
  std::vector<int32_t> observation = s.vocab->EncodeLossy("structure fcc a=4.0495 (30 chars)\n");
  json sp = {{"temperature", s.sampling.temperature},
             {"max_new_tokens", s.task->max_new_tokens},
             {"stop_token_ids", s.stop_ids}};
  for (uint64_t n = 0; !stop.load(std::memory_order_relaxed); ++n) {
    std::string id = fmt::format("loop{}-{}", index, n);
    c.live.fetch_add(1);
    std::vector<int32_t> ids = prompt;
    int turns = 0;
    for (; turns < s.turns; ++turns) {
      auto out = (*client)->Generate(id, ids, sp);
      if (!out.ok()) {
        std::lock_guard<std::mutex> l(c.mu);
        c.dropped["generate_failed"]++;
        c.last_detail = std::string(out.status().message());
        break;
      }
      ids.insert(ids.end(), out->output_ids.begin(), out->output_ids.end());
      ids.insert(ids.end(), observation.begin(), observation.end());
    }
    (void)(*client)->Forget(id);
    c.live.fetch_sub(1);
    c.turns.fetch_add(turns);
    c.rollouts.fetch_add(turns == s.turns ? 1 : 0);
  }
}

int Main(int argc, char** argv) {
  CLI::App app{
      "bragg-rl's agent loops against bragg-sim-worker: controller CPU per turn and "
      "memory per live rollout"};
  std::string mode = "controller";
  int loops = 1000, workers = 2, turns = 3, new_tokens = 16, decode_us = 0;
  double warmup_s = 5, measure_s = 10;
  std::string gateway_bin = BRAGG_GATEWAY, worker_bin = BRAGG_SIM_WORKER;
  app.add_option("--mode", mode, "controller | bare")->check(CLI::IsMember({"controller", "bare"}));
  app.add_option("--loops", loops, "agent loops at once (threads)")->check(CLI::PositiveNumber);
  app.add_option("--workers", workers, "bragg-sim-worker processes")->check(CLI::PositiveNumber);
  app.add_option("--turns", turns, "model turns per rollout")->check(CLI::PositiveNumber);
  app.add_option("--new-tokens", new_tokens, "tokens per turn")->check(CLI::PositiveNumber);
  app.add_option("--decode-us", decode_us, "the workers' microseconds per output token");
  app.add_option("--warmup-s", warmup_s, "seconds before measuring");
  app.add_option("--measure-s", measure_s, "seconds measured")->check(CLI::PositiveNumber);
  std::string log_dir;
  app.add_option("--log-dir", log_dir, "keep the gateway's and workers' logs here");
  app.add_option("--gateway", gateway_bin, "bragg-gateway binary");
  app.add_option("--sim-worker", worker_bin, "bragg-sim-worker binary");
  CLI11_PARSE(app, argc, argv);

  std::signal(SIGPIPE, SIG_IGN);
  // A gateway holds two descriptors per loop (its client's and its worker's side) and the
  // children inherit this limit: raise the hard limit where allowed (CAP_SYS_RESOURCE), else
  // spread the loops over as many gateways as the limit needs (a machine whose hard limit is
  // 20,000 cannot hold 10,000 loops in one gateway); the loops are the controller's either way.
  const rlim_t per_loop = 2;
  rlim_t want = per_loop * static_cast<rlim_t>(loops) + 1024;
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_max < want) {
    rlimit raised{want, want};
    (void)::setrlimit(RLIMIT_NOFILE, &raised);
  }
  auto nofile = RaiseFileLimit();
  if (!nofile.ok() || *nofile < static_cast<uint64_t>(loops) + 1024) {
    std::fprintf(stderr, "need %d file descriptors (one per loop here), have %s\n", loops + 1024,
                 nofile.ok() ? std::to_string(*nofile).c_str() : "?");
    return 1;
  }
  const int gateways = static_cast<int>((want + *nofile - 1) / *nofile);
  auto vocab = BenchVocab();
  if (!vocab.ok()) {
    std::fprintf(stderr, "%s\n", std::string(vocab.status().message()).c_str());
    return 1;
  }
  auto dir = TempDir::Create("/tmp", "bragg-rl-controller-bench-");
  if (!dir.ok()) {
    std::fprintf(stderr, "%s\n", std::string(dir.status().message()).c_str());
    return 1;
  }
  const std::string logs = log_dir.empty() ? dir->path() : log_dir;
  std::vector<bench::ListeningChild> children;
  std::vector<std::string> gw_argv = {gateway_bin, "--listen", "127.0.0.1:0"};
  for (int w = 0; w < workers; ++w) {
    auto c = bench::StartListeningChild(
        {worker_bin, "--listen", "127.0.0.1:0", "--seed", std::to_string(w + 1), "--vocab",
         std::to_string(vocab->size()), "--decode-us", std::to_string(decode_us)},
        fmt::format("{}/worker-{}.log", logs, w));
    if (!c.ok()) {
      std::fprintf(stderr, "%s\n", std::string(c.status().message()).c_str());
      return 1;
    }
    gw_argv.push_back("--worker");
    gw_argv.push_back(fmt::format("http://127.0.0.1:{}", c->port));
    children.push_back(std::move(*c));
  }
  std::vector<bench::ListeningChild> gws;
  for (int g = 0; g < gateways; ++g) {
    auto gw = bench::StartListeningChild(gw_argv, fmt::format("{}/gateway-{}.log", logs, g));
    if (!gw.ok()) {
      std::fprintf(stderr, "%s\n", std::string(gw.status().message()).c_str());
      return 1;
    }
    gws.push_back(std::move(*gw));
  }

  TaskConfig task;
  task.max_turns = turns;
  task.max_new_tokens = new_tokens;
  task.max_tokens = 1 << 16;
  LoopSetup setup{&*vocab,
                  &task,
                  SamplingConfig{},
                  {*vocab->Id("\n")},
                  {},
                  "Which first peak has Al under Cu K-alpha",
                  turns,
                  mode == "bare"};

  for (const bench::ListeningChild& gw : gws) {
    setup.gateway_urls.push_back(fmt::format("http://127.0.0.1:{}", gw.port));
  }
  int64_t rss_base = RssBytes();
  Counters counters;
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(loops));
  auto t_start = Clock::now();
  for (int i = 0; i < loops; ++i) {
    threads.emplace_back(setup.bare ? BareLoop : ControllerLoop, std::cref(setup), i,
                         std::cref(stop), std::ref(counters));
  }
  double started_s = std::chrono::duration<double>(Clock::now() - t_start).count();
  std::fprintf(stderr, "controller-bench: %s, %d loops started in %.1f s; warming up %.0f s\n",
               mode.c_str(), loops, started_s, warmup_s);
  std::this_thread::sleep_for(std::chrono::duration<double>(warmup_s));

  int64_t turns0 = counters.turns.load(), rollouts0 = counters.rollouts.load();
  double cpu0 = CpuSeconds();
  auto t0 = Clock::now();
  int64_t rss_peak = RssBytes();
  double live_sum = 0;
  int samples = 0;
  while (std::chrono::duration<double>(Clock::now() - t0).count() < measure_s) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    rss_peak = std::max(rss_peak, RssBytes());
    live_sum += counters.live.load();
    ++samples;
  }
  double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  double cpu = CpuSeconds() - cpu0;
  int64_t turns_measured = counters.turns.load() - turns0;
  int64_t rollouts_measured = counters.rollouts.load() - rollouts0;
  stop = true;
  std::fprintf(stderr, "controller-bench: measured %.1f s; ending the loops' last rollouts\n",
               wall);
  for (std::thread& t : threads) {
    t.join();
  }
  // The gateways' own count of what failed on their side.
  json gateway_counters = json::object();
  for (bench::ListeningChild& gw : gws) {
    httplib::Client mc("127.0.0.1", gw.port);
    mc.set_read_timeout(10, 0);
    auto res = mc.Get("/metrics");
    for (const char* name :
         {"bragg_gateway_client_aborts_total", "bragg_gateway_upstream_errors_total"}) {
      size_t at = res && res->status == 200 ? res->body.find(std::string("\n") + name + " ")
                                            : std::string::npos;
      if (at != std::string::npos) {
        gateway_counters[name] = gateway_counters.value(name, int64_t{0}) +
                                 std::atoll(res->body.c_str() + at + std::strlen(name) + 2);
      }
    }
    (void)gw.proc.Signal(SIGTERM);
  }
  for (bench::ListeningChild& c : children) {
    (void)c.proc.Signal(SIGTERM);
  }

  json dropped = json::object();
  int64_t dropped_total = 0;
  for (auto& [why, n] : counters.dropped) {
    dropped[why] = n;
    dropped_total += n;
  }
  json out = {{"mode", mode},
              {"loops", loops},
              {"turns_per_rollout", turns},
              {"tokens_per_turn", new_tokens},
              {"workers", workers},
              {"gateways", gateways},
              {"measure_s", wall},
              {"turns", turns_measured},
              {"rollouts", rollouts_measured},
              {"turns_per_s", static_cast<double>(turns_measured) / wall},
              {"cpu_s", cpu},
              {"cpu_cores_used", cpu / wall},
              {"turns_per_cpu_s", cpu > 0 ? static_cast<double>(turns_measured) / cpu : 0.0},
              {"cpu_us_per_turn",
               turns_measured > 0 ? cpu * 1e6 / static_cast<double>(turns_measured) : 0.0},
              {"live_mean", samples > 0 ? live_sum / samples : 0.0},
              {"rss_base_bytes", rss_base},
              {"rss_live_bytes", rss_peak},
              {"bytes_per_loop", static_cast<double>(rss_peak - rss_base) / loops},
              {"dropped", dropped},
              {"dropped_total", dropped_total},
              {"generate_retries", counters.retries.load()},
              {"gateway", gateway_counters}};
  if (!counters.last_detail.empty()) {
    out["last_drop_detail"] = counters.last_detail;
  }
  std::printf("%s\n", out.dump().c_str());
  return dropped_total == 0 && counters.retries.load() == 0 && turns_measured > 0 ? 0 : 1;
}

}  // namespace
}  // namespace bragg::rl

int main(int argc, char** argv) { return bragg::rl::Main(argc, argv); }
