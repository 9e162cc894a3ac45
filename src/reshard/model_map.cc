#include "reshard/model_map.h"

#include <fmt/format.h>

#include <algorithm>
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

// An optional non-negative integer: absent or null gives 0.
Result<int64_t> OptionalField(const nlohmann::json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) {
    return 0;
  }
  if (!it->is_number_integer() || it->get<int64_t>() < 0) {
    return absl::InvalidArgumentError(
        fmt::format("config.json: '{}' must be a non-negative integer or null", name));
  }
  return it->get<int64_t>();
}

constexpr const char* kFamilies = "llama, qwen2, qwen3, qwen3_moe, deepseek_v3";

Status ParseDeepseekV3(const nlohmann::json& j, ModelConfig* c) {
  BRAGG_ASSIGN_OR_RETURN(c->q_lora_rank, OptionalField(j, "q_lora_rank"));
  BRAGG_ASSIGN_OR_RETURN(c->kv_lora_rank, Field(j, "kv_lora_rank"));
  BRAGG_ASSIGN_OR_RETURN(c->qk_nope_head_dim, Field(j, "qk_nope_head_dim"));
  BRAGG_ASSIGN_OR_RETURN(c->qk_rope_head_dim, Field(j, "qk_rope_head_dim"));
  BRAGG_ASSIGN_OR_RETURN(c->v_head_dim, Field(j, "v_head_dim"));
  BRAGG_ASSIGN_OR_RETURN(c->num_experts, Field(j, "n_routed_experts"));
  BRAGG_ASSIGN_OR_RETURN(c->moe_intermediate_size, Field(j, "moe_intermediate_size"));
  BRAGG_ASSIGN_OR_RETURN(c->num_shared_experts, OptionalField(j, "n_shared_experts"));
  BRAGG_ASSIGN_OR_RETURN(c->first_k_dense_replace, OptionalField(j, "first_k_dense_replace"));
  if (j.value("moe_layer_freq", 1) != 1) {
    return absl::UnimplementedError(
        "deepseek_v3 with moe_layer_freq other than 1 is not supported (only the first "
        "first_k_dense_replace layers may be dense)");
  }
  c->first_k_dense_replace = std::min(c->first_k_dense_replace, c->num_layers);
  return absl::OkStatus();
}

}  // namespace

std::string PerLayerKey(const std::string& stacked_key, int64_t layer) {
  static constexpr std::string_view kPrefix = "decoder.layers.";
  if (stacked_key.compare(0, kPrefix.size(), kPrefix) != 0) {
    return stacked_key;
  }
  return fmt::format("{}{}.{}", kPrefix, layer, stacked_key.substr(kPrefix.size()));
}

Result<std::string> FamilyFromModelType(const std::string& config_json) {
  nlohmann::json j = nlohmann::json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("config.json is not a JSON object");
  }
  auto it = j.find("model_type");
  if (it == j.end() || !it->is_string()) {
    return absl::InvalidArgumentError(
        fmt::format("config.json has no model_type string: pass --model ({})", kFamilies));
  }
  const std::string type = it->get<std::string>();
  for (const char* family : {"llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"}) {
    if (type == family) {
      return type;
    }
  }
  if (type == "kimi_k2") {
    return std::string("deepseek_v3");
  }
  return absl::InvalidArgumentError(
      fmt::format("config.json's model_type '{}' is not supported (supported: {}; Kimi-K2 is "
                  "deepseek_v3); pass --model if the architecture is one of them",
                  type, kFamilies));
}

Result<ModelConfig> ParseModelConfig(const std::string& family, const std::string& config_json) {
  if (family != "llama" && family != "qwen2" && family != "qwen3" && family != "qwen3_moe" &&
      family != "deepseek_v3") {
    return absl::InvalidArgumentError(fmt::format(
        "unknown --model '{}' (supported: {}; Kimi-K2 is deepseek_v3)", family, kFamilies));
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
  BRAGG_ASSIGN_OR_RETURN(c.intermediate_size, Field(j, "intermediate_size"));
  BRAGG_ASSIGN_OR_RETURN(c.vocab_size, Field(j, "vocab_size"));
  c.tie_word_embeddings = j.value("tie_word_embeddings", false);
  if (family == "deepseek_v3") {
    BRAGG_RETURN_IF_ERROR(ParseDeepseekV3(j, &c));
    return c;
  }
  BRAGG_ASSIGN_OR_RETURN(c.num_kv_heads, Field(j, "num_key_value_heads", c.num_heads));
  if (c.hidden_size % c.num_heads != 0 && !j.contains("head_dim")) {
    return absl::InvalidArgumentError("config.json: hidden_size not divisible by heads");
  }
  BRAGG_ASSIGN_OR_RETURN(c.head_dim, Field(j, "head_dim", c.hidden_size / c.num_heads));
  if (c.num_heads % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        fmt::format("config.json: {} attention heads not divisible by {} key-value heads",
                    c.num_heads, c.num_kv_heads));
  }
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

namespace {

// Appends mappings; `src` is the layer-stacked Megatron key, `layer` -1 for non-layer tensors.
class MappingTable {
 public:
  explicit MappingTable(std::vector<TensorMapping>* out) : out_(out) {}

  void Add(std::string hf, std::vector<int64_t> shape, std::string src, int64_t layer,
           std::vector<RowSegment> seg = {}, int64_t expert = -1) {
    out_->push_back(TensorMapping{std::move(hf), std::move(shape), std::move(src), layer, expert,
                                  std::move(seg)});
  }

  // The last mapping added is also found under `src` (TensorMapping::alt_src_key).
  void SetAlternative(std::string src) { out_->back().alt_src_key = std::move(src); }

  // A gated MLP whose fc1 is [gate; up] (rows) of `ffn` each: gate_proj, up_proj, down_proj.
  void AddGatedMlp(const std::string& hf_prefix, const std::string& src_prefix, int64_t layer,
                   int64_t ffn, int64_t h, int64_t expert = -1) {
    Add(hf_prefix + "gate_proj.weight", {ffn, h}, src_prefix + "linear_fc1.weight", layer,
        {{0, ffn}}, expert);
    Add(hf_prefix + "up_proj.weight", {ffn, h}, src_prefix + "linear_fc1.weight", layer,
        {{ffn, ffn}}, expert);
    Add(hf_prefix + "down_proj.weight", {h, ffn}, src_prefix + "linear_fc2.weight", layer, {},
        expert);
  }

 private:
  std::vector<TensorMapping>* out_;
};

const std::string kLayers = "decoder.layers.";

// Llama/Qwen attention: Megatron interleaves q, k, v per query group:
// [g0: q x q_per_group, k, v][g1: ...]; the input norm is fused into linear_qkv.
void AddGqaAttention(const ModelConfig& c, const std::string& p, int64_t i, MappingTable* t) {
  const int64_t h = c.hidden_size;
  const int64_t hd = c.head_dim;
  const int64_t q_per_group = c.num_heads / c.num_kv_heads;
  const int64_t group_rows = (q_per_group + 2) * hd;
  std::vector<RowSegment> q, k, v;
  for (int64_t g = 0; g < c.num_kv_heads; ++g) {
    q.push_back({g * group_rows, q_per_group * hd});
    k.push_back({g * group_rows + q_per_group * hd, hd});
    v.push_back({g * group_rows + (q_per_group + 1) * hd, hd});
  }
  const std::string sa = kLayers + "self_attention.";
  t->Add(p + "input_layernorm.weight", {h}, sa + "linear_qkv.layer_norm_weight", i);
  t->Add(p + "self_attn.q_proj.weight", {c.num_heads * hd, h}, sa + "linear_qkv.weight", i, q);
  t->Add(p + "self_attn.k_proj.weight", {c.num_kv_heads * hd, h}, sa + "linear_qkv.weight", i, k);
  t->Add(p + "self_attn.v_proj.weight", {c.num_kv_heads * hd, h}, sa + "linear_qkv.weight", i, v);
  if (c.qkv_bias) {
    t->Add(p + "self_attn.q_proj.bias", {c.num_heads * hd}, sa + "linear_qkv.bias", i, q);
    t->Add(p + "self_attn.k_proj.bias", {c.num_kv_heads * hd}, sa + "linear_qkv.bias", i, k);
    t->Add(p + "self_attn.v_proj.bias", {c.num_kv_heads * hd}, sa + "linear_qkv.bias", i, v);
  }
  if (c.qk_norm) {
    t->Add(p + "self_attn.q_norm.weight", {hd}, sa + "q_layernorm.weight", i);
    t->Add(p + "self_attn.k_norm.weight", {hd}, sa + "k_layernorm.weight", i);
  }
  t->Add(p + "self_attn.o_proj.weight", {h, c.num_heads * hd}, sa + "linear_proj.weight", i);
}

// Multi-latent attention (DeepSeek-V3, Kimi-K2). Megatron's MLA keeps every projection whole in
// the global tensor and in Hugging Face's row order (kv_up rows per head: [k_nope; v]), so each
// tensor is a plain copy: the down projections are replicated across tensor-parallel ranks, the
// up projections (with the q_a/kv_a norms fused in as layer_norm_weight) and linear_q_proj are
// column-parallel, linear_proj row-parallel; the chunk boxes carry all of that.
void AddMlaAttention(const ModelConfig& c, const std::string& p, int64_t i, MappingTable* t) {
  const int64_t h = c.hidden_size;
  const int64_t qk_head = c.qk_nope_head_dim + c.qk_rope_head_dim;
  const std::string sa = kLayers + "self_attention.";
  t->Add(p + "input_layernorm.weight", {h}, kLayers + "input_layernorm.weight", i);
  if (c.q_lora_rank > 0) {
    t->Add(p + "self_attn.q_a_proj.weight", {c.q_lora_rank, h}, sa + "linear_q_down_proj.weight",
           i);
    t->Add(p + "self_attn.q_a_layernorm.weight", {c.q_lora_rank},
           sa + "linear_q_up_proj.layer_norm_weight", i);
    t->Add(p + "self_attn.q_b_proj.weight", {c.num_heads * qk_head, c.q_lora_rank},
           sa + "linear_q_up_proj.weight", i);
  } else {
    t->Add(p + "self_attn.q_proj.weight", {c.num_heads * qk_head, h}, sa + "linear_q_proj.weight",
           i);
  }
  t->Add(p + "self_attn.kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_head_dim, h},
         sa + "linear_kv_down_proj.weight", i);
  t->Add(p + "self_attn.kv_a_layernorm.weight", {c.kv_lora_rank},
         sa + "linear_kv_up_proj.layer_norm_weight", i);
  t->Add(p + "self_attn.kv_b_proj.weight",
         {c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank},
         sa + "linear_kv_up_proj.weight", i);
  t->Add(p + "self_attn.o_proj.weight", {h, c.num_heads * c.v_head_dim}, sa + "linear_proj.weight",
         i);
}

// Dense MLP: the post-attention norm is fused into linear_fc1; fc1 is [gate; up] globally.
void AddDenseMlp(const ModelConfig& c, const std::string& p, int64_t i, MappingTable* t) {
  t->Add(p + "post_attention_layernorm.weight", {c.hidden_size},
         kLayers + "mlp.linear_fc1.layer_norm_weight", i);
  t->AddGatedMlp(p + "mlp.", kLayers + "mlp.", i, c.intermediate_size, c.hidden_size);
}

// MoE MLP: separate pre-MLP norm, the router, routed experts stacked on the expert axis (each
// expert's fc1 is [gate; up]), and for deepseek_v3 the router's expert bias and shared experts.
void AddMoeMlp(const ModelConfig& c, const std::string& p, int64_t i, MappingTable* t) {
  const int64_t h = c.hidden_size;
  const int64_t f = c.moe_intermediate_size;
  const int64_t n = c.num_experts;
  const std::string mlp = kLayers + "mlp.";
  const std::string ex = mlp + "experts.experts.";
  // The TransformerEngine layer spec keeps the pre-MLP norm as its own module; the local spec's
  // sharded state dict renames it after the dense layer's fused norm (megatron-core's
  // sharded_state_dict_keys_map), even where the MoE layer has no linear_fc1.
  t->Add(p + "post_attention_layernorm.weight", {h}, kLayers + "pre_mlp_layernorm.weight", i);
  t->SetAlternative(kLayers + "mlp.linear_fc1.layer_norm_weight");
  t->Add(p + "mlp.gate.weight", {n, h}, mlp + "router.weight", i);
  if (c.family == "deepseek_v3") {
    t->Add(p + "mlp.gate.e_score_correction_bias", {n}, mlp + "router.expert_bias", i);
  }
  if (c.fused_gate_up) {
    // The global [experts, 2f, h] of one layer is exactly the fused layout.
    t->Add(p + "mlp.experts.gate_up_proj", {n, 2 * f, h}, ex + "linear_fc1.weight", i);
    t->Add(p + "mlp.experts.down_proj", {n, h, f}, ex + "linear_fc2.weight", i);
  } else {
    for (int64_t e = 0; e < n; ++e) {
      t->AddGatedMlp(fmt::format("{}mlp.experts.{}.", p, e), ex, i, f, h, e);
    }
  }
  if (c.num_shared_experts > 0) {
    t->AddGatedMlp(p + "mlp.shared_experts.", mlp + "shared_experts.", i, f * c.num_shared_experts,
                   h);
  }
}

}  // namespace

std::vector<TensorMapping> BuildMappings(const ModelConfig& c) {
  std::vector<TensorMapping> out;
  MappingTable t(&out);
  const int64_t h = c.hidden_size;
  t.Add("model.embed_tokens.weight", {c.vocab_size, h}, "embedding.word_embeddings.weight", -1,
        {{0, c.vocab_size}});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    if (c.family == "deepseek_v3") {
      AddMlaAttention(c, p, i, &t);
    } else {
      AddGqaAttention(c, p, i, &t);
    }
    if (c.IsMoeLayer(i)) {
      AddMoeMlp(c, p, i, &t);
    } else {
      AddDenseMlp(c, p, i, &t);
    }
  }
  t.Add("model.norm.weight", {h}, "decoder.final_layernorm.weight", -1);
  if (!c.tie_word_embeddings) {
    t.Add("lm_head.weight", {c.vocab_size, h}, "output_layer.weight", -1, {{0, c.vocab_size}});
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
