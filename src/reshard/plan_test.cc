#include "reshard/plan.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "reshard/test_chunks.h"

namespace bragg::reshard {
namespace {

using testing::Chunked;

ModelConfig TinyConfig(const std::string& family) {
  std::string json = R"({"hidden_size": 8, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 6, "vocab_size": 10,
    "tie_word_embeddings": false})";
  auto c = ParseModelConfig(family, json);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

// A Megatron-shaped index with TP=2 and PP=2 chunking (vocab padded from 10 to 12).
CheckpointIndex TinyIndex(const ModelConfig& c, bool bias, bool qk_norm) {
  CheckpointIndex idx;
  const int64_t L = c.num_layers, h = c.hidden_size, hd = c.head_dim;
  const int64_t qkv = (c.num_heads + 2 * c.num_kv_heads) * hd;
  auto add = [&](SourceTensor t) { idx.tensors[t.key] = std::move(t); };
  add(Chunked("embedding.word_embeddings.weight", {12, h}, {2, 1}));
  add(Chunked("output_layer.weight", {12, h}, {2, 1}));
  add(Chunked("decoder.final_layernorm.weight", {h}, {1}));
  const std::string p = "decoder.layers.";
  add(Chunked(p + "self_attention.linear_qkv.layer_norm_weight", {L, h}, {2, 1}));
  add(Chunked(p + "self_attention.linear_qkv.weight", {L, qkv, h}, {2, 2, 1}));
  if (bias) {
    add(Chunked(p + "self_attention.linear_qkv.bias", {L, qkv}, {2, 2}));
  }
  if (qk_norm) {
    add(Chunked(p + "self_attention.q_layernorm.weight", {L, hd}, {2, 1}));
    add(Chunked(p + "self_attention.k_layernorm.weight", {L, hd}, {2, 1}));
  }
  add(Chunked(p + "self_attention.linear_proj.weight", {L, h, c.num_heads * hd}, {2, 1, 2}));
  add(Chunked(p + "mlp.linear_fc1.layer_norm_weight", {L, h}, {2, 1}));
  add(Chunked(p + "mlp.linear_fc1.weight", {L, 2 * c.intermediate_size, h}, {2, 2, 1}));
  add(Chunked(p + "mlp.linear_fc2.weight", {L, h, c.intermediate_size}, {2, 1, 2}));
  return idx;
}

// Global flat index of every source element, as the chunk's bytes would hold it.
std::vector<uint32_t> ChunkData(const SourceTensor& t, const SourceChunk& c) {
  std::vector<uint32_t> out(NumElements(c.sizes));
  std::vector<int64_t> idx(c.sizes.size(), 0);
  for (uint64_t k = 0; k < out.size(); ++k) {
    uint64_t rem = k;
    uint64_t g = 0;
    for (size_t d = c.sizes.size(); d-- > 0;) {
      idx[d] = static_cast<int64_t>(rem % c.sizes[d]) + c.offsets[d];
      rem /= c.sizes[d];
    }
    for (size_t d = 0; d < idx.size(); ++d) {
      g = g * t.shape[d] + idx[d];
    }
    out[k] = static_cast<uint32_t>(g);
  }
  return out;
}

void CheckPlanMovesEveryElement(const std::string& family, uint64_t max_shard) {
  ModelConfig c = TinyConfig(family);
  CheckpointIndex idx = TinyIndex(c, c.qkv_bias, c.qk_norm);
  auto plan = BuildPlan(idx, c, max_shard);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // Execute the runs in memory.
  std::vector<std::string> files;
  for (const PlannedShard& s : plan->shards) {
    files.push_back(std::string(s.size, '\xAA'));
    files.back().replace(0, s.header.size(), s.header);
  }
  std::vector<int> written_count;
  std::map<std::pair<size_t, uint64_t>, int> writes;
  for (const WorkItem& w : plan->items) {
    std::vector<uint32_t> data = ChunkData(*w.tensor, w.tensor->chunks[w.chunk]);
    for (const CopyRun& r : w.runs) {
      ASSERT_LE(r.src + r.bytes, data.size() * 4);
      ASSERT_LE(r.dst + r.bytes, files[w.shard].size());
      std::memcpy(files[w.shard].data() + r.dst, reinterpret_cast<char*>(data.data()) + r.src,
                  r.bytes);
      for (uint64_t b = 0; b < r.bytes; b += 4) {
        ++writes[{w.shard, r.dst + b}];
      }
    }
  }
  const int64_t hd = c.head_dim, qpg = c.num_heads / c.num_kv_heads, g = (qpg + 2) * hd;
  size_t tensors = 0;
  for (size_t s = 0; s < plan->shards.size(); ++s) {
    for (const PlannedTensor& t : plan->shards[s].tensors) {
      ++tensors;
      const SourceTensor& src = idx.tensors.at(t.map.src_key);
      const int64_t rows = t.map.hf_shape[0];
      const uint64_t inner = NumElements(t.map.hf_shape) / rows;
      for (int64_t r = 0; r < rows; ++r) {
        // Expected source row, written out independently of the mapping tables.
        int64_t sr = r;
        const std::string& n = t.map.hf_name;
        if (n.find("q_proj") != std::string::npos) {
          sr = (r / (qpg * hd)) * g + r % (qpg * hd);
        } else if (n.find("k_proj") != std::string::npos) {
          sr = (r / hd) * g + qpg * hd + r % hd;
        } else if (n.find("v_proj") != std::string::npos) {
          sr = (r / hd) * g + (qpg + 1) * hd + r % hd;
        } else if (n.find("up_proj") != std::string::npos) {
          sr = r + c.intermediate_size;
        }
        for (uint64_t i = 0; i < inner; ++i) {
          uint64_t flat = (t.map.layer >= 0 ? t.map.layer : 0);
          if (t.map.layer >= 0) {
            flat = flat * src.shape[1] + sr;
          } else {
            flat = sr;
          }
          flat = flat * inner + i;
          uint64_t at = t.offset + (r * inner + i) * 4;
          uint32_t got;
          std::memcpy(&got, files[s].data() + at, 4);
          ASSERT_EQ(got, flat) << n << " row " << r << " col " << i;
          ASSERT_EQ((writes[{s, at}]), 1) << n << " written more than once";
        }
      }
    }
  }
  size_t per_layer = 9 + (c.qkv_bias ? 3 : 0) + (c.qk_norm ? 2 : 0);
  EXPECT_EQ(tensors, 3 + per_layer * c.num_layers);
}

TEST(PlanTest, LlamaEveryElementOnce) { CheckPlanMovesEveryElement("llama", 5ull << 30); }
TEST(PlanTest, Qwen2BiasManyShards) { CheckPlanMovesEveryElement("qwen2", 700); }
TEST(PlanTest, Qwen3QkNorm) { CheckPlanMovesEveryElement("qwen3", 2000); }

TEST(PlanTest, ShardsSplitAcrossRanksExactlyOnce) {
  ModelConfig c = TinyConfig("llama");
  auto plan = BuildPlan(TinyIndex(c, false, false), c, 500);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_GT(plan->shards.size(), 3u);
  std::vector<int> owner(plan->shards.size(), 0);
  for (int r = 0; r < 3; ++r) {
    for (size_t s : ShardsForRank(*plan, r, 3)) {
      ++owner[s];
    }
  }
  for (int n : owner) {
    EXPECT_EQ(n, 1);
  }
  EXPECT_NE(DescribePlan(*plan).find("model.layers.0.self_attn.k_proj.weight"), std::string::npos);
}

TEST(PlanTest, RejectsMismatchedCheckpoints) {
  ModelConfig c = TinyConfig("llama");
  CheckpointIndex idx = TinyIndex(c, false, false);
  auto missing = idx;
  missing.tensors.erase("decoder.layers.mlp.linear_fc2.weight");
  auto r = BuildPlan(missing, c, 1 << 30);
  EXPECT_NE(std::string(r.status().message()).find("linear_fc2"), std::string::npos) << r.status();
  auto extra = idx;
  extra.tensors["decoder.layers.mlp.router.weight"] =
      Chunked("decoder.layers.mlp.router.weight", {4, 8}, {1, 1});
  r = BuildPlan(extra, c, 1 << 30);
  EXPECT_NE(std::string(r.status().message()).find("no Hugging Face mapping"), std::string::npos);
  auto ignored = idx;
  ignored.tensors["decoder.layers.self_attention.linear_qkv._extra_state"] =
      Chunked("decoder.layers.self_attention.linear_qkv._extra_state", {4}, {1});
  EXPECT_TRUE(BuildPlan(ignored, c, 1 << 30).ok());
  ModelConfig wrong = c;
  wrong.intermediate_size = 5;
  r = BuildPlan(idx, wrong, 1 << 30);
  EXPECT_FALSE(r.ok());
  wrong = c;
  wrong.num_layers = 3;
  r = BuildPlan(idx, wrong, 1 << 30);
  EXPECT_NE(std::string(r.status().message()).find("layer axis"), std::string::npos) << r.status();
  wrong = c;
  wrong.vocab_size = 13;  // more than the padded 12 rows
  EXPECT_FALSE(BuildPlan(idx, wrong, 1 << 30).ok());
}

TEST(PlanTest, NonModelStateIsSkippedButUnknownWeightsAreNot) {
  for (const char* k :
       {"optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight",
        "optimizer.state.exp_avg_sq.embedding.word_embeddings.weight",
        "optimizer.state.fp32_param.output_layer.weight",
        "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, "
        "torch.float32).bucket_idx_0.exp_avg",
        "optimizer.param_groups",
        "chained_1.optimizer.state.exp_avg.decoder.final_layernorm.weight", "rng_state",
        "rng_state/shard_0.0_1.2", "rerun_state_machine_state/shard_1.1_2.2"}) {
    EXPECT_TRUE(IsNonModelStateKey(k)) << k;
  }
  for (const char* k : {"decoder.layers.mlp.linear_fc1.weight", "optimizer", "optimizers.x.weight",
                        "decoder.layers.optimizer.state.weight", "chained_0.decoder.weight",
                        "chained_.optimizer.state.x", "chained_x.optimizer.state.x",
                        "rng_statex.weight", "embedding.rng_state", "mtp.layers.0.weight"}) {
    EXPECT_FALSE(IsNonModelStateKey(k)) << k;
  }
  ModelConfig c = TinyConfig("llama");
  CheckpointIndex idx = TinyIndex(c, false, false);
  const std::string moment = "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc2.weight";
  idx.tensors[moment] = Chunked(moment, {4, 8, 6}, {2, 1, 2});
  auto plan = BuildPlan(idx, c, 1 << 30);
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (const WorkItem& w : plan->items) {
    EXPECT_NE(w.tensor->key, moment);
  }
  // A weight no mapping knows is still an error, also behind a chained prefix.
  const std::string stray = "chained_0.decoder.layers.mlp.linear_fc3.weight";
  idx.tensors[stray] = Chunked(stray, {4, 8}, {1, 1});
  auto r = BuildPlan(idx, c, 1 << 30);
  EXPECT_NE(std::string(r.status().message()).find(stray), std::string::npos) << r.status();
}

TEST(PlanTest, ConfigValidation) {
  EXPECT_EQ(ParseModelConfig("gpt2", "{}").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseModelConfig("deepseek_v3", "{}").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(ParseModelConfig("kimi", "{}").status().message()).find("deepseek_v3"),
            std::string::npos);
  EXPECT_FALSE(ParseModelConfig("qwen3_moe", R"({"hidden_size": 8, "num_hidden_layers": 1,
      "num_attention_heads": 4, "intermediate_size": 4, "vocab_size": 4})")
                   .ok());
  EXPECT_EQ(ParseModelConfig("qwen3_moe", R"({"hidden_size": 8, "num_hidden_layers": 1,
      "num_attention_heads": 4, "intermediate_size": 4, "vocab_size": 4, "num_experts": 4,
      "moe_intermediate_size": 2, "mlp_only_layers": [0]})")
                .status()
                .code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_FALSE(ParseModelConfig("llama", "not json").ok());
  EXPECT_FALSE(ParseModelConfig("llama", R"({"hidden_size": 8})").ok());
  EXPECT_FALSE(ParseModelConfig("llama", R"({"hidden_size": -8, "num_hidden_layers": 1,
      "num_attention_heads": 1, "intermediate_size": 1, "vocab_size": 1})")
                   .ok());
  EXPECT_FALSE(ParseModelConfig("llama", R"({"hidden_size": 8, "num_hidden_layers": 1,
      "num_attention_heads": 4, "num_key_value_heads": 3, "intermediate_size": 1,
      "vocab_size": 1})")
                   .ok());
}

std::string DeepseekJson(const std::string& extra = "") {
  return R"({"hidden_size": 8, "num_hidden_layers": 3, "num_attention_heads": 2,
    "q_lora_rank": 6, "kv_lora_rank": 4, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2,
    "v_head_dim": 3, "intermediate_size": 6, "moe_intermediate_size": 2, "n_routed_experts": 4,
    "n_shared_experts": 2, "first_k_dense_replace": 1, "vocab_size": 10)" +
         extra + "}";
}

// A deepseek_v3-shaped index as Megatron writes MoE models: per-layer keys, TP=2 on the
// column/row-parallel dims, EP=2 on the expert axis; `stacked` uses layer-stacked keys instead
// (valid only when every layer is MoE).
CheckpointIndex DeepseekIndex(const ModelConfig& c, bool stacked) {
  CheckpointIndex idx;
  const int64_t h = c.hidden_size, n = c.num_heads, f = c.moe_intermediate_size;
  auto add = [&](SourceTensor t) { idx.tensors[t.key] = std::move(t); };
  add(Chunked("embedding.word_embeddings.weight", {12, h}, {2, 1}));
  add(Chunked("output_layer.weight", {12, h}, {2, 1}));
  add(Chunked("decoder.final_layernorm.weight", {h}, {1}));
  auto layer = [&](int64_t i, const std::string& suffix, std::vector<int64_t> shape,
                   std::vector<int> splits) {
    if (stacked) {
      shape.insert(shape.begin(), c.num_layers);
      splits.insert(splits.begin(), 1);
      if (i == 0) {
        add(Chunked("decoder.layers." + suffix, shape, splits));
      }
      return;
    }
    add(Chunked(fmt::format("decoder.layers.{}.{}", i, suffix), shape, splits));
  };
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string sa = "self_attention.";
    layer(i, "input_layernorm.weight", {h}, {1});
    if (c.q_lora_rank > 0) {
      layer(i, sa + "linear_q_down_proj.weight", {c.q_lora_rank, h}, {1, 1});
      layer(i, sa + "linear_q_up_proj.layer_norm_weight", {c.q_lora_rank}, {1});
      layer(i, sa + "linear_q_up_proj.weight",
            {n * (c.qk_nope_head_dim + c.qk_rope_head_dim), c.q_lora_rank}, {2, 1});
    } else {
      layer(i, sa + "linear_q_proj.weight", {n * (c.qk_nope_head_dim + c.qk_rope_head_dim), h},
            {2, 1});
    }
    layer(i, sa + "linear_kv_down_proj.weight", {c.kv_lora_rank + c.qk_rope_head_dim, h}, {1, 1});
    layer(i, sa + "linear_kv_up_proj.layer_norm_weight", {c.kv_lora_rank}, {1});
    layer(i, sa + "linear_kv_up_proj.weight",
          {n * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank}, {2, 1});
    layer(i, sa + "linear_proj.weight", {h, n * c.v_head_dim}, {1, 1});
    if (!c.IsMoeLayer(i)) {
      layer(i, "mlp.linear_fc1.layer_norm_weight", {h}, {1});
      layer(i, "mlp.linear_fc1.weight", {2 * c.intermediate_size, h}, {2, 1});
      layer(i, "mlp.linear_fc2.weight", {h, c.intermediate_size}, {1, 2});
      continue;
    }
    layer(i, "pre_mlp_layernorm.weight", {h}, {1});
    layer(i, "mlp.router.weight", {c.num_experts, h}, {1, 1});
    layer(i, "mlp.router.expert_bias", {c.num_experts}, {1});
    layer(i, "mlp.experts.experts.linear_fc1.weight", {c.num_experts, 2 * f, h}, {2, 1, 1});
    layer(i, "mlp.experts.experts.linear_fc2.weight", {c.num_experts, h, f}, {2, 1, 1});
    if (c.num_shared_experts > 0) {
      const int64_t sf = f * c.num_shared_experts;
      layer(i, "mlp.shared_experts.linear_fc1.weight", {2 * sf, h}, {2, 1});
      layer(i, "mlp.shared_experts.linear_fc2.weight", {h, sf}, {1, 2});
    }
  }
  return idx;
}

// Executes the plan in memory and checks that every output element comes from the source element
// its mapping selects (fixed leading indices, row segments in order, trailing dims whole) and is
// written exactly once. Returns the output tensor names.
std::vector<std::string> ExecuteAndCheck(const CheckpointIndex& idx, const ModelConfig& c,
                                         uint64_t max_shard) {
  std::vector<std::string> names;
  auto plan = BuildPlan(idx, c, max_shard);
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) {
    return names;
  }
  std::vector<std::string> files;
  for (const PlannedShard& s : plan->shards) {
    files.push_back(std::string(s.size, '\xAA'));
  }
  std::map<std::pair<size_t, uint64_t>, int> writes;
  for (const WorkItem& w : plan->items) {
    std::vector<uint32_t> data = ChunkData(*w.tensor, w.tensor->chunks[w.chunk]);
    for (const CopyRun& r : w.runs) {
      EXPECT_LE(r.src + r.bytes, data.size() * 4);
      EXPECT_LE(r.dst + r.bytes, files[w.shard].size());
      std::memcpy(files[w.shard].data() + r.dst, reinterpret_cast<char*>(data.data()) + r.src,
                  r.bytes);
      for (uint64_t b = 0; b < r.bytes; b += 4) {
        ++writes[{w.shard, r.dst + b}];
      }
    }
  }
  for (size_t s = 0; s < plan->shards.size(); ++s) {
    for (const PlannedTensor& t : plan->shards[s].tensors) {
      names.push_back(t.map.hf_name);
      const SourceTensor& src = idx.tensors.at(t.map.src_key);
      const size_t rdim = t.map.FixedAxes();
      const int64_t rows = t.map.hf_shape[0];
      const uint64_t inner = NumElements(t.map.hf_shape) / rows;
      uint64_t lead = 0;
      for (size_t d = 0; d < rdim; ++d) {
        lead = lead * src.shape[d] + t.map.FixedIndex(d);
      }
      for (int64_t r = 0; r < rows; ++r) {
        int64_t sr = r;
        int64_t base = 0;
        for (const RowSegment& seg : t.map.segments) {
          if (r < base + seg.count) {
            sr = seg.start + r - base;
            break;
          }
          base += seg.count;
        }
        for (uint64_t i = 0; i < inner; ++i) {
          const uint64_t want = (lead * src.shape[rdim] + sr) * inner + i;
          const uint64_t at = t.offset + (r * inner + i) * 4;
          uint32_t got;
          std::memcpy(&got, files[s].data() + at, 4);
          EXPECT_EQ(got, want) << t.map.hf_name << " row " << r << " col " << i;
          EXPECT_EQ((writes[{s, at}]), 1) << t.map.hf_name << " written more than once";
          if (got != want) {
            return names;
          }
        }
      }
    }
  }
  return names;
}

bool Has(const std::vector<std::string>& names, const std::string& n) {
  return std::find(names.begin(), names.end(), n) != names.end();
}

TEST(PlanTest, DeepseekV3MlaDenseThenMoe) {
  auto c = ParseModelConfig("deepseek_v3", DeepseekJson());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->first_k_dense_replace, 1);
  auto names = ExecuteAndCheck(DeepseekIndex(*c, false), *c, 900);
  // embed, norm, head; per layer 8 attention; dense layer 4; MoE layers: norm, router, bias,
  // 3 x 4 experts, 3 shared.
  EXPECT_EQ(names.size(), 3u + 3 * 8 + 4 + 2 * (3 + 12 + 3));
  EXPECT_TRUE(Has(names, "model.layers.0.mlp.gate_proj.weight"));
  EXPECT_FALSE(Has(names, "model.layers.0.mlp.gate.weight"));
  EXPECT_TRUE(Has(names, "model.layers.1.self_attn.q_a_layernorm.weight"));
  EXPECT_TRUE(Has(names, "model.layers.1.self_attn.kv_b_proj.weight"));
  EXPECT_TRUE(Has(names, "model.layers.2.mlp.gate.e_score_correction_bias"));
  EXPECT_TRUE(Has(names, "model.layers.2.mlp.experts.3.up_proj.weight"));
  EXPECT_TRUE(Has(names, "model.layers.2.mlp.shared_experts.down_proj.weight"));
}

TEST(PlanTest, DeepseekV3WithoutQueryLoraAndFused) {
  auto c = ParseModelConfig("deepseek_v3", DeepseekJson(R"(, "q_lora_rank": null)"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->q_lora_rank, 0);
  c->fused_gate_up = true;
  auto names = ExecuteAndCheck(DeepseekIndex(*c, false), *c, 5ull << 30);
  EXPECT_TRUE(Has(names, "model.layers.1.self_attn.q_proj.weight"));
  EXPECT_FALSE(Has(names, "model.layers.1.self_attn.q_a_proj.weight"));
  EXPECT_TRUE(Has(names, "model.layers.1.mlp.experts.gate_up_proj"));
  EXPECT_TRUE(Has(names, "model.layers.2.mlp.experts.down_proj"));
  EXPECT_FALSE(Has(names, "model.layers.2.mlp.experts.0.gate_proj.weight"));
  EXPECT_TRUE(Has(names, "model.layers.2.mlp.shared_experts.gate_proj.weight"));
}

TEST(PlanTest, DeepseekV3LayerStackedKeys) {
  // All layers MoE (first_k_dense_replace 0): newer Megatron stacks the layers on dim 0.
  auto c = ParseModelConfig("deepseek_v3", DeepseekJson(R"(, "first_k_dense_replace": 0)"));
  ASSERT_TRUE(c.ok()) << c.status();
  for (bool fused : {false, true}) {
    c->fused_gate_up = fused;
    auto names = ExecuteAndCheck(DeepseekIndex(*c, true), *c, 700);
    EXPECT_EQ(names.size(), 3u + 3 * (8 + 3 + (fused ? 2 : 12) + 3));
  }
}

// megatron-core's local layer spec saves an MoE layer's pre-MLP norm under the dense layer's
// fused-norm name (mlp.linear_fc1.layer_norm_weight); the TransformerEngine spec under
// pre_mlp_layernorm.weight. Either is found, stacked or per layer; neither names both.
TEST(PlanTest, MoePreMlpNormUnderEitherName) {
  auto c = ParseModelConfig("deepseek_v3", DeepseekJson(R"(, "first_k_dense_replace": 0)"));
  ASSERT_TRUE(c.ok()) << c.status();
  for (bool stacked : {false, true}) {
    CheckpointIndex idx = DeepseekIndex(*c, stacked);
    CheckpointIndex renamed;
    for (auto& [key, t] : idx.tensors) {
      std::string k = key;
      size_t at = k.find("pre_mlp_layernorm.weight");
      if (at != std::string::npos) {
        k.replace(at, std::strlen("pre_mlp_layernorm.weight"), "mlp.linear_fc1.layer_norm_weight");
        t.key = k;
      }
      renamed.tensors[k] = t;
    }
    auto names = ExecuteAndCheck(renamed, *c, 5ull << 30);
    EXPECT_TRUE(Has(names, "model.layers.1.post_attention_layernorm.weight")) << stacked;
    std::string norm = stacked ? "decoder.layers.mlp.linear_fc1.layer_norm_weight"
                               : "decoder.layers.1.mlp.linear_fc1.layer_norm_weight";
    renamed.tensors.erase(norm);
    auto r = BuildPlan(renamed, *c, 5ull << 30);
    const std::string msg(r.status().message());
    // The first layer whose norm is missing: every layer when stacked, else layer 1.
    EXPECT_NE(msg.find(fmt::format("'decoder.layers.pre_mlp_layernorm.weight' or "
                                   "'decoder.layers.{0}.pre_mlp_layernorm.weight' or "
                                   "'decoder.layers.mlp.linear_fc1.layer_norm_weight' or "
                                   "'decoder.layers.{0}.mlp.linear_fc1.layer_norm_weight'",
                                   stacked ? 0 : 1)),
              std::string::npos)
        << msg;
  }
}

TEST(PlanTest, ModelTypeGivesTheFamily) {
  for (const char* family : {"llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"}) {
    auto f = FamilyFromModelType(fmt::format(R"({{"model_type": "{}"}})", family));
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(*f, family);
  }
  auto kimi = FamilyFromModelType(R"({"model_type": "kimi_k2"})");
  ASSERT_TRUE(kimi.ok()) << kimi.status();
  EXPECT_EQ(*kimi, "deepseek_v3");
  auto unknown = FamilyFromModelType(R"({"model_type": "mistral"})");
  EXPECT_NE(std::string(unknown.status().message()).find("supported: llama, qwen2"),
            std::string::npos)
      << unknown.status();
  EXPECT_FALSE(FamilyFromModelType(R"({"hidden_size": 8})").ok());
  EXPECT_FALSE(FamilyFromModelType(R"({"model_type": 3})").ok());
  EXPECT_FALSE(FamilyFromModelType("[1, 2]").ok());
  EXPECT_FALSE(FamilyFromModelType("{").ok());
}

TEST(PlanTest, DeepseekV3WithoutSharedExperts) {
  auto c = ParseModelConfig("deepseek_v3", DeepseekJson(R"(, "n_shared_experts": null)"));
  ASSERT_TRUE(c.ok()) << c.status();
  auto names = ExecuteAndCheck(DeepseekIndex(*c, false), *c, 5ull << 30);
  EXPECT_EQ(names.size(), 3u + 3 * 8 + 4 + 2 * (3 + 12));
  // A checkpoint with shared experts but a config without them: the extra tensors are refused.
  auto with = ParseModelConfig("deepseek_v3", DeepseekJson());
  ASSERT_TRUE(with.ok());
  auto r = BuildPlan(DeepseekIndex(*with, false), *c, 5ull << 30);
  EXPECT_NE(std::string(r.status().message()).find("shared_experts"), std::string::npos)
      << r.status();
}

TEST(PlanTest, DeepseekV3MultiTokenPrediction) {
  auto c = ParseModelConfig("deepseek_v3", DeepseekJson());
  ASSERT_TRUE(c.ok()) << c.status();
  CheckpointIndex idx = DeepseekIndex(*c, false);
  idx.tensors["mtp.layers.0.eh_proj.weight"] =
      Chunked("mtp.layers.0.eh_proj.weight", {8, 16}, {2, 1});
  auto r = BuildPlan(idx, *c, 1 << 30);
  EXPECT_NE(std::string(r.status().message()).find("--skip-mtp"), std::string::npos) << r.status();
  c->skip_mtp = true;
  r = BuildPlan(idx, *c, 1 << 30);
  ASSERT_TRUE(r.ok()) << r.status();
  for (const WorkItem& w : r->items) {
    EXPECT_NE(w.tensor->key, "mtp.layers.0.eh_proj.weight");
  }
  // Other unmapped tensors are still refused.
  idx.tensors["decoder.layers.9.mlp.linear_fc2.weight"] =
      Chunked("decoder.layers.9.mlp.linear_fc2.weight", {8, 6}, {1, 1});
  r = BuildPlan(idx, *c, 1 << 30);
  EXPECT_NE(std::string(r.status().message()).find("no Hugging Face mapping"), std::string::npos);
}

TEST(PlanTest, DeepseekV3Mismatches) {
  auto c = ParseModelConfig("deepseek_v3", DeepseekJson());
  ASSERT_TRUE(c.ok()) << c.status();
  CheckpointIndex idx = DeepseekIndex(*c, false);
  auto missing = idx;
  missing.tensors.erase("decoder.layers.2.self_attention.linear_kv_up_proj.layer_norm_weight");
  auto r = BuildPlan(missing, *c, 1 << 30);
  EXPECT_NE(std::string(r.status().message())
                .find("'decoder.layers.2.self_attention.linear_kv_up_proj.layer_norm_weight'"),
            std::string::npos)
      << r.status();
  ModelConfig wrong = *c;
  wrong.kv_lora_rank = 5;
  r = BuildPlan(idx, wrong, 1 << 30);
  EXPECT_NE(std::string(r.status().message()).find("kv_a_proj_with_mqa"), std::string::npos)
      << r.status();
  wrong = *c;
  wrong.num_experts = 8;
  r = BuildPlan(idx, wrong, 1 << 30);
  EXPECT_NE(std::string(r.status().message()).find("model.layers.1.mlp.gate.weight"),
            std::string::npos)
      << r.status();
  wrong = *c;
  wrong.first_k_dense_replace = 2;  // layer 1 is MoE in the checkpoint
  r = BuildPlan(idx, wrong, 1 << 30);
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(
      ParseModelConfig("deepseek_v3", DeepseekJson(R"(, "moe_layer_freq": 2)")).status().code(),
      absl::StatusCode::kUnimplemented);
  EXPECT_FALSE(ParseModelConfig("deepseek_v3", DeepseekJson(R"(, "q_lora_rank": -1)")).ok());
}

TEST(ChunkValidationTest, ShapesWhoseProductOverflowsAreRefused) {
  // 2^32 x 2^32 = 2^64 wraps to 0 elements, which an empty chunk list would "cover".
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{
           {int64_t{1} << 32, int64_t{1} << 32},
           {int64_t{1} << 40, int64_t{1} << 40, 4},
           {int64_t{1} << 26, int64_t{1} << 25}}) {  // 2^51: over the cap, no wrap
    SourceTensor t;
    t.key = "hostile";
    t.shape = shape;
    Status st = ValidateChunks(t);
    EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
    EXPECT_NE(std::string(st.message()).find("more than"), std::string::npos) << st;
    EXPECT_FALSE(CheckedNumElements(shape).ok());
  }
  EXPECT_EQ(*CheckedNumElements({int64_t{1} << 25, int64_t{1} << 25}), uint64_t{1} << 50);
  EXPECT_EQ(*CheckedNumElements({}), 1u);
  EXPECT_EQ(*CheckedNumElements({5, 0, int64_t{1} << 40}), 0u);
  EXPECT_FALSE(CheckedNumElements({-1, 4}).ok());
}

TEST(ChunkValidationTest, GapsOverlapsAndBounds) {
  SourceTensor t = Chunked("w", {4, 6}, {2, 2});
  EXPECT_TRUE(ValidateChunks(t).ok());
  SourceTensor gap = t;
  gap.chunks.pop_back();
  EXPECT_NE(std::string(ValidateChunks(gap).message()).find("cover"), std::string::npos);
  SourceTensor overlap = t;
  overlap.chunks[1] = overlap.chunks[0];
  EXPECT_NE(std::string(ValidateChunks(overlap).message()).find("overlap"), std::string::npos);
  SourceTensor out = t;
  out.chunks[3].offsets[1] = 4;
  EXPECT_NE(std::string(ValidateChunks(out).message()).find("outside"), std::string::npos);
  SourceTensor neg = t;
  neg.chunks[0].sizes[0] = -2;
  EXPECT_FALSE(ValidateChunks(neg).ok());
  SourceTensor rank = t;
  rank.chunks[0].offsets.push_back(0);
  EXPECT_FALSE(ValidateChunks(rank).ok());
}

}  // namespace
}  // namespace bragg::reshard
