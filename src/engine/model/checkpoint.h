#pragma once

// A Hugging Face model directory as the engine reads it: config.json (the Qwen3 family's fields)
// and the safetensors shards, with or without model.safetensors.index.json. No torch here: the
// files are mapped read-only and described; model.cc turns the bytes into tensors.
//
// Every header field is checked against the file before use (offsets inside the file, sizes that
// match dtype x shape, no overlaps, names unique across shards), so a hostile or truncated file is
// an InvalidArgument naming the file and tensor, never an out-of-bounds read.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace bragg::engine {

// The fields of config.json the engine uses (Qwen3Config / Qwen3MoeConfig in transformers).
struct ModelConfig {
  std::string architecture;  // Qwen3ForCausalLM | Qwen3MoeForCausalLM
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // dense MLP layers
  int num_hidden_layers = 0;
  int num_attention_heads = 0;
  int num_key_value_heads = 0;
  int64_t head_dim = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 1000000.0;
  int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  std::string torch_dtype = "float32";  // bfloat16 | float32 | float16
  // MoE (num_experts 0: dense).
  int num_experts = 0;
  int num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = false;
  int decoder_sparse_step = 1;
  std::vector<int> mlp_only_layers;
  std::vector<int32_t> eos_token_ids;  // config.json's eos_token_id, then generation_config.json's

  bool is_moe_layer(int layer) const;
  std::vector<int> moe_layers() const;
};

// Parses config.json text. InvalidArgument on a field of the wrong type, an unsupported
// architecture or feature (sliding window, rope scaling), or inconsistent sizes.
Result<ModelConfig> ParseModelConfig(std::string_view json_text, std::string_view where);

enum class TensorDType { kF32, kBF16, kF16 };
std::string_view TensorDTypeName(TensorDType t);  // "F32" | "BF16" | "F16"
size_t TensorDTypeSize(TensorDType t);

// One tensor's bytes inside a mapped shard.
struct TensorView {
  std::string name;
  TensorDType dtype = TensorDType::kF32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t bytes = 0;
  std::string file;  // the shard's file name, for messages
};

class MappedFile;

// A model directory opened for reading: config and every tensor, mapped.
class Checkpoint {
 public:
  // Reads `dir`/config.json (and generation_config.json if present) and maps every shard: the
  // ones model.safetensors.index.json names, or else every *.safetensors in the directory.
  static Result<Checkpoint> Open(const std::string& dir);

  const ModelConfig& config() const { return config_; }
  const std::string& dir() const { return dir_; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  // NotFound naming the tensor and directory.
  Result<const TensorView*> Find(std::string_view name) const;

 private:
  std::string dir_;
  ModelConfig config_;
  std::vector<std::shared_ptr<MappedFile>> files_;
  std::map<std::string, TensorView> tensors_;
};

// Parses one safetensors file's bytes (header and layout checks). `file` names it in messages.
// Exposed for the fuzzer and tests; Checkpoint::Open uses it on each mapped shard.
Result<std::vector<TensorView>> ParseSafetensors(const uint8_t* data, size_t size,
                                                 std::string_view file);

}  // namespace bragg::engine
