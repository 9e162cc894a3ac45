#include "engine/model/checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "common/str_cat.h"
#include "common/unique_fd.h"

namespace bragg::engine {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

Status Bad(std::string_view where, std::string_view what) {
  return absl::InvalidArgumentError(Cat(where, ": ", what));
}

Result<std::string> ReadText(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return ErrnoError("open", path.string());
  }
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Reads an integer field; absent -> `fallback` (nullopt: required).
Status GetInt(const json& j, const char* key, std::optional<int64_t> fallback, int64_t lo,
              int64_t hi, std::string_view where, int64_t* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (!fallback) {
      return Bad(where, Cat("config field ", key, " is required"));
    }
    *out = *fallback;
    return absl::OkStatus();
  }
  if (!it->is_number_integer()) {
    return Bad(where, Cat("config field ", key, " must be an integer"));
  }
  int64_t v = it->get<int64_t>();
  if (v < lo || v > hi) {
    return Bad(where, Cat("config field ", key, " = ", v, " is outside [", lo, ", ", hi, "]"));
  }
  *out = v;
  return absl::OkStatus();
}

template <typename T>
Status GetIntAs(const json& j, const char* key, std::optional<int64_t> fallback, int64_t lo,
                int64_t hi, std::string_view where, T* out) {
  int64_t v = 0;
  BRAGG_RETURN_IF_ERROR(GetInt(j, key, fallback, lo, hi, where, &v));
  *out = static_cast<T>(v);
  return absl::OkStatus();
}

Status GetNumber(const json& j, const char* key, double fallback, std::string_view where,
                 double* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    *out = fallback;
    return absl::OkStatus();
  }
  if (!it->is_number()) {
    return Bad(where, Cat("config field ", key, " must be a number"));
  }
  *out = it->get<double>();
  return absl::OkStatus();
}

Status GetBool(const json& j, const char* key, bool fallback, std::string_view where, bool* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    *out = fallback;
    return absl::OkStatus();
  }
  if (!it->is_boolean()) {
    return Bad(where, Cat("config field ", key, " must be true or false"));
  }
  *out = it->get<bool>();
  return absl::OkStatus();
}

// eos_token_id: an integer or a list of integers.
Status AppendEos(const json& j, std::string_view where, std::vector<int32_t>* out) {
  auto it = j.find("eos_token_id");
  if (it == j.end() || it->is_null()) {
    return absl::OkStatus();
  }
  auto add = [&](const json& v) -> Status {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 ||
        v.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return Bad(where, "eos_token_id must be a token id or a list of them");
    }
    int32_t id = static_cast<int32_t>(v.get<int64_t>());
    if (std::find(out->begin(), out->end(), id) == out->end()) {
      out->push_back(id);
    }
    return absl::OkStatus();
  };
  if (it->is_array()) {
    for (const json& v : *it) {
      BRAGG_RETURN_IF_ERROR(add(v));
    }
    return absl::OkStatus();
  }
  return add(*it);
}

Result<TensorDType> ParseDType(std::string_view s, std::string_view where) {
  if (s == "F32") return TensorDType::kF32;
  if (s == "BF16") return TensorDType::kBF16;
  if (s == "F16") return TensorDType::kF16;
  return Bad(where, Cat("dtype ", s, " is not supported (F32, BF16, F16 are)"));
}

}  // namespace

bool ModelConfig::is_moe_layer(int layer) const {
  if (num_experts <= 0) {
    return false;
  }
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) {
    return false;
  }
  return (layer + 1) % decoder_sparse_step == 0;
}

std::vector<int> ModelConfig::moe_layers() const {
  std::vector<int> out;
  for (int i = 0; i < num_hidden_layers; ++i) {
    if (is_moe_layer(i)) {
      out.push_back(i);
    }
  }
  return out;
}

Result<ModelConfig> ParseModelConfig(std::string_view text, std::string_view where) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Bad(where, "config.json is not a JSON object");
  }
  ModelConfig c;
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty() &&
      j["architectures"][0].is_string()) {
    c.architecture = j["architectures"][0].get<std::string>();
  } else if (j.contains("model_type") && j["model_type"].is_string()) {
    std::string t = j["model_type"].get<std::string>();
    c.architecture = t == "qwen3_moe" ? "Qwen3MoeForCausalLM"
                     : t == "qwen3"   ? "Qwen3ForCausalLM"
                                      : t;
  }
  bool moe = c.architecture == "Qwen3MoeForCausalLM";
  if (!moe && c.architecture != "Qwen3ForCausalLM") {
    return Bad(where, Cat("architecture '", c.architecture,
                          "' is not served (Qwen3ForCausalLM and Qwen3MoeForCausalLM are)"));
  }
  constexpr int64_t kMaxDim = int64_t{1} << 20;
  BRAGG_RETURN_IF_ERROR(
      GetInt(j, "vocab_size", std::nullopt, 1, int64_t{1} << 24, where, &c.vocab_size));
  BRAGG_RETURN_IF_ERROR(GetInt(j, "hidden_size", std::nullopt, 1, kMaxDim, where, &c.hidden_size));
  BRAGG_RETURN_IF_ERROR(
      GetIntAs(j, "num_hidden_layers", std::nullopt, 1, 4096, where, &c.num_hidden_layers));
  BRAGG_RETURN_IF_ERROR(
      GetIntAs(j, "num_attention_heads", std::nullopt, 1, 4096, where, &c.num_attention_heads));
  BRAGG_RETURN_IF_ERROR(GetIntAs(j, "num_key_value_heads", c.num_attention_heads, 1, 4096, where,
                                 &c.num_key_value_heads));
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return Bad(where, "num_attention_heads is not a multiple of num_key_value_heads");
  }
  BRAGG_RETURN_IF_ERROR(
      GetInt(j, "head_dim", c.hidden_size / c.num_attention_heads, 2, 4096, where, &c.head_dim));
  if (c.head_dim % 2 != 0) {
    return Bad(where, "head_dim must be even (rotary embedding)");
  }
  BRAGG_RETURN_IF_ERROR(GetInt(j, "intermediate_size",
                               moe ? std::optional<int64_t>(0) : std::nullopt, 0, kMaxDim, where,
                               &c.intermediate_size));
  BRAGG_RETURN_IF_ERROR(GetNumber(j, "rms_norm_eps", 1e-6, where, &c.rms_norm_eps));
  BRAGG_RETURN_IF_ERROR(GetNumber(j, "rope_theta", 1000000.0, where, &c.rope_theta));
  if (!(c.rope_theta > 0) || !(c.rms_norm_eps >= 0)) {
    return Bad(where, "rope_theta must be positive and rms_norm_eps non-negative");
  }
  BRAGG_RETURN_IF_ERROR(GetInt(j, "max_position_embeddings", 32768, 1, int64_t{1} << 24, where,
                               &c.max_position_embeddings));
  BRAGG_RETURN_IF_ERROR(GetBool(j, "tie_word_embeddings", false, where, &c.tie_word_embeddings));
  BRAGG_RETURN_IF_ERROR(GetBool(j, "attention_bias", false, where, &c.attention_bias));
  bool sliding = false;
  BRAGG_RETURN_IF_ERROR(GetBool(j, "use_sliding_window", false, where, &sliding));
  if (sliding) {
    return Bad(where, "use_sliding_window is not supported");
  }
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    const json& rs = j["rope_scaling"];
    std::string type = rs.is_object() ? rs.value("rope_type", rs.value("type", "")) : "";
    if (type != "default") {
      return Bad(where, Cat("rope_scaling '", rs.dump(), "' is not supported"));
    }
  }
  if (j.contains("torch_dtype") && j["torch_dtype"].is_string()) {
    c.torch_dtype = j["torch_dtype"].get<std::string>();
  } else if (j.contains("dtype") && j["dtype"].is_string()) {
    c.torch_dtype = j["dtype"].get<std::string>();
  }
  if (moe) {
    BRAGG_RETURN_IF_ERROR(
        GetIntAs(j, "num_experts", std::nullopt, 1, 65536, where, &c.num_experts));
    BRAGG_RETURN_IF_ERROR(GetIntAs(j, "num_experts_per_tok", std::nullopt, 1, c.num_experts, where,
                                   &c.num_experts_per_tok));
    BRAGG_RETURN_IF_ERROR(GetInt(j, "moe_intermediate_size", std::nullopt, 1, kMaxDim, where,
                                 &c.moe_intermediate_size));
    BRAGG_RETURN_IF_ERROR(GetBool(j, "norm_topk_prob", false, where, &c.norm_topk_prob));
    BRAGG_RETURN_IF_ERROR(
        GetIntAs(j, "decoder_sparse_step", 1, 1, 4096, where, &c.decoder_sparse_step));
    if (j.contains("mlp_only_layers") && !j["mlp_only_layers"].is_null()) {
      if (!j["mlp_only_layers"].is_array()) {
        return Bad(where, "mlp_only_layers must be a list of layer indices");
      }
      for (const json& v : j["mlp_only_layers"]) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0 ||
            v.get<int64_t>() >= c.num_hidden_layers) {
          return Bad(where, "mlp_only_layers must be a list of layer indices");
        }
        c.mlp_only_layers.push_back(v.get<int>());
      }
    }
    bool dense_layer = false;
    for (int i = 0; i < c.num_hidden_layers; ++i) {
      dense_layer = dense_layer || !c.is_moe_layer(i);
    }
    if (dense_layer && c.intermediate_size <= 0) {
      return Bad(where, "intermediate_size is required for the dense layers of this MoE model");
    }
  } else if (c.intermediate_size <= 0) {
    return Bad(where, "intermediate_size must be positive");
  }
  BRAGG_RETURN_IF_ERROR(AppendEos(j, where, &c.eos_token_ids));
  return c;
}

std::string_view TensorDTypeName(TensorDType t) {
  switch (t) {
    case TensorDType::kF32:
      return "F32";
    case TensorDType::kBF16:
      return "BF16";
    case TensorDType::kF16:
      return "F16";
  }
  return "?";
}

size_t TensorDTypeSize(TensorDType t) { return t == TensorDType::kF32 ? 4 : 2; }

class MappedFile {
 public:
  static Result<std::shared_ptr<MappedFile>> Map(const std::string& path) {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) {
      return ErrnoError("open", path);
    }
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) {
      return ErrnoError("fstat", path);
    }
    auto f = std::shared_ptr<MappedFile>(new MappedFile());
    f->size_ = static_cast<size_t>(st.st_size);
    if (f->size_ > 0) {
      void* p = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
      if (p == MAP_FAILED) {
        return ErrnoError("mmap", path);
      }
      f->data_ = static_cast<const uint8_t*>(p);
    }
    return f;
  }
  ~MappedFile() {
    if (data_ != nullptr) {
      ::munmap(const_cast<uint8_t*>(data_), size_);
    }
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  MappedFile() = default;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

Result<std::vector<TensorView>> ParseSafetensors(const uint8_t* data, size_t size,
                                                 std::string_view file) {
  if (size < 8) {
    return Bad(file, "too short for a safetensors file (no header length)");
  }
  uint64_t header_len = 0;
  std::memcpy(&header_len, data, 8);  // little-endian, as every platform Bragg builds on
  if (header_len > size - 8 || header_len > (uint64_t{100} << 20)) {
    return Bad(file, Cat("header length ", header_len, " does not fit the file (", size,
                         " bytes): truncated or not safetensors"));
  }
  json header = json::parse(data + 8, data + 8 + header_len, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return Bad(file, "the safetensors header is not a JSON object");
  }
  const uint8_t* base = data + 8 + header_len;
  size_t body = size - 8 - header_len;
  std::vector<TensorView> out;
  std::vector<std::pair<size_t, size_t>> ranges;
  for (auto& [name, desc] : header.items()) {
    if (name == "__metadata__") {
      continue;
    }
    std::string where = Cat(file, ": tensor ", name);
    if (!desc.is_object() || !desc.contains("dtype") || !desc["dtype"].is_string() ||
        !desc.contains("shape") || !desc["shape"].is_array() || !desc.contains("data_offsets") ||
        !desc["data_offsets"].is_array() || desc["data_offsets"].size() != 2) {
      return Bad(where, "needs dtype, shape and data_offsets [begin, end]");
    }
    TensorView v;
    v.name = name;
    v.file = std::string(file);
    BRAGG_ASSIGN_OR_RETURN(v.dtype, ParseDType(desc["dtype"].get<std::string>(), where));
    unsigned __int128 elems = 1;
    for (const json& d : desc["shape"]) {
      if (!d.is_number_unsigned()) {
        return Bad(where, "shape must hold non-negative integers");
      }
      v.shape.push_back(static_cast<int64_t>(d.get<uint64_t>() & 0x7fffffffffffffffULL));
      elems *= d.get<uint64_t>();
      if (elems > (static_cast<unsigned __int128>(1) << 62)) {
        return Bad(where, "shape is too large");
      }
    }
    const json& off = desc["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
      return Bad(where, "data_offsets must be non-negative integers");
    }
    uint64_t b = off[0].get<uint64_t>();
    uint64_t e = off[1].get<uint64_t>();
    if (b > e || e > body) {
      return Bad(where, Cat("data_offsets [", b, ", ", e, ") fall outside the ", body,
                            " data bytes: truncated file?"));
    }
    unsigned __int128 want = elems * TensorDTypeSize(v.dtype);
    if (want != e - b) {
      return Bad(where, Cat("holds ", e - b, " bytes, its dtype and shape need ",
                            static_cast<uint64_t>(want)));
    }
    v.data = base + b;
    v.bytes = e - b;
    if (e > b) {
      ranges.emplace_back(b, e);
    }
    out.push_back(std::move(v));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) {
      return Bad(file, "two tensors' data_offsets overlap");
    }
  }
  return out;
}

Result<Checkpoint> Checkpoint::Open(const std::string& dir) {
  Checkpoint ck;
  ck.dir_ = dir;
  fs::path root(dir);
  std::error_code ec;
  if (!fs::is_directory(root, ec)) {
    return absl::NotFoundError(Cat(dir, ": not a directory"));
  }
  BRAGG_ASSIGN_OR_RETURN(std::string config_text, ReadText(root / "config.json"));
  BRAGG_ASSIGN_OR_RETURN(ck.config_,
                         ParseModelConfig(config_text, (root / "config.json").string()));
  if (fs::exists(root / "generation_config.json", ec)) {
    BRAGG_ASSIGN_OR_RETURN(std::string gen, ReadText(root / "generation_config.json"));
    json g = json::parse(gen, nullptr, false);
    if (g.is_object()) {
      BRAGG_RETURN_IF_ERROR(
          AppendEos(g, (root / "generation_config.json").string(), &ck.config_.eos_token_ids));
    }
  }
  std::vector<std::string> shards;
  fs::path index = root / "model.safetensors.index.json";
  if (fs::exists(index, ec)) {
    BRAGG_ASSIGN_OR_RETURN(std::string text, ReadText(index));
    json j = json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") ||
        !j["weight_map"].is_object()) {
      return Bad(index.string(), "needs a weight_map object");
    }
    std::set<std::string> names;
    for (auto& [tensor, file] : j["weight_map"].items()) {
      if (!file.is_string()) {
        return Bad(index.string(), Cat("weight_map[", tensor, "] is not a file name"));
      }
      std::string f = file.get<std::string>();
      if (f.find('/') != std::string::npos || f == ".." || f.empty()) {
        return Bad(index.string(), Cat("shard name '", f, "' is not a plain file name"));
      }
      names.insert(f);
    }
    shards.assign(names.begin(), names.end());
  } else {
    for (const auto& entry : fs::directory_iterator(root, ec)) {
      if (entry.path().extension() == ".safetensors") {
        shards.push_back(entry.path().filename().string());
      }
    }
    std::sort(shards.begin(), shards.end());
  }
  if (shards.empty()) {
    return absl::NotFoundError(Cat(dir, ": no .safetensors files"));
  }
  for (const std::string& name : shards) {
    std::string path = (root / name).string();
    BRAGG_ASSIGN_OR_RETURN(auto file, MappedFile::Map(path));
    BRAGG_ASSIGN_OR_RETURN(auto views, ParseSafetensors(file->data(), file->size(), path));
    for (TensorView& v : views) {
      std::string n = v.name;
      if (!ck.tensors_.emplace(n, std::move(v)).second) {
        return Bad(path, Cat("tensor ", n, " appears in two shards"));
      }
    }
    ck.files_.push_back(std::move(file));
  }
  return ck;
}

Result<const TensorView*> Checkpoint::Find(std::string_view name) const {
  auto it = tensors_.find(std::string(name));
  if (it == tensors_.end()) {
    return absl::NotFoundError(Cat(dir_, ": tensor ", name, " is missing"));
  }
  return &it->second;
}

}  // namespace bragg::engine
