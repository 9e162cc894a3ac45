#pragma once

// Data-driven mapping from Megatron-core tensor names to Hugging Face tensor names.
//
// Every Hugging Face tensor is a selection of one Megatron global tensor: optionally one index of
// the stacked layer axis (dim 0), then a list of row ranges on the next dim concatenated in order,
// with all remaining dims whole. The GQA linear_qkv split (per query group: q heads, then k, then
// v), the gated linear_fc1 split ([gate; up]) and vocabulary padding trimming are all row ranges.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace bragg::reshard {

// The Hugging Face config.json fields the mappings need.
struct ModelConfig {
  std::string family;  // llama, qwen2, qwen3, qwen3_moe
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate_size = 0;
  int64_t vocab_size = 0;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // qwen2 always; llama/qwen3 when attention_bias is set
  bool qk_norm = false;   // qwen3, qwen3_moe
  // qwen3_moe: every layer is MoE (mlp_only_layers empty, decoder_sparse_step 1).
  int64_t num_experts = 0;
  int64_t moe_intermediate_size = 0;
};

// Parses config.json text for `family`. InvalidArgument for an unknown family (the message lists
// the supported ones), a missing or non-positive field, or heads that do not divide evenly.
[[nodiscard]] Result<ModelConfig> ParseModelConfig(const std::string& family,
                                                   const std::string& config_json);

struct RowSegment {
  int64_t start = 0;  // first row in the source tensor (after the layer axis)
  int64_t count = 0;
};

struct TensorMapping {
  std::string hf_name;
  std::vector<int64_t> hf_shape;  // as Hugging Face expects it, from the config
  std::string src_key;
  int64_t layer = -1;                // index on the stacked layer axis (dim 0); -1: not stacked
  int64_t expert = -1;               // index on the expert axis (dim 1, after the layer axis)
  std::vector<RowSegment> segments;  // empty: all rows

  // Leading axes fixed to one index (layer, expert); rows are the next dim.
  size_t FixedAxes() const { return (layer >= 0 ? 1 : 0) + (expert >= 0 ? 1 : 0); }
};

// Every Hugging Face tensor of the model, in Hugging Face order (embeddings, layers, norm, head).
std::vector<TensorMapping> BuildMappings(const ModelConfig& cfg);

// Source keys that hold no weights and are skipped (TE _extra_state, rotary buffers).
bool IsIgnoredSourceKey(const std::string& key);

}  // namespace bragg::reshard
