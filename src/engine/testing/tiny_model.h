#pragma once

// Writes a random Qwen3 / Qwen3-MoE checkpoint (config.json + one F32 or BF16 safetensors file)
// for tests and benchmarks: the layout transformers' save_pretrained writes, weights drawn from
// N(0, std) with a fixed seed, norms at 1.

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace bragg::engine::testing {

struct TinyModelSpec {
  bool moe = true;
  int64_t vocab = 256;
  int64_t hidden = 64;
  int64_t intermediate = 128;
  int layers = 2;
  int heads = 4;
  int kv_heads = 2;
  int64_t head_dim = 16;
  int experts = 8;
  int top_k = 2;
  int64_t moe_intermediate = 32;
  bool tie_embeddings = false;
  int64_t context = 4096;
  bool bf16 = false;
  float std = 0.2f;
  uint64_t seed = 1;
  std::vector<int32_t> eos;  // eos_token_id in config.json
};

// Writes the model into `dir` (created if missing). `scale` multiplies every weight (a second
// "version" of the same shapes for weight-update tests).
Status WriteTinyModel(const std::string& dir, const TinyModelSpec& spec, float scale = 1.0f);

}  // namespace bragg::engine::testing
