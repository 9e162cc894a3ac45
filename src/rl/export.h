#pragma once

// Batches for an external trainer (docs/rl.md "Scale-out"): a training step's trajectories as
// bragg_pack THD rows planned for a Megatron-LM layout, one JSON line per row, in the format
// python/bragg_rl/megatron.py reads (read_batches -> PackedSeqParams and GRPO tensors).

#include <cstdint>
#include <span>
#include <string>

#include "common/status.h"
#include "rl/config.h"
#include "train/trajectory.h"

namespace bragg::rl {

// Writes `batch` (with one advantage per trajectory) to `path`, atomically (a reader never
// sees part of a step): rows of at most `max_tokens` padded tokens, each with "tokens",
// "cu_seqlens", "cu_seqlens_padded" (when the layout pads), "loss_mask", "advantages",
// "logprobs", and "trajectory_ids", "dp_rank", "micro_batch", "step", "version".
// InvalidArgument when a trajectory does not fit a row or the sizes disagree.
Status WritePackedBatch(std::span<const train::Trajectory> batch,
                        std::span<const double> advantages, const ExportConfig& layout,
                        int64_t max_tokens, int64_t step, int64_t version, const std::string& path);

}  // namespace bragg::rl
