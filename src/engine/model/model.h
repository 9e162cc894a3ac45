#pragma once

// The Qwen3 transformer (dense and MoE) on libtorch, with its KV cache in fixed-size blocks.
// This header names no torch type (pimpl), so the scheduler and tests compile without libtorch's
// headers; model.cc and qwen3.cc (the arithmetic it shares with the trainer) include them.
//
// Not thread-safe: the engine thread alone calls Forward and the weight methods.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/model/checkpoint.h"

namespace bragg::engine {

struct ModelOptions {
  bool cuda = false;
  bool bf16 = false;  // compute dtype: bfloat16, else float32
  int threads = 0;    // torch intra-op threads; 0: leave torch's default
  int64_t kv_blocks = 0;
  int block_size = 16;
  // Batch-invariant arithmetic: every row's result independent of what it is batched with
  // (docs/engine.md, "Deterministic mode").
  bool deterministic = false;
};

// One sequence's share of a forward step: its new tokens, at positions [start, start + n).
struct SeqChunk {
  std::span<const int32_t> tokens;
  int64_t start = 0;
  std::span<const int32_t> block_table;  // blocks covering positions [0, start + n)
  bool all_logits = false;               // logits for every new token, else for the last only
};

struct ForwardOutput {
  // Rows of vocab_size floats: per chunk in order, every new token's row when all_logits, else
  // the last token's. Forward writes them into this vector's memory, so a caller that passes
  // the same ForwardOutput step after step allocates nothing for them.
  std::vector<float> logits;
  // int32 [new tokens (all chunks, in order), moe layers, top_k]; empty for a dense model.
  std::vector<int32_t> experts;
};

// The CPU math in effect once a model is loaded: torch's threads and the BLAS library (which
// file, and how it is threaded). For logs and benchmarks.
std::string DescribeCpuRuntime();

class Model {
 public:
  static Result<std::unique_ptr<Model>> Load(const Checkpoint& checkpoint,
                                             const ModelOptions& options);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const;
  std::string dtype_name() const;  // "float32" | "bfloat16"
  // The threads torch computes on (--threads, else its default), for work beside the forward.
  int threads() const;

  // Runs the new tokens of `chunks` through the model, writing their K and V into the cache
  // slots their block tables name and reading every earlier position's from there.
  Status Forward(std::span<const SeqChunk> chunks, ForwardOutput* out);

  // In-place weight update, in two steps so that nothing is touched before everything is
  // checked: Check verifies that `checkpoint` has every parameter with the running shape and the
  // dtype of the checkpoint first loaded (InvalidArgument/NotFound naming the tensor); Apply
  // copies it into the running parameters.
  Status CheckUpdate(const Checkpoint& checkpoint) const;
  void ApplyUpdate(const Checkpoint& checkpoint);

 private:
  struct Impl;
  explicit Model(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace bragg::engine
