#pragma once

// Legacy Megatron checkpoints: one torch.save file per model-parallel rank,
// mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt, holding the rank's local tensors with local layer
// indices. Indexing reads only each file's pickle: every local tensor becomes a chunk of the same
// global, layer-stacked tensor a torch_dist checkpoint would hold, with its data offset resolved.

#include <string>

#include "common/status.h"
#include "reshard/dist_checkpoint.h"

namespace bragg::reshard {

// True when `dir` (or the iteration it names in latest_checkpointed_iteration.txt) holds
// mp_rank_* directories.
bool IsLegacyCheckpoint(const std::string& dir);

// Builds the global index of a legacy checkpoint. Local layer indices are offset by the layers of
// the earlier pipeline stages; tensor-parallel pieces are placed along the dim Megatron splits
// (rows for column-parallel, columns for row-parallel, [gate; up] halves for linear_fc1);
// TP-replicated tensors come from TP rank 0; expert-parallel copies of dense weights from EP
// rank 0. Errors: NotFound when no mp_rank_* directory exists; InvalidArgument for a missing
// rank directory (holes in the TP x PP grid), local shapes that disagree across ranks, or files
// whose pickle holds no "model" state dict; the errors of TorchArchive::Open.
[[nodiscard]] Result<CheckpointIndex> ReadLegacyCheckpointIndex(const std::string& dir);

}  // namespace bragg::reshard
