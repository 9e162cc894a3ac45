// bragg-engine's speed in process (no HTTP), measured as bench/engine/transformers_generate.py
// measures transformers' generate() on the same weights and threads (bench/engine/run.py runs
// both and writes the table in docs/benchmarks.md).
//
//   engine_bench --model DIR [--threads N] [--batches 1,8,32,64] [--prompt-tokens 128]
//                [--new-tokens 128] [--prefill-tokens 4096] [--deterministic]
//                [--temperature T --logprobs]  (an RL rollout's sampling: T 1, with log-probs)
//   engine_bench --write-model DIR [--seed S] [--scale X]
//                (the benchmark's ~30M-parameter Qwen3-MoE, random weights; another seed or scale
//                writes a second checkpoint of the same shapes, for weight updates)
//
// decode: B requests of random prompts submitted at once, greedy (or at --temperature), never
// stopped early; decode tokens/s is B x (new tokens - 1) over the time from the last request's
// first token to the end.
// prefill: one prompt of --prefill-tokens, max_new_tokens 1: time to first token and tokens/s.
// Prints one JSON object.

#include <CLI/CLI.hpp>
#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "common/blas_core.h"
#include "engine/engine.h"
#include "engine/testing/tiny_model.h"

namespace {

using bragg::engine::Engine;
using bragg::engine::GenerateOutput;
using bragg::engine::GenerateRequest;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

std::vector<int32_t> Random(int n, uint32_t seed, int64_t vocab) {
  std::mt19937 rng(seed);
  std::vector<int32_t> v(n);
  for (auto& t : v) t = static_cast<int32_t>(rng() % vocab);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  bragg::ReexecForKnownBlasCore(argv);  // before anything else runs
  CLI::App app{"bragg-engine benchmark (in process)"};
  std::string model, write_model, batches = "1,8,32,64";
  int threads = 2, prompt = 128, fresh = 128, prefill = 4096;
  bool deterministic = false, logprobs = false;
  float temperature = 0;
  uint64_t seed = 1;
  float scale = 1.0f;
  app.add_option("--model", model, "model directory");
  app.add_option("--write-model", write_model, "write the benchmark model here and exit");
  app.add_option("--threads", threads, "torch threads");
  app.add_option("--batches", batches, "concurrent requests, comma-separated");
  app.add_option("--prompt-tokens", prompt, "prompt tokens per decode request");
  app.add_option("--new-tokens", fresh, "new tokens per decode request");
  app.add_option("--prefill-tokens", prefill, "prompt of the time-to-first-token run (0: skip)");
  app.add_flag("--deterministic", deterministic, "batch-invariant kernels");
  app.add_option("--temperature", temperature, "decode requests' temperature (0: greedy)");
  app.add_flag("--logprobs", logprobs, "decode requests return their tokens' log-probs");
  app.add_option("--seed", seed, "--write-model: the weights' seed");
  app.add_option("--scale", scale, "--write-model: multiply every weight");
  CLI11_PARSE(app, argc, argv);

  if (!write_model.empty()) {
    bragg::engine::testing::TinyModelSpec s;
    s.moe = true;
    s.vocab = 32000;
    s.hidden = 256;
    s.layers = 4;
    s.heads = 8;
    s.kv_heads = 2;
    s.head_dim = 32;
    s.experts = 16;
    s.top_k = 2;
    s.moe_intermediate = 256;
    s.context = 8192;
    s.std = 0.05f;
    s.seed = seed;
    auto st = bragg::engine::testing::WriteTinyModel(write_model, s, scale);
    if (!st.ok()) {
      std::cerr << st << "\n";
      return 1;
    }
    return 0;
  }
  bragg::engine::EngineOptions o;
  o.model_dir = model;
  o.threads = threads;
  o.max_running = 64;
  o.deterministic = deterministic;
  o.kv_cache_tokens = 64 * (prompt + fresh) + prefill + 256;
  auto engine = Engine::Create(o);
  if (!engine.ok()) {
    std::cerr << engine.status() << "\n";
    return 1;
  }
  Engine& e = **engine;
  int64_t vocab = e.model_info().vocab_size;
  nlohmann::json result = {{"threads", threads},
                           {"deterministic", deterministic},
                           {"temperature", temperature},
                           {"logprobs", logprobs},
                           {"cpu_runtime", Engine::CpuRuntime()}};
  nlohmann::json decode = nlohmann::json::array();
  std::stringstream list(batches);
  std::string item;
  uint32_t prompt_seed = 1;
  while (std::getline(list, item, ',')) {
    int b = std::stoi(item);
    (void)e.FlushCache();
    std::vector<std::shared_ptr<bragg::engine::RequestStream>> streams;
    auto t0 = Clock::now();
    for (int i = 0; i < b; ++i) {
      GenerateRequest r;
      r.input_ids = Random(prompt, prompt_seed++, vocab);
      r.sampling.temperature = temperature;
      r.sampling.sampling_seed = i + 1;
      r.return_logprob = logprobs;
      r.sampling.max_new_tokens = fresh;
      r.sampling.ignore_eos = true;
      streams.push_back(*e.Submit(r));
    }
    for (auto& s : streams) s->Wait(0, std::chrono::minutes(10));
    auto t_first = Clock::now();
    for (auto& s : streams) {
      GenerateOutput out;
      while (!out.finished()) out = s->Wait(out.output_ids.size(), std::chrono::minutes(10));
    }
    auto t_end = Clock::now();
    double secs = Seconds(t_first, t_end);
    decode.push_back({{"batch", b},
                      {"seconds", Seconds(t0, t_end)},
                      {"decode_tokens_per_s", b * (fresh - 1) / secs}});
    std::cerr << "engine_bench: batch " << b << ": " << b * (fresh - 1) / secs
              << " decode tokens/s\n";
  }
  result["decode"] = decode;
  if (prefill > 0) {
    (void)e.FlushCache();
    GenerateRequest r;
    r.input_ids = Random(prefill, 99, vocab);
    r.sampling.temperature = 0;
    r.sampling.max_new_tokens = 1;
    r.sampling.ignore_eos = true;
    auto t0 = Clock::now();
    auto s = *e.Submit(r);
    GenerateOutput out;
    while (!out.finished()) out = s->Wait(0, std::chrono::minutes(10));
    double ttft = Seconds(t0, Clock::now());
    result["prefill"] = {
        {"tokens", prefill}, {"ttft_s", ttft}, {"prefill_tokens_per_s", prefill / ttft}};
  }
  std::cout << result.dump() << std::endl;
  return 0;
}
