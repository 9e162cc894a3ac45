#pragma once

// Data-driven mapping from Megatron-core tensor names to Hugging Face tensor names.
//
// Every Hugging Face tensor is a selection of one Megatron global tensor: optionally one index of
// the stacked layer axis (dim 0), then a list of row ranges on the next dim concatenated in order,
// with all remaining dims whole. The GQA linear_qkv split (per query group: q heads, then k, then
// v), the gated linear_fc1 split ([gate; up]) and vocabulary padding trimming are all row ranges.
//
// Layer tensors are named by their layer-stacked key ("decoder.layers.X" with the layer on dim 0).
// Megatron writes MoE and mixed dense/MoE models with per-layer keys instead
// ("decoder.layers.N.X", no layer axis); the plan accepts either form for every layer tensor.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace bragg::reshard {

// The Hugging Face config.json fields the mappings need.
struct ModelConfig {
  std::string family;  // llama, qwen2, qwen3, qwen3_moe, deepseek_v3
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
  // deepseek_v3 (and Kimi-K2): multi-latent attention, the first `first_k_dense_replace` layers
  // dense, then MoE layers with shared experts and a router expert bias.
  int64_t q_lora_rank = 0;  // 0: no query compression (a plain linear_q_proj)
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  int64_t first_k_dense_replace = 0;
  int64_t num_shared_experts = 0;
  // Routed experts as transformers' fused layout: per MoE layer, mlp.experts.gate_up_proj
  // [experts, 2 x moe_ffn, hidden] ([gate; up] per expert) and mlp.experts.down_proj
  // [experts, hidden, moe_ffn], instead of one gate/up/down_proj.weight per expert.
  bool fused_gate_up = false;
  // Leave Megatron's multi-token-prediction tensors ("mtp.*") out instead of refusing them.
  bool skip_mtp = false;

  bool IsMoeLayer(int64_t layer) const { return num_experts > 0 && layer >= first_k_dense_replace; }
};

// The family for config.json's `model_type` (llama, qwen2, qwen3, qwen3_moe, deepseek_v3, and
// kimi_k2 as deepseek_v3): what --model defaults to. InvalidArgument when the config has no
// model_type or one without a mapping (the message lists the supported ones).
[[nodiscard]] Result<std::string> FamilyFromModelType(const std::string& config_json);

// Parses config.json text for `family`. InvalidArgument for an unknown family (the message lists
// the supported ones), a missing or non-positive field, or heads that do not divide evenly;
// Unimplemented for layouts the tables do not cover (qwen3_moe dense layers, deepseek_v3
// moe_layer_freq other than 1).
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
  int64_t expert = -1;               // index on the expert axis (right after the layer axis)
  std::vector<RowSegment> segments;  // empty: all rows
  // Another name Megatron-core gives the same tensor, tried when src_key is absent (layer
  // tensors: stacked, then per layer). Empty: none.
  std::string alt_src_key;

  // Leading axes fixed to one index (layer, expert); rows are the next dim.
  size_t FixedAxes() const { return (layer >= 0 ? 1 : 0) + (expert >= 0 ? 1 : 0); }
  // The fixed index of leading axis `d` (< FixedAxes()).
  int64_t FixedIndex(size_t d) const { return d == 0 && layer >= 0 ? layer : expert; }
};

// Every Hugging Face tensor of the model, in Hugging Face order (embeddings, layers, norm, head).
std::vector<TensorMapping> BuildMappings(const ModelConfig& cfg);

// "decoder.layers.X" with layer `layer` -> "decoder.layers.<layer>.X" (Megatron's per-layer key).
std::string PerLayerKey(const std::string& stacked_key, int64_t layer);

// Source keys that hold no weights and are skipped (TE _extra_state, rotary buffers).
bool IsIgnoredSourceKey(const std::string& key);

}  // namespace bragg::reshard
