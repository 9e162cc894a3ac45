#include "rl/metrics.h"

#include <absl/strings/numbers.h>
#include <fmt/format.h>
#include <httplib.h>

#include <array>
#include <nlohmann/json.hpp>
#include <thread>
#include <utility>

#include "common/http_server.h"
#include "common/prometheus.h"
#include "common/str_cat.h"
#include "rl/config.h"

namespace bragg::rl {
namespace {

using json = nlohmann::json;

// Tool-call latency buckets, seconds: a Python tool server answers in milliseconds, a real
// simulation in minutes.
constexpr std::array<double, 14> kToolBounds = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                                0.25,  0.5,    1,     2.5,  10,    60,   600};

// Step-line keys kept as gauges (the last step's value): metric name, key, help.
struct Field {
  const char* name;
  const char* key;
  const char* help;
};
constexpr Field kGauges[] = {
    {"bragg_rl_step", "step", "Training steps done."},
    {"bragg_rl_reward_mean", "reward_mean", "Mean sampled reward of the last step's batch."},
    {"bragg_rl_success_rate", "success_rate", "Share of the last step's batch with reward >= 1."},
    {"bragg_rl_generate_tokens_per_second", "gen_tokens_per_s",
     "Tokens generated per second over the last step's interval."},
    {"bragg_rl_train_tokens_per_second", "train_tokens_per_s",
     "Tokens trained per second in the last step."},
    {"bragg_rl_cache_hit_ratio", "cache_hit_rate",
     "Prompt tokens of turns after the first found in the engines' cache, last interval."},
    {"bragg_rl_engine_idle_ratio", "engine_idle_fraction",
     "Wall-clock share with no /generate in flight, last interval."},
    {"bragg_rl_loss", "loss", "The last step's loss."},
    {"bragg_rl_kl", "kl", "The last step's KL to the reference policy."},
    {"bragg_rl_entropy", "entropy", "The last step's mean token entropy."},
    {"bragg_rl_clip_fraction", "clip_fraction", "Share of tokens clipped in the last step."},
    {"bragg_rl_grad_norm", "grad_norm", "Gradient norm of the last step."},
    {"bragg_rl_run_seconds", "time_s", "Seconds since the RL loop started, at the last step."},
};
// Step-line keys summed over the run.
constexpr Field kCounters[] = {
    {"bragg_rl_trajectories_trained_total", "samples", "Trajectories trained on."},
    {"bragg_rl_groups_trained_total", "groups", "GRPO groups trained on."},
    {"bragg_rl_over_stale_total", "over_stale",
     "Trajectories trained beyond max_staleness (must stay 0)."},
    {"bragg_rl_dropped_stale_total", "dropped_stale",
     "Trajectories dropped for being older than max_staleness."},
    {"bragg_rl_tool_failures_total", "tool_failures",
     "Tool calls whose server hung, crashed or was killed."},
    {"bragg_rl_sandbox_failures_total", "sandbox_failures",
     "Rollouts that lost their sandbox or could not get one."},
    {"bragg_rl_generate_retries_total", "generate_retries",
     "Model turns asked again after an engine or the gateway failed them."},
};

double Number(const json& v) { return v.is_number() ? v.get<double>() : 0.0; }

void Header(std::string* out, std::string_view name, std::string_view type, std::string_view help) {
  *out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, PrometheusHelpText(help), name, type);
}

std::string Value(double v) { return fmt::format("{}", v); }

}  // namespace

RunMetrics::RunMetrics(std::function<LiveState()> live)
    : live_(std::move(live)), tool_buckets_(kToolBounds.size(), 0.0) {}

void RunMetrics::ObserveStep(const json& line) {
  std::lock_guard<std::mutex> l(mu_);
  for (const Field& f : kGauges) {
    auto it = line.find(f.key);
    if (it != line.end() && it->is_number()) {
      gauges_[f.name] = it->get<double>();
    }
  }
  // Absent when no trajectory of the step was sampled wholly by the current weights.
  auto agreement = line.find("logprob_agreement_max");
  if (agreement != line.end() && agreement->is_number() && agreement->get<double>() >= 0) {
    gauges_["bragg_rl_logprob_agreement_max"] = agreement->get<double>();
  }
  if (auto e = line.find("eval_success"); e != line.end() && e->is_number()) {
    gauges_["bragg_rl_eval_success"] = e->get<double>();
  }
  for (const Field& f : kCounters) {
    auto it = line.find(f.key);
    if (it != line.end()) {
      counters_[f.name] += Number(*it);
    }
  }
  // Cumulative in the line already.
  if (auto g = line.find("dropped_groups"); g != line.end() && g->is_number()) {
    counters_["bragg_rl_groups_dropped_total"] = g->get<double>();
  }
  if (auto d = line.find("dropped"); d != line.end() && d->is_object()) {
    for (const auto& [reason, n] : d->items()) {
      dropped_[reason] += Number(n);
    }
  }
  if (auto s = line.find("staleness"); s != line.end() && s->is_object()) {
    for (const auto& [age, n] : s->items()) {
      int64_t versions = 0;
      if (absl::SimpleAtoi(age, &versions)) {
        staleness_[versions] += Number(n);
      }
    }
  }
  if (auto t = line.find("time_split"); t != line.end() && t->is_object()) {
    for (const auto& [key, v] : t->items()) {
      std::string phase =
          key.size() > 2 && key.ends_with("_s") ? key.substr(0, key.size() - 2) : key;
      phases_[phase] += Number(v);
    }
  }
}

void RunMetrics::ObserveEval(double success) {
  std::lock_guard<std::mutex> l(mu_);
  gauges_["bragg_rl_eval_success"] = success;
}

void RunMetrics::ObserveToolCall(double ms) {
  std::lock_guard<std::mutex> l(mu_);
  double s = ms / 1000.0;
  for (size_t i = 0; i < kToolBounds.size(); ++i) {
    if (s <= kToolBounds[i]) {
      tool_buckets_[i] += 1;
      break;
    }
  }
  tool_sum_s_ += s;
  ++tool_count_;
}

std::string RunMetrics::Render() const {
  LiveState live;
  if (live_) {
    live = live_();  // outside mu_: the callback takes the controller's locks
  }
  std::lock_guard<std::mutex> l(mu_);
  std::string out;
  auto gauge = [&](std::string_view name, std::string_view help, double v) {
    Header(&out, name, "gauge", help);
    out += fmt::format("{} {}\n", name, Value(v));
  };
  gauge("bragg_rl_version", "The fleet's weight version.", static_cast<double>(live.version));
  gauge("bragg_rl_rollouts_in_flight", "Agent loops running.",
        static_cast<double>(live.rollouts_in_flight));
  gauge("bragg_rl_generate_in_flight", "/generate calls in flight.",
        static_cast<double>(live.generate_in_flight));
  gauge("bragg_rl_groups_admitted", "GRPO groups started and not yet trained or dropped.",
        static_cast<double>(live.groups_admitted));
  for (const Field& f : kGauges) {
    if (auto it = gauges_.find(f.name); it != gauges_.end()) {
      gauge(f.name, f.help, it->second);
    }
  }
  if (auto it = gauges_.find("bragg_rl_logprob_agreement_max"); it != gauges_.end()) {
    gauge(it->first,
          "Largest |trainer - engine| log-prob on the last step's fresh trajectories (0 with "
          "deterministic kernels).",
          it->second);
  }
  if (auto it = gauges_.find("bragg_rl_eval_success"); it != gauges_.end()) {
    gauge(it->first, "Greedy success on the held-out prompts, last evaluation.", it->second);
  }
  for (const Field& f : kCounters) {
    Header(&out, f.name, "counter", f.help);
    auto it = counters_.find(f.name);
    out += fmt::format("{} {}\n", f.name, Value(it == counters_.end() ? 0.0 : it->second));
  }
  Header(&out, "bragg_rl_groups_dropped_total", "counter",
         "GRPO groups dropped (fewer than two trajectories left).");
  auto g = counters_.find("bragg_rl_groups_dropped_total");
  out += fmt::format("bragg_rl_groups_dropped_total {}\n",
                     Value(g == counters_.end() ? 0.0 : g->second));
  Header(&out, "bragg_rl_trajectories_dropped_total", "counter",
         "Trajectories that could not be trained on, by reason.");
  for (const auto& [reason, n] : dropped_) {
    out += fmt::format("bragg_rl_trajectories_dropped_total{{reason=\"{}\"}} {}\n",
                       PrometheusLabelValue(reason), Value(n));
  }
  Header(&out, "bragg_rl_trained_staleness_total", "counter",
         "Trajectories trained on, by versions behind the trainer (oldest token).");
  for (const auto& [age, n] : staleness_) {
    out += fmt::format("bragg_rl_trained_staleness_total{{versions=\"{}\"}} {}\n", age, Value(n));
  }
  Header(&out, "bragg_rl_phase_seconds_total", "counter",
         "Seconds spent per phase: generate, tools and verify summed over agent loops; train, "
         "sync and wait on the trainer's thread.");
  for (const auto& [phase, s] : phases_) {
    out += fmt::format("bragg_rl_phase_seconds_total{{phase=\"{}\"}} {}\n",
                       PrometheusLabelValue(phase), Value(s));
  }
  Header(&out, "bragg_rl_tool_call_seconds", "histogram", "Tool-call latency.");
  double cumulative = 0;
  for (size_t i = 0; i < kToolBounds.size(); ++i) {
    cumulative += tool_buckets_[i];
    out += fmt::format("bragg_rl_tool_call_seconds_bucket{{le=\"{}\"}} {}\n", kToolBounds[i],
                       Value(cumulative));
  }
  out += fmt::format("bragg_rl_tool_call_seconds_bucket{{le=\"+Inf\"}} {}\n", tool_count_);
  out += fmt::format("bragg_rl_tool_call_seconds_sum {}\n", Value(tool_sum_s_));
  out += fmt::format("bragg_rl_tool_call_seconds_count {}\n", tool_count_);
  return out;
}

struct MetricsServer::Impl {
  httplib::Server http;
  std::thread thread;
};

MetricsServer::MetricsServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

MetricsServer::~MetricsServer() {
  impl_->http.stop();
  if (impl_->thread.joinable()) {
    impl_->thread.join();
  }
}

Result<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& listen,
                                                            const RunMetrics* metrics) {
  BRAGG_ASSIGN_OR_RETURN(auto hp, ParseHostPort(listen));
  auto impl = std::make_unique<Impl>();
  impl->http.new_task_queue = [] { return new ElasticTaskQueue(4); };
  impl->http.Get("/metrics", [metrics](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics->Render(), "text/plain; version=0.0.4");
  });
  BRAGG_ASSIGN_OR_RETURN(int port, BindServer(impl->http, hp.first, hp.second));
  BRAGG_ASSIGN_OR_RETURN(impl->thread, ServeInBackground(impl->http));
  std::unique_ptr<MetricsServer> server(new MetricsServer(std::move(impl)));
  std::string host = hp.first.find(':') != std::string::npos ? Cat("[", hp.first, "]") : hp.first;
  server->url_ = Cat("http://", host, ":", port, "/metrics");
  return server;
}

}  // namespace bragg::rl
