// bragg-gateway-bench: the gateway's numbers in one run.
//  1. Trace replay (routing only, in process, simulated time): 1,000 rollouts x 20 turns sharing
//     an 8K-token system prompt over 8 workers with exact LRU prefix caches of GPU-sized
//     capacities; token-weighted cache hit rate and max/min worker load per policy, against
//     single-worker oracles.
//  2. Gateway overhead over real HTTP on loopback with a no-op worker: latency through the
//     gateway minus latency straight to the worker, p50/p99, at the rate the machine reaches.
//  3. Routed-experts payload bytes and client time per turn, delta vs full, 4K..128K context.

#include <fmt/format.h>
#include <httplib.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <queue>
#include <random>
#include <thread>
#include <tuple>

#include "gateway/gateway.h"
#include "gateway/radix_cache.h"
#include "gateway/routed_experts.h"
#include "gateway/router.h"
#include "gateway/sim/sim_worker.h"

namespace bragg::gateway {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

struct Turn {
  std::vector<int32_t> tool;  // tokens appended before the turn (task, tool output)
  int output = 0;             // tokens generated
  double tool_s = 0;          // time the tool ran before this turn (0 for the first turn)
};

struct Rollout {
  std::vector<Turn> turns;
  double start_s = 0;
};

// The trace and the fleet it is replayed on. The defaults, and why, are in docs/benchmarks.md.
struct TraceOptions {
  int rollouts = 1000;
  int turns = 20;
  int workers = 8;
  int system_prompt = 8192;
  // Exact KV cache per worker, tokens; one replay per size.
  std::vector<size_t> cache_tokens = {450'000, 820'000, 3'500'000};
  // Rollouts in flight at once (a new one starts when one ends).
  int concurrency = 1000;
  // Token lengths: lognormal (median, sigma), clamped.
  double tool_median = 800, tool_sigma = 1.0;
  double output_median = 400, output_sigma = 0.7;
  // Time model: seconds of tool run between turns (lognormal median, sigma), per-request decode
  // speed and prefill speed of a busy worker.
  double tool_s_median = 3, tool_s_sigma = 1.0;
  double decode_tokens_per_s = 35;
  double prefill_tokens_per_s = 25000;
  uint64_t seed = 1;
};

std::vector<Rollout> MakeTrace(const TraceOptions& o) {
  std::mt19937_64 rng(o.seed);
  std::lognormal_distribution<double> tool_len(std::log(o.tool_median), o.tool_sigma);
  std::lognormal_distribution<double> out_len(std::log(o.output_median), o.output_sigma);
  std::lognormal_distribution<double> tool_s(std::log(o.tool_s_median), o.tool_s_sigma);
  std::uniform_int_distribution<int> task_len(200, 800);
  std::uniform_real_distribution<double> jitter(0, 1);
  std::vector<Rollout> rs(o.rollouts);
  int32_t next_token = 100000;
  for (int r = 0; r < o.rollouts; ++r) {
    Rollout& ro = rs[r];
    ro.start_s = jitter(rng);
    for (int t = 0; t < o.turns; ++t) {
      Turn turn;
      int n = t == 0 ? o.system_prompt + task_len(rng)
                     : std::clamp(static_cast<int>(tool_len(rng)), 20, 16000);
      for (int i = 0; i < n; ++i) {
        // The system prompt is identical across rollouts; everything else is unique.
        turn.tool.push_back(t == 0 && i < o.system_prompt ? i + 1 : next_token++);
      }
      turn.output = std::clamp(static_cast<int>(out_len(rng)), 20, 4000);
      turn.tool_s = t == 0 ? 0 : std::min(300.0, tool_s(rng));
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
  double mean_prompt = 0;
  double seconds = 0;
};

// Replays the trace in simulated time, an event per request start and end: `concurrency`
// rollouts run at once; a turn's request is routed when it arrives, matched against its
// worker's exact LRU cache, holds the worker (in flight) while it prefills the uncached tokens
// and decodes its output, then the rollout's tool runs and its next turn arrives. Rollouts
// interleave as their tool and decode times fall. policy < 0: one worker (the oracle) with a
// cache of `oracle_cache` tokens (0: unbounded).
TraceResult Replay(const TraceOptions& o, size_t cache_tokens, const std::vector<Rollout>& rs,
                   int policy_index, size_t oracle_cache, const std::string& name) {
  auto start = Clock::now();
  bool oracle = policy_index < 0;
  int nworkers = oracle ? 1 : o.workers;
  RouterOptions ro;
  ro.policy = oracle ? Policy::kRoundRobin : static_cast<Policy>(policy_index);
  ro.tree_capacity_tokens = cache_tokens;
  Router router(ro);
  std::vector<std::unique_ptr<RadixCache>> caches;
  for (int w = 0; w < nworkers; ++w) {
    router.AddWorker(fmt::format("http://w{}", w));
    caches.push_back(std::make_unique<RadixCache>(oracle ? oracle_cache : cache_tokens));
  }
  std::vector<uint64_t> requests(nworkers, 0), prefill(nworkers, 0);
  uint64_t prompt_total = 0, cached_total = 0;
  struct Live {
    std::vector<int32_t> convo;
    int turn = 0;
    int worker = -1;
    size_t prompt = 0;
    size_t cached = 0;
  };
  std::vector<Live> live(rs.size());
  // (time, kind, rollout): kind 0 = a turn's request arrives, 1 = it finishes.
  using Event = std::tuple<double, int, int>;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> events;
  size_t next_rollout = 0;
  auto start_next = [&](double now) {
    if (next_rollout < rs.size()) {
      int r = static_cast<int>(next_rollout++);
      events.emplace(now + rs[r].start_s, 0, r);
    }
  };
  for (int i = 0; i < o.concurrency; ++i) {
    start_next(0);
  }
  uint64_t out_token = 1u << 30;
  while (!events.empty()) {
    auto [now, kind, r] = events.top();
    events.pop();
    Live& l = live[r];
    const Turn& turn = rs[r].turns[l.turn];
    std::string key = fmt::format("r{}", r);
    if (kind == 0) {
      l.convo.insert(l.convo.end(), turn.tool.begin(), turn.tool.end());
      auto d = router.Route(key, l.convo);
      l.worker = d->worker;
      RadixCache& cache = *caches[l.worker];
      l.prompt = l.convo.size();
      l.cached = std::min(cache.Match(l.convo), l.convo.size() - 1);
      cache.Insert(l.convo);  // the prompt's KV, computed now
      double busy = static_cast<double>(l.prompt - l.cached) / o.prefill_tokens_per_s +
                    turn.output / o.decode_tokens_per_s;
      events.emplace(now + busy, 1, r);
      continue;
    }
    for (int k = 0; k < turn.output; ++k) {
      l.convo.push_back(static_cast<int32_t>(out_token++ & 0x7fffffff));
    }
    caches[l.worker]->Insert(l.convo);
    prompt_total += l.prompt;
    cached_total += l.cached;
    requests[l.worker]++;
    prefill[l.worker] += l.prompt - l.cached;
    router.Finish(l.worker, l.prompt, l.cached);
    if (++l.turn < o.turns) {
      events.emplace(now + rs[r].turns[l.turn].tool_s, 0, r);
    } else {
      router.Forget(key);
      l.convo = {};
      start_next(now);
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
  res.mean_prompt = static_cast<double>(prompt_total) / static_cast<double>(o.rollouts * o.turns);
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
  app.add_option("--cache-tokens", to.cache_tokens,
                 "exact KV cache per worker, tokens; one replay per value");
  app.add_option("--concurrency", to.concurrency, "rollouts in flight at once");
  app.add_option("--system-prompt", to.system_prompt, "shared system prompt, tokens");
  app.add_option("--tool-median", to.tool_median, "median tool output, tokens");
  app.add_option("--output-median", to.output_median, "median model turn, tokens");
  app.add_option("--seed", to.seed);
  app.add_option("--threads", threads, "client threads for the overhead run");
  app.add_option("--seconds", seconds, "duration of each overhead run");
  app.add_option("--max-context-k", max_context_k, "largest context for routed experts, K tokens");
  app.add_flag("--skip-trace", skip_trace);
  bool trace_only = false;
  app.add_flag("--trace-only", trace_only, "only the trace replay");
  app.add_option("--io-threads", io_threads, "gateway event-loop threads (0: one per core)");
  CLI11_PARSE(app, argc, argv);
  std::signal(SIGPIPE, SIG_IGN);

  if (!skip_trace) {
    std::vector<Rollout> trace = MakeTrace(to);
    uint64_t shared = 0;
    uint64_t prompt_tokens = 0;
    for (const Rollout& r : trace) {
      size_t len = 0;
      for (const Turn& t : r.turns) {
        len += t.tool.size();
        prompt_tokens += len;
        shared += to.system_prompt;
        len += t.output;
      }
    }
    double shared_frac = static_cast<double>(shared) / static_cast<double>(prompt_tokens);
    std::printf(
        "## trace replay: %d rollouts x %d turns (%d in flight), %d-token shared system "
        "prompt, tool outputs lognormal(median %.0f, sigma %.1f), model turns lognormal(median "
        "%.0f, sigma %.1f), %d workers\n",
        to.rollouts, to.turns, to.concurrency, to.system_prompt, to.tool_median, to.tool_sigma,
        to.output_median, to.output_sigma, to.workers);
    std::printf(
        "mean prompt %.0f tokens; the shared system prompt is %.1f%% of prompt tokens, so any "
        "policy hits at least that and sticky/round_robin <= %.2fx\n",
        static_cast<double>(prompt_tokens) / (to.rollouts * to.turns), 100 * shared_frac,
        1 / shared_frac);
    TraceResult unbounded = Replay(to, 0, trace, -1, 0, "oracle: 1 worker, unbounded cache");
    std::printf("unbounded single-worker oracle hit rate %.4f (%.1f s)\n", unbounded.hit_rate,
                unbounded.seconds);
    for (size_t cache : to.cache_tokens) {
      TraceResult pooled = Replay(to, cache, trace, -1, cache * to.workers,
                                  "oracle: 1 worker, the fleet's pooled cache");
      std::printf(
          "\n### %zu-token LRU cache per worker\n| policy | hit rate | vs pooled oracle | vs "
          "unbounded oracle | hit / round_robin | prefill / sticky's | max/min requests | "
          "max/min prefill tokens |\n|---|---|---|---|---|---|---|---|\n",
          cache);
      std::vector<TraceResult> rows;
      for (auto [p, name] : std::vector<std::pair<Policy, std::string>>{
               {Policy::kSticky, "sticky"},
               {Policy::kCacheAware, "cache_aware"},
               {Policy::kRoundRobin, "round_robin"},
               {Policy::kLeastLoad, "least_load"},
               {Policy::kSglCacheAware, "sgl-router cache_aware (0.3, 64, 1.5)"}}) {
        rows.push_back(Replay(to, cache, trace, static_cast<int>(p), 0, name));
      }
      double rr = rows[2].hit_rate;
      double sticky_miss = 1 - rows[0].hit_rate;
      std::printf("| %s | %.4f | 1.000 | %.3f | %.2f | %.2f | - | - |\n", pooled.name.c_str(),
                  pooled.hit_rate, pooled.hit_rate / unbounded.hit_rate, pooled.hit_rate / rr,
                  (1 - pooled.hit_rate) / sticky_miss);
      for (const TraceResult& r : rows) {
        std::printf("| %s | %.4f | %.3f | %.3f | %.2f | %.2f | %.2f | %.2f |\n", r.name.c_str(),
                    r.hit_rate, r.hit_rate / pooled.hit_rate, r.hit_rate / unbounded.hit_rate,
                    r.hit_rate / rr, (1 - r.hit_rate) / sticky_miss, r.max_min_requests,
                    r.max_min_prefill);
      }
      std::fflush(stdout);
    }
  }

  if (trace_only) {
    return 0;
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
