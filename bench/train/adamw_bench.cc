// train_adamw_bench: OffloadAdamW (the CPU as the device) against torch::optim::AdamW on one
// parameter set of about 64M FP32 elements (a small transformer's mix of matrices and vectors).
// Reports the step time of each and the device bytes each optimizer keeps against the full
// optimizer state. JSON on stdout, a table on stderr.
// Usage: train_adamw_bench [--elements N] [--steps S] [--chunk C]...

#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "train/optim/offload_adamw.h"

namespace bragg::train {
namespace {

using NamedParams = std::vector<std::pair<std::string, torch::Tensor>>;

// Blocks of a hidden-size-1024 transformer: attention and MLP matrices plus norms, until
// `elements`.
NamedParams MakeParams(int64_t elements) {
  const int64_t h = 1024;
  const std::vector<std::pair<std::string, std::vector<int64_t>>> block = {
      {"q", {h, h}},        {"k", {h / 4, h}},    {"v", {h / 4, h}},
      {"o", {h, h}},        {"gate", {3 * h, h}}, {"up", {3 * h, h}},
      {"down", {h, 3 * h}}, {"norm1", {h}},       {"norm2", {h}}};
  NamedParams out;
  int64_t total = 0;
  torch::manual_seed(0);
  for (int layer = 0; total < elements; ++layer) {
    for (const auto& [name, shape] : block) {
      torch::Tensor t = torch::randn(shape) * 0.02;
      total += t.numel();
      out.emplace_back("layer" + std::to_string(layer) + "." + name, t.set_requires_grad(true));
      if (total >= elements) {
        break;
      }
    }
  }
  return out;
}

void SetGrads(const NamedParams& params, int step) {
  for (const auto& [name, p] : params) {
    // A cheap deterministic grad (randn over 64M elements would dominate the run).
    p.mutable_grad() = torch::full_like(p, 1e-3 * (1 + step % 3));
  }
}

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

struct Row {
  std::string name;
  double step_seconds = 0;             // mean over the timed steps
  double min_step_seconds = 0;         // best step: steadier than the mean on a shared machine
  int64_t device_optimizer_bytes = 0;  // what the optimizer keeps on the update's device
  int64_t chunk = 0;
};

Row BenchTorch(int64_t elements, int steps) {
  NamedParams params = MakeParams(elements);
  std::vector<torch::Tensor> leaves;
  for (auto& [name, p] : params) {
    leaves.push_back(p);
  }
  torch::optim::AdamW opt(leaves, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  double total = 0;
  double best = 1e30;
  for (int s = 0; s <= steps; ++s) {
    SetGrads(params, s);
    auto start = std::chrono::steady_clock::now();
    opt.step();
    if (s > 0) {  // step 0 allocates the state
      total += Seconds(start);
      best = std::min(best, Seconds(start));
    }
  }
  int64_t n = 0;
  for (auto& p : leaves) {
    n += p.numel();
  }
  return Row{"torch::optim::AdamW (libtorch 1.13)", total / steps, best, 2 * 4 * n, 0};
}

Result<Row> BenchOffload(int64_t elements, int steps, int64_t chunk) {
  NamedParams params = MakeParams(elements);
  AdamWOptions o;
  o.chunk_elements = chunk;
  BRAGG_ASSIGN_OR_RETURN(auto opt, OffloadAdamW::Create(params, o));
  double total = 0;
  double best = 1e30;
  for (int s = 0; s <= steps; ++s) {
    SetGrads(params, s);
    BRAGG_ASSIGN_OR_RETURN(StepStats stats, opt->Step());
    if (s > 0) {
      total += stats.seconds;
      best = std::min(best, stats.seconds);
    }
  }
  return Row{"OffloadAdamW chunk=" + std::to_string(chunk), total / steps, best,
             opt->workspace_bytes(), chunk};
}

int Main(int argc, char** argv) {
  CLI::App app{"OffloadAdamW against torch::optim::AdamW, the CPU as the device"};
  int64_t elements = int64_t{64} << 20;
  int steps = 5;
  std::vector<int64_t> chunks = {int64_t{1} << 18, int64_t{1} << 20, int64_t{1} << 22};
  app.add_option("--elements", elements, "parameter elements (FP32)");
  app.add_option("--steps", steps, "timed steps per optimizer (after one warm-up)");
  app.add_option("--chunk", chunks, "chunk_elements values to run");
  CLI11_PARSE(app, argc, argv);

  std::vector<Row> rows;
  rows.push_back(BenchTorch(elements, steps));
  for (int64_t chunk : chunks) {
    Result<Row> row = BenchOffload(elements, steps, chunk);
    if (!row.ok()) {
      std::fprintf(stderr, "train_adamw_bench: %s\n", std::string(row.status().ToString()).c_str());
      return 1;
    }
    rows.push_back(*row);
  }
  int64_t n = 0;
  for (const auto& [name, p] : MakeParams(elements)) {
    n += p.numel();
  }
  const int64_t state_bytes = 3 * 4 * n;  // master, exp_avg, exp_avg_sq
  nlohmann::json out = {{"bench", "train_adamw"},
                        {"elements", n},
                        {"steps", steps},
                        {"threads", at::get_num_threads()},
                        {"state_bytes", state_bytes},
                        {"rows", nlohmann::json::array()}};
  std::fprintf(stderr, "%lld FP32 elements, %d timed steps, %d threads; full state %.1f MiB\n",
               static_cast<long long>(n), steps, at::get_num_threads(), state_bytes / 1048576.0);
  std::fprintf(stderr, "%-38s %10s %10s %10s %26s\n", "optimizer", "mean (s)", "best (s)",
               "best/torch", "device state MiB (ratio)");
  for (const Row& r : rows) {
    const double ratio = static_cast<double>(r.device_optimizer_bytes) / state_bytes;
    std::fprintf(stderr, "%-38s %10.3f %10.3f %9.2fx %17.1f (%.4f)\n", r.name.c_str(),
                 r.step_seconds, r.min_step_seconds, r.min_step_seconds / rows[0].min_step_seconds,
                 r.device_optimizer_bytes / 1048576.0, ratio);
    out["rows"].push_back({{"name", r.name},
                           {"chunk_elements", r.chunk},
                           {"step_seconds", r.step_seconds},
                           {"min_step_seconds", r.min_step_seconds},
                           {"min_vs_torch", r.min_step_seconds / rows[0].min_step_seconds},
                           {"device_optimizer_bytes", r.device_optimizer_bytes},
                           {"device_bytes_over_state_bytes", ratio}});
  }
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace
}  // namespace bragg::train

int main(int argc, char** argv) { return bragg::train::Main(argc, argv); }
