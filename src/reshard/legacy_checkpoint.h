#pragma once

// Legacy Megatron checkpoints: one torch.save file per model-parallel rank,
// mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt, holding the rank's local tensors with local layer
// indices. Indexing reads only each file's pickle: every local tensor becomes a chunk of the same
// global tensor a torch_dist checkpoint would hold, with its data offset resolved: layer-stacked
// when every layer holds the same tensors, per-layer ("decoder.layers.N.X") otherwise (mixed
// dense/MoE models), as Megatron's torch_dist does.

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
// rank 0. Expert weights (SequentialMLP "mlp.experts.local_experts.K.linear_fcN.weight" or
// TEGroupedMLP "mlp.experts.linear_fcN.weightK") become "mlp.experts.experts.linear_fcN.weight"
// with an expert axis, global expert = EP rank x local experts + K; expert tensor parallelism is
// taken to equal TP (Megatron's default), split like the dense linear_fc1/linear_fc2.
// Errors: NotFound when no mp_rank_* directory exists; InvalidArgument for a missing rank
// directory (holes in the TP x PP x EP grid), local shapes that disagree across ranks, or files
// whose pickle holds no "model" state dict; the errors of TorchArchive::Open.
[[nodiscard]] Result<CheckpointIndex> ReadLegacyCheckpointIndex(const std::string& dir);

}  // namespace bragg::reshard
