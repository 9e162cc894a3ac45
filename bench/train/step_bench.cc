// bragg-train's training step in process, measured as bench/train/transformers_step.py measures
// transformers + torch.optim.AdamW on the same weights, trajectories and threads
// (bench/train/run.py runs both and writes the train section of docs/benchmarks.md).
//
//   train_step_bench --write-model DIR [--moe] [--vocab V] [--hidden H] [--layers L] ...
//       a random Qwen3 (or Qwen3-MoE) checkpoint (engine/testing/tiny_model.h)
//   train_step_bench --model DIR --write-trajectories FILE [--count N] [--min-len 32]
//                    [--max-len 2048] [--long K] [--seed S]
//       N trajectories of heavy-tailed lengths (log-normal, clipped to [min, max], the last K at
//       max), loss on the second half, behaviour log-probs the model's own (Trainer::LogProbs:
//       the GRPO ratio is 1), rewards random per group of 4; JSONL (TrajectoryToJson)
//   train_step_bench --model DIR --trajectories FILE [--layouts thd,padded] [--steps 3]
//                    [--warmup 1] [--threads 2] [--max-tokens 8192] [--unfused]
//                    [--measure-memory] [--recompute none|selective|full]
//       times Trainer::Step per layout; tokens/s counts the trajectories' tokens (never padding).
//       --measure-memory: one layout only, in this fresh process; adds the peak RSS (VmHWM)
//       after loading and after the steps, and the optimizer's computed device/host bytes.
//
// Prints one JSON object on stdout; progress on stderr.

#include <sys/resource.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "common/blas_core.h"
#include "engine/testing/tiny_model.h"
#include "train/optim/offload_adamw.h"
#include "train/trainer.h"
#include "train/trajectory.h"

namespace {

using bragg::train::Trainer;
using bragg::train::TrainOptions;
using bragg::train::Trajectory;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

// /proc/self/status's field `key` (VmHWM, VmRSS) in KiB; -1 when absent.
int64_t ProcStatusKb(const std::string& key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(key + ":", 0) == 0) {
      return std::stoll(line.substr(key.size() + 1));
    }
  }
  return -1;
}

// Parameter elements of an F32 safetensors file: its data bytes / 4 (tiny_model writes F32).
int64_t SafetensorsElements(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) {
    return -1;
  }
  int64_t size = f.tellg();
  f.seekg(0);
  uint64_t header = 0;
  f.read(reinterpret_cast<char*>(&header), 8);
  return (size - 8 - static_cast<int64_t>(header)) / 4;
}

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) {
      out.push_back(item);
    }
  }
  return out;
}

int Fail(const std::string& what, const bragg::Status& s) {
  std::cerr << "train_step_bench: " << what << ": " << s << "\n";
  return 1;
}

struct GenConfig {
  int count = 64;
  int min_len = 32, max_len = 2048, long_count = 2;
  double median_len = 200, sigma = 1.0;
  uint64_t seed = 1;
};

int WriteTrajectories(const std::string& model, const std::string& out, const GenConfig& g,
                      int threads, int64_t max_tokens) {
  TrainOptions o;
  o.model_dir = model;
  o.threads = threads;
  o.max_tokens = max_tokens;
  auto trainer = Trainer::Create(o);
  if (!trainer.ok()) {
    return Fail("loading " + model, trainer.status());
  }
  std::ifstream cfg(model + "/config.json");
  const int64_t vocab = json::parse(cfg).at("vocab_size").get<int64_t>();
  std::mt19937_64 rng(g.seed);
  std::lognormal_distribution<double> len(std::log(g.median_len), g.sigma);
  std::uniform_real_distribution<double> reward(0.0, 1.0);
  std::vector<Trajectory> batch;
  for (int i = 0; i < g.count; ++i) {
    int n = i >= g.count - g.long_count
                ? g.max_len
                : std::clamp(static_cast<int>(std::lround(len(rng))), g.min_len, g.max_len);
    Trajectory t;
    t.id = "t" + std::to_string(i);
    t.group = "g" + std::to_string(i / 4);
    t.tokens.resize(n);
    for (auto& x : t.tokens) {
      x = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
    }
    t.loss_mask.assign(n, 0);
    std::fill(t.loss_mask.begin() + n / 2, t.loss_mask.end(), 1);
    t.logprobs.assign(n, 0.0f);
    t.reward = reward(rng);
    batch.push_back(std::move(t));
  }
  // The long ones are spread through the batch, not all at its end.
  std::shuffle(batch.begin(), batch.end(), rng);
  auto lp = (*trainer)->LogProbs(batch);
  if (!lp.ok()) {
    return Fail("log-probs", lp.status());
  }
  std::ofstream f(out);
  int64_t tokens = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    batch[i].logprobs = (*lp)[i];
    tokens += static_cast<int64_t>(batch[i].tokens.size());
    f << bragg::train::TrajectoryToJson(batch[i]) << "\n";
  }
  if (!f) {
    std::cerr << "train_step_bench: cannot write " << out << "\n";
    return 1;
  }
  std::cout << json{{"trajectories", batch.size()}, {"tokens", tokens}, {"path", out}}.dump()
            << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bragg::ReexecForKnownBlasCore(argv);  // before anything else runs
  CLI::App app{"bragg-train training-step benchmark (in process)"};
  std::string model, write_model, trajectories, write_trajectories, layouts = "thd,padded";
  int threads = 2, steps = 3, warmup = 1;
  int64_t max_tokens = 8192;
  bool unfused = false, measure_memory = false;
  std::string recompute = "none";
  bragg::engine::testing::TinyModelSpec spec;
  spec.moe = false;
  spec.vocab = 4096;
  spec.hidden = 128;
  spec.intermediate = 384;
  spec.layers = 4;
  spec.heads = 4;
  spec.kv_heads = 2;
  spec.head_dim = 32;
  spec.experts = 8;
  spec.top_k = 2;
  spec.moe_intermediate = 128;
  spec.context = 8192;
  spec.std = 0.05f;
  GenConfig gen;
  app.add_option("--model", model, "model directory");
  app.add_option("--write-model", write_model, "write a random model here and exit");
  app.add_flag("--moe", spec.moe, "--write-model: Qwen3-MoE");
  app.add_option("--vocab", spec.vocab, "--write-model: vocabulary");
  app.add_option("--hidden", spec.hidden, "--write-model: hidden size");
  app.add_option("--intermediate", spec.intermediate, "--write-model: dense MLP size");
  app.add_option("--layers", spec.layers, "--write-model: layers");
  app.add_option("--heads", spec.heads, "--write-model: attention heads");
  app.add_option("--kv-heads", spec.kv_heads, "--write-model: KV heads");
  app.add_option("--head-dim", spec.head_dim, "--write-model: head dimension");
  app.add_option("--experts", spec.experts, "--write-model: experts (MoE)");
  app.add_option("--top-k", spec.top_k, "--write-model: experts per token (MoE)");
  app.add_option("--moe-intermediate", spec.moe_intermediate, "--write-model: expert MLP size");
  app.add_option("--seed", gen.seed, "weights' and trajectories' seed");
  app.add_option("--write-trajectories", write_trajectories,
                 "write the benchmark's trajectories (JSONL) and exit");
  app.add_option("--count", gen.count, "--write-trajectories: how many");
  app.add_option("--min-len", gen.min_len, "--write-trajectories: shortest");
  app.add_option("--max-len", gen.max_len, "--write-trajectories: longest");
  app.add_option("--median-len", gen.median_len, "--write-trajectories: log-normal median");
  app.add_option("--sigma", gen.sigma, "--write-trajectories: log-normal sigma");
  app.add_option("--long", gen.long_count, "--write-trajectories: how many at --max-len");
  app.add_option("--trajectories", trajectories, "JSONL trajectories to train on");
  app.add_option("--layouts", layouts, "thd and/or padded, comma-separated");
  app.add_option("--steps", steps, "timed steps per layout");
  app.add_option("--warmup", warmup, "untimed steps first");
  app.add_option("--threads", threads, "torch threads");
  app.add_option("--max-tokens", max_tokens, "tokens per micro-batch");
  app.add_flag("--unfused", unfused, "whole [T, V] logits + log_softmax");
  app.add_option("--recompute", recompute, "none | selective | full (TrainOptions::recompute)");
  app.add_flag("--measure-memory", measure_memory, "report peak RSS (one layout per process)");
  CLI11_PARSE(app, argc, argv);

  if (!write_model.empty()) {
    spec.seed = gen.seed;
    auto st = bragg::engine::testing::WriteTinyModel(write_model, spec);
    if (!st.ok()) {
      return Fail("writing " + write_model, st);
    }
    return 0;
  }
  if (model.empty()) {
    std::cerr << "train_step_bench: --model DIR (or --write-model DIR) is required\n";
    return 2;
  }
  if (!write_trajectories.empty()) {
    return WriteTrajectories(model, write_trajectories, gen, threads, max_tokens);
  }
  auto batch = bragg::train::ReadTrajectories(trajectories);
  if (!batch.ok()) {
    return Fail("reading trajectories", batch.status());
  }
  int64_t real_tokens = 0;
  for (const Trajectory& t : *batch) {
    real_tokens += static_cast<int64_t>(t.tokens.size());
  }
  std::vector<std::string> names = Split(layouts);
  if (measure_memory && names.size() != 1) {
    std::cerr << "train_step_bench: --measure-memory takes one layout per process\n";
    return 2;
  }
  json out = {
      {"threads", threads},    {"max_tokens", max_tokens},        {"trajectories", batch->size()},
      {"tokens", real_tokens}, {"fused_cross_entropy", !unfused}, {"steps", steps},
      {"warmup", warmup},      {"recompute", recompute}};
  auto recompute_mode = bragg::train::ParseRecompute(recompute);
  if (!recompute_mode.ok()) {
    return Fail("--recompute", recompute_mode.status());
  }
  for (const std::string& name : names) {
    if (name != "thd" && name != "padded") {
      std::cerr << "train_step_bench: unknown layout " << name << " (thd or padded)\n";
      return 2;
    }
    TrainOptions o;
    o.model_dir = model;
    o.threads = threads;
    o.max_tokens = max_tokens;
    o.lr = 1e-6;
    o.padded = name == "padded";
    o.fused_cross_entropy = !unfused;
    o.recompute = *recompute_mode;
    auto trainer = Trainer::Create(o);
    if (!trainer.ok()) {
      return Fail("loading " + model, trainer.status());
    }
    const int64_t hwm_loaded = ProcStatusKb("VmHWM");
    json runs = json::array();
    int micro_batches = 0;
    for (int i = 0; i < warmup + steps; ++i) {
      auto t0 = Clock::now();
      auto m = (*trainer)->Step(*batch);
      double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (!m.ok()) {
        return Fail(name + " step", m.status());
      }
      micro_batches = m->micro_batches;
      std::cerr << "train_step_bench: " << name << (unfused ? " unfused" : "") << " step " << i
                << (i < warmup ? " (warm-up)" : "") << ": " << s << " s, "
                << static_cast<double>(real_tokens) / s << " tokens/s, loss " << m->loss << "\n";
      if (i >= warmup) {
        runs.push_back(s);
      }
    }
    std::vector<double> secs = runs.get<std::vector<double>>();
    std::sort(secs.begin(), secs.end());
    double median = secs.empty() ? 0 : secs[secs.size() / 2];
    if (secs.size() % 2 == 0 && !secs.empty()) {
      median = (secs[secs.size() / 2 - 1] + secs[secs.size() / 2]) / 2;
    }
    json r = {{"step_seconds", runs},
              {"median_step_seconds", median},
              {"tokens_per_second", median > 0 ? static_cast<double>(real_tokens) / median : 0},
              {"micro_batches", micro_batches}};
    if (measure_memory) {
      r["vm_hwm_loaded_kb"] = hwm_loaded;
      r["vm_hwm_kb"] = ProcStatusKb("VmHWM");
      rusage ru{};
      getrusage(RUSAGE_SELF, &ru);
      r["ru_maxrss_kb"] = ru.ru_maxrss;
      // The optimizer's bytes, computed: its device workspace (OffloadAdamW::workspace_bytes of
      // an optimizer over as many elements with the trainer's chunk size) against keeping the
      // whole state (master, exp_avg, exp_avg_sq: 12 bytes per parameter) and the FP32 grads
      // (4 bytes) on the device.
      const int64_t elements = SafetensorsElements(model + "/model.safetensors");
      bragg::train::AdamWOptions ao;
      ao.chunk_elements = o.optimizer_chunk_elements;
      std::vector<std::pair<std::string, torch::Tensor>> params;
      params.emplace_back("all", torch::zeros({elements}, torch::kFloat32).requires_grad_(true));
      auto opt = bragg::train::OffloadAdamW::Create(std::move(params), ao);
      if (!opt.ok()) {
        return Fail("optimizer", opt.status());
      }
      r["parameters"] = elements;
      r["optimizer_chunk_elements"] = ao.chunk_elements;
      r["offload_device_bytes"] = (*opt)->workspace_bytes();
      r["offload_host_state_bytes"] = (*opt)->state_bytes();
      r["full_device_bytes"] = elements * 16;
    }
    out[name] = r;
  }
  std::cout << out.dump() << "\n";
  return 0;
}
