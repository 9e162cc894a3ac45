// bragg-gateway-bench: the gateway's numbers in one run.
//  1. Trace replay (routing only, in process): 1,000 rollouts x 20 turns sharing an 8K-token
//     system prompt over 8 workers with exact LRU prefix caches; token-weighted cache hit rate
//     and max/min worker load per policy, against a single-worker oracle.
//  2. Gateway overhead over real HTTP on loopback with a no-op worker: latency through the
//     gateway minus latency straight to the worker, p50/p99, at the rate the machine reaches.
//  3. Routed-experts payload bytes and client time per turn, delta vs full, 4K..128K context.

#include <fmt/format.h>
#include <httplib.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "gateway/gateway.h"
#include "gateway/radix_cache.h"
#include "gateway/routed_experts.h"
#include "gateway/router.h"
#include "gateway/sim_worker.h"

namespace bragg::gateway {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

struct Turn {
  std::vector<int32_t> tool;  // tokens appended before the turn (tool output / user message)
  int output = 0;             // tokens generated
};

struct Rollout {
  std::vector<Turn> turns;
  std::vector<int32_t> convo;
};

struct TraceOptions {
  int rollouts = 1000;
  int turns = 20;
  int workers = 8;
  int system_prompt = 8192;
  size_t cache_tokens = size_t{4} << 20;  // per worker
  int concurrency = 256;                  // requests in flight at once
  uint64_t seed = 1;
};

std::vector<Rollout> MakeTrace(const TraceOptions& o) {
  std::mt19937_64 rng(o.seed);
  std::lognormal_distribution<double> tool_len(5.5, 1.0);  // median ~245, long tail
  std::uniform_int_distribution<int> out_len(50, 400);
  std::uniform_int_distribution<int> task_len(200, 800);
  std::vector<Rollout> rs(o.rollouts);
  int32_t next_token = 100000;
  for (int r = 0; r < o.rollouts; ++r) {
    Rollout& ro = rs[r];
    for (int t = 0; t < o.turns; ++t) {
      Turn turn;
      int n = t == 0 ? o.system_prompt + task_len(rng)
                     : std::min(8000, static_cast<int>(tool_len(rng)) + 10);
      for (int i = 0; i < n; ++i) {
        // The system prompt is identical across rollouts; everything else is unique.
        turn.tool.push_back(t == 0 && i < o.system_prompt ? i + 1 : next_token++);
      }
      turn.output = out_len(rng);
      ro.turns.push_back(std::move(turn));
    }
  }
  return rs;
}

struct TraceResult {
  std::string name;
  double hit_rate = 0;
  double max_min_requests = 0;
  double max_min_prefill = 0;
  double seconds = 0;
};

// Replays the trace: every turn of every rollout, turn-major in shuffled order, `concurrency`
// requests in flight at once. policy < 0: one worker with an unbounded cache (the oracle).
TraceResult Replay(const TraceOptions& o, std::vector<Rollout> rs, int policy_index,
                   const std::string& name) {
  auto start = Clock::now();
  bool oracle = policy_index < 0;
  int nworkers = oracle ? 1 : o.workers;
  RouterOptions ro;
  ro.policy = oracle ? Policy::kRoundRobin : static_cast<Policy>(policy_index);
  ro.tree_capacity_tokens = o.cache_tokens;
  Router router(ro);
  std::vector<std::unique_ptr<RadixCache>> caches;
  for (int w = 0; w < nworkers; ++w) {
    router.AddWorker(fmt::format("http://w{}", w));
    caches.push_back(std::make_unique<RadixCache>(oracle ? 0 : o.cache_tokens));
  }
  std::vector<uint64_t> requests(nworkers, 0), prefill(nworkers, 0);
  uint64_t prompt_total = 0, cached_total = 0;
  std::mt19937_64 rng(o.seed + 7);
  std::vector<int> order(rs.size());
  for (size_t i = 0; i < order.size(); ++i) {
    order[i] = static_cast<int>(i);
  }
  uint64_t out_token = 1u << 30;
  for (int t = 0; t < o.turns; ++t) {
    std::shuffle(order.begin(), order.end(), rng);
    for (size_t b = 0; b < order.size(); b += o.concurrency) {
      size_t e = std::min(order.size(), b + o.concurrency);
      std::vector<int> picked;
      for (size_t i = b; i < e; ++i) {
        Rollout& r = rs[order[i]];
        r.convo.insert(r.convo.end(), r.turns[t].tool.begin(), r.turns[t].tool.end());
        auto d = router.Route(fmt::format("r{}", order[i]), r.convo);
        picked.push_back(d->worker);
      }
      for (size_t i = b; i < e; ++i) {
        Rollout& r = rs[order[i]];
        int w = picked[i - b];
        size_t cached = std::min(caches[w]->Match(r.convo), r.convo.size() - 1);
        for (int k = 0; k < r.turns[t].output; ++k) {
          r.convo.push_back(static_cast<int32_t>(out_token++ & 0x7fffffff));
        }
        size_t prompt = r.convo.size() - r.turns[t].output;
        caches[w]->Insert(r.convo);
        prompt_total += prompt;
        cached_total += cached;
        requests[w]++;
        prefill[w] += prompt - cached;
        router.Finish(w, prompt, cached);
      }
    }
  }
  TraceResult res;
  res.name = name;
  res.hit_rate = static_cast<double>(cached_total) / static_cast<double>(prompt_total);
  auto ratio = [](const std::vector<uint64_t>& v) {
    auto [mn, mx] = std::minmax_element(v.begin(), v.end());
    return *mn == 0 ? 1e9 : static_cast<double>(*mx) / static_cast<double>(*mn);
  };
  res.max_min_requests = ratio(requests);
  res.max_min_prefill = ratio(prefill);
  res.seconds = Seconds(Clock::now() - start);
  return res;
}

struct Latency {
  double p50_us = 0, p99_us = 0, rps = 0;
  uint64_t errors = 0, n = 0;
};

Latency Hammer(int port, int threads, double seconds) {
  std::vector<std::vector<double>> lat(threads);
  std::atomic<uint64_t> errors{0};
  auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  std::vector<std::thread> ts;
  auto start = Clock::now();
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      httplib::Client c("127.0.0.1", port);
      c.set_keep_alive(true);
      c.set_tcp_nodelay(true);
      uint64_t i = 0;
      while (Clock::now() < deadline) {
        std::string body = fmt::format(
            R"({{"input_ids":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16],"routing_key":"r{}-{}","sampling_params":{{"max_new_tokens":1}}}})",
            t, i++ % 64);
        auto s = Clock::now();
        auto r = c.Post("/generate", body, "application/json");
        double us = std::chrono::duration<double, std::micro>(Clock::now() - s).count();
        if (!r || r->status != 200) {
          errors++;
          continue;
        }
        lat[t].push_back(us);
      }
    });
  }
  for (auto& th : ts) {
    th.join();
  }
  double wall = Seconds(Clock::now() - start);
  std::vector<double> all;
  for (auto& v : lat) {
    all.insert(all.end(), v.begin(), v.end());
  }
  std::sort(all.begin(), all.end());
  Latency l;
  l.n = all.size();
  l.errors = errors;
  if (!all.empty()) {
    l.p50_us = all[all.size() / 2];
    l.p99_us = all[all.size() * 99 / 100];
  }
  l.rps = static_cast<double>(all.size()) / wall;
  return l;
}

}  // namespace
}  // namespace bragg::gateway

int main(int argc, char** argv) {
  using namespace bragg::gateway;
  CLI::App app{"Bragg gateway benchmark"};
  TraceOptions to;
  int threads = 2;
  double seconds = 3;
  int max_context_k = 128;
  bool skip_trace = false;
  int io_threads = 0;
  app.add_option("--rollouts", to.rollouts);
  app.add_option("--turns", to.turns);
  app.add_option("--workers", to.workers);
  app.add_option("--cache-tokens", to.cache_tokens, "exact KV cache per worker, tokens");
  app.add_option("--concurrency", to.concurrency);
  app.add_option("--threads", threads, "client threads for the overhead run");
  app.add_option("--seconds", seconds, "duration of each overhead run");
  app.add_option("--max-context-k", max_context_k, "largest context for routed experts, K tokens");
  app.add_flag("--skip-trace", skip_trace);
  app.add_option("--io-threads", io_threads, "gateway event-loop threads (0: one per core)");
  CLI11_PARSE(app, argc, argv);
  std::signal(SIGPIPE, SIG_IGN);

  if (!skip_trace) {
    std::vector<Rollout> trace = MakeTrace(to);
    std::printf(
        "## trace replay: %d rollouts x %d turns, %d-token shared system prompt, %d "
        "workers, %zu-token LRU cache per worker, %d in flight\n",
        to.rollouts, to.turns, to.system_prompt, to.workers, to.cache_tokens, to.concurrency);
    TraceResult oracle = Replay(to, trace, -1, "oracle (1 worker, unbounded cache)");
    std::printf(
        "| policy | token-weighted hit rate | vs oracle | max/min requests | max/min "
        "prefill tokens | replay s |\n|---|---|---|---|---|---|\n");
    std::printf("| %s | %.4f | 1.000 | - | - | %.1f |\n", oracle.name.c_str(), oracle.hit_rate,
                oracle.seconds);
    double rr_hit = 0;
    for (auto [p, name] : std::vector<std::pair<Policy, std::string>>{
             {Policy::kSticky, "sticky"},
             {Policy::kCacheAware, "cache_aware"},
             {Policy::kRoundRobin, "round_robin"},
             {Policy::kLeastLoad, "least_load"},
             {Policy::kSglCacheAware, "sgl-router cache_aware (0.3, 64, 1.5)"}}) {
      TraceResult r = Replay(to, trace, static_cast<int>(p), name);
      if (p == Policy::kRoundRobin) {
        rr_hit = r.hit_rate;
      }
      std::printf("| %s | %.4f | %.3f | %.2f | %.2f | %.1f |\n", r.name.c_str(), r.hit_rate,
                  r.hit_rate / oracle.hit_rate, r.max_min_requests, r.max_min_prefill, r.seconds);
      std::fflush(stdout);
    }
    std::printf("round_robin hit rate %.4f (sticky / round_robin ratio printed above)\n", rr_hit);
  }

  // Overhead.
  {
    SimWorkerOptions wo;
    wo.noop = true;
    SimWorker worker(wo);
    if (!worker.Start().ok()) {
      std::fprintf(stderr, "cannot start no-op worker\n");
      return 1;
    }
    GatewayOptions go;
    go.workers = {worker.url()};
    go.health_interval_ms = 1000;
    go.io_threads = io_threads;
    Gateway gw(go);
    if (!gw.Start().ok()) {
      std::fprintf(stderr, "cannot start gateway\n");
      return 1;
    }
    Latency direct = Hammer(worker.port(), threads, seconds);
    Latency via = Hammer(gw.port(), threads, seconds);
    std::printf(
        "\n## gateway overhead, no-op worker, %d closed-loop client threads, %u CPUs, %d gateway "
        "io threads\n",
        threads, std::thread::hardware_concurrency(), gw.io_threads());
    std::printf("| path | requests/s | p50 us | p99 us | errors |\n|---|---|---|---|---|\n");
    std::printf("| direct to worker | %.0f | %.1f | %.1f | %lu |\n", direct.rps, direct.p50_us,
                direct.p99_us, direct.errors);
    std::printf("| through gateway | %.0f | %.1f | %.1f | %lu |\n", via.rps, via.p50_us, via.p99_us,
                via.errors);
    std::printf("overhead: p50 %.1f us, p99 %.1f us\n", via.p50_us - direct.p50_us,
                via.p99_us - direct.p99_us);
    gw.Stop();
    worker.Stop();
  }

  // Routed experts, delta vs full.
  {
    MoeShape shape{60, 8, 384};  // Kimi-K2-like: 60 MoE layers, top-8 of 384 experts
    const size_t new_per_turn = 1000;
    std::printf("\n## routed experts per turn (60 layers x top-8, %zu new tokens per turn)\n",
                new_per_turn);
    std::printf(
        "| context | full bytes | delta bytes | full client ms | delta client ms | equal "
        "|\n|---|---|---|---|---|---|\n");
    for (int k = 4; k <= max_context_k; k *= 2) {
      size_t total = static_cast<size_t>(k) * 1024;
      std::vector<int32_t> tokens(total);
      for (size_t i = 0; i < total; ++i) {
        tokens[i] = static_cast<int32_t>(i * 2654435761u % 150000);
      }
      std::vector<uint32_t> versions(total, VersionId("1"));
      size_t prev = total - new_per_turn;
      std::vector<int32_t> full_arr, prefix_arr, suffix_arr;
      AppendSimRoutedExperts(tokens, versions, 0, total - 1, shape, &full_arr);
      AppendSimRoutedExperts(tokens, versions, 0, prev - 1, shape, &prefix_arr);
      AppendSimRoutedExperts(tokens, versions, prev - 1, total - 1, shape, &suffix_arr);
      std::string full_b64 = EncodeRoutedExperts(full_arr);
      std::string delta_b64 = EncodeRoutedExperts(suffix_arr);
      // Client: full = decode everything and replace; delta = decode the suffix and append.
      auto t0 = Clock::now();
      RoutedExpertsAssembler full_asm;
      auto f = DecodeRoutedExperts(full_b64);
      (void)full_asm.Append(0, total, *f);
      auto t1 = Clock::now();
      // The client's array has grown turn by turn (geometric capacity), as in a real rollout:
      // build it from two earlier turns so the timed append is not a first reallocation.
      RoutedExpertsAssembler delta_asm;
      size_t prev2 = prev - new_per_turn;
      size_t split = (prev2 - 1) * shape.per_token();
      (void)delta_asm.Append(0, prev2, std::span<const int32_t>(prefix_arr).first(split));
      (void)delta_asm.Append(prev2 - 1, prev, std::span<const int32_t>(prefix_arr).subspan(split));
      auto t2 = Clock::now();
      auto d = DecodeRoutedExperts(delta_b64);
      bool ok = delta_asm.Append(prev - 1, total, *d).ok();
      auto t3 = Clock::now();
      bool equal = ok && delta_asm.data() == full_asm.data();
      std::printf("| %dK | %zu | %zu | %.2f | %.3f | %s |\n", k, full_b64.size(), delta_b64.size(),
                  Seconds(t1 - t0) * 1e3, Seconds(t3 - t2) * 1e3, equal ? "yes" : "NO");
      std::fflush(stdout);
    }
  }
  return 0;
}
