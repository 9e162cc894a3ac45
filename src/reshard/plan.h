#pragma once

// The conversion plan, computed from metadata only: every output tensor's shard and byte range,
// and, for every source chunk, the byte runs it contributes to each output shard.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "reshard/dist_checkpoint.h"
#include "reshard/model_map.h"

namespace bragg::reshard {

// One contiguous copy: `bytes` bytes from `src` (relative to the chunk tensor's first byte) to
// `dst` (absolute offset in the output shard file).
struct CopyRun {
  uint64_t src = 0;
  uint64_t dst = 0;
  uint64_t bytes = 0;
};

struct PlannedTensor {
  TensorMapping map;
  DType dtype = DType::kF32;
  uint64_t offset = 0;  // absolute byte offset in its shard file
  uint64_t bytes = 0;
};

struct PlannedShard {
  std::string file;    // "model-00001-of-00003.safetensors"
  std::string header;  // the 8-byte length and the JSON header, padded to 8 bytes
  uint64_t size = 0;   // whole file
  std::vector<PlannedTensor> tensors;
};

// The runs one source chunk contributes to one shard, sorted by `src`.
struct WorkItem {
  size_t shard = 0;
  const SourceTensor* tensor = nullptr;  // points into the CheckpointIndex the plan was built from
  size_t chunk = 0;
  uint64_t bytes = 0;
  std::vector<CopyRun> runs;
};

// Every shard header carries the conversion's run id in its "__metadata__" (key
// "bragg_run_id", 16 hex digits); BuildPlan writes this placeholder, AssignRunId the real id.
inline constexpr std::string_view kRunIdPlaceholder = "0000000000000000";

struct Plan {
  std::string run_id{kRunIdPlaceholder};
  std::vector<PlannedShard> shards;
  std::vector<WorkItem> items;  // largest first
  uint64_t total_bytes = 0;     // sum of output tensor bytes
};

// Builds the plan. `index` must outlive the plan. Layer tensors are looked up by their stacked
// key, then by their per-layer key. Errors (InvalidArgument, naming the tensor): a mapped source
// key missing, a source key no mapping uses (mtp.* ones name --skip-mtp unless cfg.skip_mtp), a
// source shape that disagrees with the config, duplicate output names.
[[nodiscard]] Result<Plan> BuildPlan(const CheckpointIndex& index, const ModelConfig& cfg,
                                     uint64_t max_shard_size);

// Shards owned by `rank` of `world_size`: by size, largest first, dealt round-robin.
std::vector<size_t> ShardsForRank(const Plan& plan, int rank, int world_size);

// Text for --dry-run-plan: shards, tensors, sources, row segments.
std::string DescribePlan(const Plan& plan);

}  // namespace bragg::reshard
