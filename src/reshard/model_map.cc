#include "reshard/model_map.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

namespace bragg::reshard {

namespace {

Result<int64_t> Field(const nlohmann::json& j, const char* name, int64_t fallback = -1) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) {
    if (fallback > 0) {
      return fallback;
    }
    return absl::InvalidArgumentError(fmt::format("config.json: '{}' missing", name));
  }
  if (!it->is_number_integer() || it->get<int64_t>() <= 0) {
    return absl::InvalidArgumentError(
        fmt::format("config.json: '{}' must be a positive integer", name));
  }
  return it->get<int64_t>();
}

}  // namespace

Result<ModelConfig> ParseModelConfig(const std::string& family, const std::string& config_json) {
  if (family != "llama" && family != "qwen2" && family != "qwen3" && family != "qwen3_moe") {
    if (family == "deepseek_v3") {
      return absl::UnimplementedError(fmt::format(
          "--model {} is not implemented yet (supported: llama, qwen2, qwen3, qwen3_moe)", family));
    }
    return absl::InvalidArgumentError(
        fmt::format("unknown --model '{}' (supported: llama, qwen2, qwen3, qwen3_moe)", family));
  }
  nlohmann::json j = nlohmann::json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("config.json is not a JSON object");
  }
  ModelConfig c;
  c.family = family;
  BRAGG_ASSIGN_OR_RETURN(c.hidden_size, Field(j, "hidden_size"));
  BRAGG_ASSIGN_OR_RETURN(c.num_layers, Field(j, "num_hidden_layers"));
  BRAGG_ASSIGN_OR_RETURN(c.num_heads, Field(j, "num_attention_heads"));
  BRAGG_ASSIGN_OR_RETURN(c.num_kv_heads, Field(j, "num_key_value_heads", c.num_heads));
  if (c.hidden_size % c.num_heads != 0 && !j.contains("head_dim")) {
    return absl::InvalidArgumentError("config.json: hidden_size not divisible by heads");
  }
  BRAGG_ASSIGN_OR_RETURN(c.head_dim, Field(j, "head_dim", c.hidden_size / c.num_heads));
  BRAGG_ASSIGN_OR_RETURN(c.intermediate_size, Field(j, "intermediate_size"));
  BRAGG_ASSIGN_OR_RETURN(c.vocab_size, Field(j, "vocab_size"));
  if (c.num_heads % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        fmt::format("config.json: {} attention heads not divisible by {} key-value heads",
                    c.num_heads, c.num_kv_heads));
  }
  c.tie_word_embeddings = j.value("tie_word_embeddings", false);
  c.qkv_bias = family == "qwen2" || j.value("attention_bias", false);
  c.qk_norm = family == "qwen3" || family == "qwen3_moe";
  if (family == "qwen3_moe") {
    BRAGG_ASSIGN_OR_RETURN(c.num_experts, Field(j, "num_experts"));
    BRAGG_ASSIGN_OR_RETURN(c.moe_intermediate_size, Field(j, "moe_intermediate_size"));
    auto dense = j.find("mlp_only_layers");
    if (j.value("decoder_sparse_step", 1) != 1 ||
        (dense != j.end() && dense->is_array() && !dense->empty())) {
      return absl::UnimplementedError(
          "qwen3_moe with dense layers (mlp_only_layers, decoder_sparse_step) is not supported");
    }
  }
  return c;
}

std::vector<TensorMapping> BuildMappings(const ModelConfig& c) {
  std::vector<TensorMapping> out;
  const int64_t h = c.hidden_size;
  const int64_t hd = c.head_dim;
  const int64_t groups = c.num_kv_heads;
  const int64_t q_per_group = c.num_heads / c.num_kv_heads;
  const int64_t group_rows = (q_per_group + 2) * hd;
  auto add = [&](std::string hf, std::vector<int64_t> shape, std::string src, int64_t layer,
                 std::vector<RowSegment> seg = {}, int64_t expert = -1) {
    out.push_back(TensorMapping{std::move(hf), std::move(shape), std::move(src), layer, expert,
                                std::move(seg)});
  };
  add("model.embed_tokens.weight", {c.vocab_size, h}, "embedding.word_embeddings.weight", -1,
      {{0, c.vocab_size}});
  // Megatron interleaves q, k, v per query group: [g0: q*q_per_group, k, v][g1: ...].
  std::vector<RowSegment> q, k, v;
  for (int64_t g = 0; g < groups; ++g) {
    q.push_back({g * group_rows, q_per_group * hd});
    k.push_back({g * group_rows + q_per_group * hd, hd});
    v.push_back({g * group_rows + (q_per_group + 1) * hd, hd});
  }
  const std::string dl = "decoder.layers.";
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    add(p + "input_layernorm.weight", {h}, dl + "self_attention.linear_qkv.layer_norm_weight", i);
    add(p + "self_attn.q_proj.weight", {c.num_heads * hd, h},
        dl + "self_attention.linear_qkv.weight", i, q);
    add(p + "self_attn.k_proj.weight", {c.num_kv_heads * hd, h},
        dl + "self_attention.linear_qkv.weight", i, k);
    add(p + "self_attn.v_proj.weight", {c.num_kv_heads * hd, h},
        dl + "self_attention.linear_qkv.weight", i, v);
    if (c.qkv_bias) {
      add(p + "self_attn.q_proj.bias", {c.num_heads * hd}, dl + "self_attention.linear_qkv.bias", i,
          q);
      add(p + "self_attn.k_proj.bias", {c.num_kv_heads * hd}, dl + "self_attention.linear_qkv.bias",
          i, k);
      add(p + "self_attn.v_proj.bias", {c.num_kv_heads * hd}, dl + "self_attention.linear_qkv.bias",
          i, v);
    }
    if (c.qk_norm) {
      add(p + "self_attn.q_norm.weight", {hd}, dl + "self_attention.q_layernorm.weight", i);
      add(p + "self_attn.k_norm.weight", {hd}, dl + "self_attention.k_layernorm.weight", i);
    }
    add(p + "self_attn.o_proj.weight", {h, c.num_heads * hd},
        dl + "self_attention.linear_proj.weight", i);
    if (c.num_experts > 0) {
      // MoE layer: the norm is not fused into fc1; experts are stacked on axis 1.
      const int64_t f = c.moe_intermediate_size;
      const std::string ex = dl + "mlp.experts.experts.";
      add(p + "post_attention_layernorm.weight", {h}, dl + "pre_mlp_layernorm.weight", i);
      add(p + "mlp.gate.weight", {c.num_experts, h}, dl + "mlp.router.weight", i);
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const std::string q = fmt::format("{}mlp.experts.{}.", p, e);
        add(q + "gate_proj.weight", {f, h}, ex + "linear_fc1.weight", i, {{0, f}}, e);
        add(q + "up_proj.weight", {f, h}, ex + "linear_fc1.weight", i, {{f, f}}, e);
        add(q + "down_proj.weight", {h, f}, ex + "linear_fc2.weight", i, {}, e);
      }
      continue;
    }
    add(p + "post_attention_layernorm.weight", {h}, dl + "mlp.linear_fc1.layer_norm_weight", i);
    // Megatron's gated fc1 is [gate; up] in the global (torch_dist) tensor.
    add(p + "mlp.gate_proj.weight", {c.intermediate_size, h}, dl + "mlp.linear_fc1.weight", i,
        {{0, c.intermediate_size}});
    add(p + "mlp.up_proj.weight", {c.intermediate_size, h}, dl + "mlp.linear_fc1.weight", i,
        {{c.intermediate_size, c.intermediate_size}});
    add(p + "mlp.down_proj.weight", {h, c.intermediate_size}, dl + "mlp.linear_fc2.weight", i);
  }
  add("model.norm.weight", {h}, "decoder.final_layernorm.weight", -1);
  if (!c.tie_word_embeddings) {
    add("lm_head.weight", {c.vocab_size, h}, "output_layer.weight", -1, {{0, c.vocab_size}});
  }
  return out;
}

bool IsIgnoredSourceKey(const std::string& key) {
  auto ends_with = [&](std::string_view s) {
    return key.size() >= s.size() && key.compare(key.size() - s.size(), s.size(), s) == 0;
  };
  return key.find("._extra_state") != std::string::npos || ends_with("rotary_pos_emb.inv_freq");
}

}  // namespace bragg::reshard
