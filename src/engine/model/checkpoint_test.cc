#include "engine/model/checkpoint.h"

#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>

namespace bragg::engine {
namespace {

std::vector<uint8_t> File(const std::string& header, size_t body) {
  std::vector<uint8_t> f(8 + header.size() + body, 0);
  uint64_t n = header.size();
  std::memcpy(f.data(), &n, 8);
  std::memcpy(f.data() + 8, header.data(), header.size());
  return f;
}

TEST(Safetensors, ParsesAWellFormedFile) {
  auto f = File(R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},)"
                R"("b":{"dtype":"BF16","shape":[4],"data_offsets":[24,32]},"__metadata__":{}})",
                32);
  auto r = ParseSafetensors(f.data(), f.size(), "x.safetensors");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), 2u);
  EXPECT_EQ((*r)[0].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ((*r)[1].bytes, 8u);
}

TEST(Safetensors, RefusesHostileHeadersNamingTheProblem) {
  struct Case {
    std::string header;
    size_t body;
    std::string says;
  } cases[] = {
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4, "outside"},  // truncated
      {R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8, "need"},
      {R"({"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", 8, "not supported"},
      {R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4, "shape"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", 4, "outside"},
      {R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
       R"("b":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}})",
       8, "overlap"},
      {R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", 4,
       "too large"},
      {R"({"a":{"dtype":"F32"}})", 0, "needs"},
      {R"([1,2])", 0, "not a JSON object"},
      {R"({"a":)", 0, "not a JSON object"},
  };
  for (const Case& c : cases) {
    auto f = File(c.header, c.body);
    auto r = ParseSafetensors(f.data(), f.size(), "x.safetensors");
    ASSERT_FALSE(r.ok()) << c.header;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(r.status().message()).find(c.says), std::string::npos)
        << c.header << " -> " << r.status();
  }
  uint8_t tiny[4] = {};
  EXPECT_FALSE(ParseSafetensors(tiny, 4, "t").ok());
  auto f = File("{}", 0);
  uint64_t huge = ~0ULL;
  std::memcpy(f.data(), &huge, 8);
  EXPECT_FALSE(ParseSafetensors(f.data(), f.size(), "t").ok());
}

TEST(ModelConfig, ReadsQwen3MoeAndRefusesWhatItCannotServe) {
  nlohmann::json j = {{"architectures", {"Qwen3MoeForCausalLM"}},
                      {"vocab_size", 512},
                      {"hidden_size", 64},
                      {"intermediate_size", 128},
                      {"num_hidden_layers", 4},
                      {"num_attention_heads", 4},
                      {"num_key_value_heads", 2},
                      {"head_dim", 16},
                      {"num_experts", 8},
                      {"num_experts_per_tok", 2},
                      {"moe_intermediate_size", 32},
                      {"norm_topk_prob", true},
                      {"decoder_sparse_step", 1},
                      {"mlp_only_layers", {0}},
                      {"eos_token_id", 3}};
  auto c = ParseModelConfig(j.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->moe_layers(), (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(c->eos_token_ids, (std::vector<int32_t>{3}));

  auto bad = [&](const char* key, nlohmann::json v, const char* says) {
    nlohmann::json k = j;
    k[key] = v;
    auto r = ParseModelConfig(k.dump(), "config.json");
    ASSERT_FALSE(r.ok()) << key;
    EXPECT_NE(std::string(r.status().message()).find(says), std::string::npos) << r.status();
  };
  bad("architectures", {"LlamaForCausalLM"}, "not served");
  bad("num_key_value_heads", 3, "multiple");
  bad("vocab_size", "512", "integer");
  bad("num_experts_per_tok", 9, "outside");
  bad("use_sliding_window", true, "sliding");
  bad("rope_scaling", {{"rope_type", "yarn"}, {"factor", 4}}, "rope_scaling");
  bad("mlp_only_layers", {7}, "mlp_only_layers");
  EXPECT_FALSE(ParseModelConfig("not json", "c").ok());
}

TEST(Checkpoint, MissingDirectoryIsNotFound) {
  auto r = Checkpoint::Open("/nonexistent/model");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace bragg::engine
