#include "engine/testing/tiny_model.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>

#include "common/str_cat.h"

namespace bragg::engine::testing {
namespace {

uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace

Status WriteTinyModel(const std::string& dir, const TinyModelSpec& s, float scale) {
  std::filesystem::create_directories(dir);
  nlohmann::json cfg = {{"architectures", {s.moe ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM"}},
                        {"model_type", s.moe ? "qwen3_moe" : "qwen3"},
                        {"vocab_size", s.vocab},
                        {"hidden_size", s.hidden},
                        {"intermediate_size", s.intermediate},
                        {"num_hidden_layers", s.layers},
                        {"num_attention_heads", s.heads},
                        {"num_key_value_heads", s.kv_heads},
                        {"head_dim", s.head_dim},
                        {"rms_norm_eps", 1e-6},
                        {"rope_theta", 1000000.0},
                        {"max_position_embeddings", s.context},
                        {"tie_word_embeddings", s.tie_embeddings},
                        {"torch_dtype", s.bf16 ? "bfloat16" : "float32"}};
  if (s.moe) {
    cfg["num_experts"] = s.experts;
    cfg["num_experts_per_tok"] = s.top_k;
    cfg["moe_intermediate_size"] = s.moe_intermediate;
    cfg["norm_topk_prob"] = true;
    cfg["decoder_sparse_step"] = 1;
    cfg["mlp_only_layers"] = nlohmann::json::array();
  }
  if (!s.eos.empty()) {
    cfg["eos_token_id"] = s.eos.size() == 1 ? nlohmann::json(s.eos[0]) : nlohmann::json(s.eos);
  }
  std::ofstream(dir + "/config.json") << cfg.dump(2);

  std::map<std::string, std::vector<int64_t>> shapes;
  int64_t H = s.hidden, hd = s.head_dim;
  shapes["model.embed_tokens.weight"] = {s.vocab, H};
  shapes["model.norm.weight"] = {H};
  if (!s.tie_embeddings) shapes["lm_head.weight"] = {s.vocab, H};
  for (int i = 0; i < s.layers; ++i) {
    std::string p = Cat("model.layers.", i, ".");
    shapes[p + "input_layernorm.weight"] = {H};
    shapes[p + "post_attention_layernorm.weight"] = {H};
    shapes[p + "self_attn.q_proj.weight"] = {s.heads * hd, H};
    shapes[p + "self_attn.k_proj.weight"] = {s.kv_heads * hd, H};
    shapes[p + "self_attn.v_proj.weight"] = {s.kv_heads * hd, H};
    shapes[p + "self_attn.o_proj.weight"] = {H, s.heads * hd};
    shapes[p + "self_attn.q_norm.weight"] = {hd};
    shapes[p + "self_attn.k_norm.weight"] = {hd};
    if (s.moe) {
      shapes[p + "mlp.gate.weight"] = {s.experts, H};
      for (int e = 0; e < s.experts; ++e) {
        std::string q = Cat(p, "mlp.experts.", e, ".");
        shapes[q + "gate_proj.weight"] = {s.moe_intermediate, H};
        shapes[q + "up_proj.weight"] = {s.moe_intermediate, H};
        shapes[q + "down_proj.weight"] = {H, s.moe_intermediate};
      }
    } else {
      shapes[p + "mlp.gate_proj.weight"] = {s.intermediate, H};
      shapes[p + "mlp.up_proj.weight"] = {s.intermediate, H};
      shapes[p + "mlp.down_proj.weight"] = {H, s.intermediate};
    }
  }
  std::mt19937_64 rng(s.seed);
  std::normal_distribution<float> normal(0.0f, s.std);
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  size_t elem = s.bf16 ? 2 : 4;
  for (const auto& [name, shape] : shapes) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    bool norm = name.find("norm.weight") != std::string::npos;
    size_t begin = data.size();
    data.resize(begin + static_cast<size_t>(n) * elem);
    for (int64_t i = 0; i < n; ++i) {
      float v = (norm ? 1.0f : normal(rng)) * scale;
      if (s.bf16) {
        uint16_t b = ToBf16(v);
        std::memcpy(data.data() + begin + i * 2, &b, 2);
      } else {
        std::memcpy(data.data() + begin + i * 4, &v, 4);
      }
    }
    header[name] = {{"dtype", s.bf16 ? "BF16" : "F32"},
                    {"shape", shape},
                    {"data_offsets", {begin, data.size()}}};
  }
  std::string h = header.dump();
  uint64_t len = h.size();
  std::ofstream f(dir + "/model.safetensors", std::ios::binary);
  f.write(reinterpret_cast<const char*>(&len), 8);
  f.write(h.data(), static_cast<std::streamsize>(h.size()));
  f.write(data.data(), static_cast<std::streamsize>(data.size()));
  if (!f) {
    return absl::InternalError(Cat("cannot write ", dir, "/model.safetensors"));
  }
  return absl::OkStatus();
}

}  // namespace bragg::engine::testing
