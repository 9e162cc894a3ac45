#pragma once

// Megatron torch_dist checkpoints (PyTorch distributed checkpoint): the .metadata pickle says,
// for every key, its global shape, dtype and chunks, and where each chunk's torch.save archive
// lies in the __R_N.distcp files. Only metadata is read here; no tensor data.

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "reshard/pickle.h"
#include "reshard/torch_file.h"

namespace bragg::reshard {

// One chunk of a global tensor: the box [offsets, offsets + sizes), stored as a torch.save archive
// at [archive_offset, archive_offset + archive_length) of `file` (relative to the checkpoint dir).
struct SourceChunk {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  std::string file;
  uint64_t archive_offset = 0;
  uint64_t archive_length = 0;
  // Legacy checkpoints resolve tensors while indexing: the chunk's row-major data starts at byte
  // `data_offset` of `file`, and no archive is opened at copy time.
  bool resolved = false;
  uint64_t data_offset = 0;
};

struct SourceTensor {
  std::string key;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<SourceChunk> chunks;
};

// A tensor of non-model state (optimizer moments, master weights, ...): listed, never read.
struct SkippedTensor {
  std::string key;
  std::string dtype;  // safetensors name, or the torch name when it has none
  std::vector<int64_t> shape;
  size_t chunks = 0;
};

// What a checkpoint holds, from metadata only.
struct CheckpointIndex {
  std::string dir;
  std::map<std::string, SourceTensor> tensors;
  // Non-tensor items (BytesStorageMetadata: TE _extra_state and the like).
  std::vector<std::string> byte_items;
  // Tensors of non-model state (IsNonModelStateKey), left out of `tensors`.
  std::vector<SkippedTensor> non_model;
};

// True for the keys Megatron saves beside the model in the same checkpoint: optimizer state
// ("optimizer.state.exp_avg.<param>", "optimizer.state.exp_avg_sq.<param>",
// "optimizer.state.fp32_param.<param>", the distributed optimizer's
// "optimizer.distributed.dp_group_idx_N...", "optimizer.param_groups...", each possibly behind a
// chained optimizer's "chained_N." prefix) and the "rng_state" and "rerun_state_machine_state"
// objects. Model keys ("decoder.", "embedding.", "output_layer.", "mtp.", ...) never match.
bool IsNonModelStateKey(std::string_view key);

// Reads `dir`/.metadata. Accepts the metadata classes under both torch.distributed.checkpoint and
// torch.distributed._shard.checkpoint, tensor properties pickled as a dict or as a 5/6-tuple, and
// extra (Megatron) fields. The file's size is checked before it is read (kMaxMetadataBytes) and
// its pickle parsed under MetadataLimits. Non-model state (IsNonModelStateKey) goes to `non_model`
// without validation: it is never read. Errors: ResourceExhausted past the limits; NotFound when
// .metadata is missing; InvalidArgument for malformed metadata, a chunk without storage info, or
// chunks that do not tile the global shape exactly (gaps, overlaps, out of bounds); Unimplemented
// for transform_descriptors (compressed or otherwise transformed chunks).
[[nodiscard]] Result<CheckpointIndex> ReadDistCheckpointIndex(const std::string& dir);

// The directory latest_checkpointed_iteration.txt in `dir` names, as Megatron resolves it:
// `dir`/iter_0000010 for "10", `dir`/release for "release"; `dir` itself when the file is missing
// or holds neither.
std::string ResolveIterationDir(const std::string& dir);

// Largest .metadata read (checked before reading).
inline constexpr uint64_t kMaxMetadataBytes = 1ull << 30;

// Pickle limits for a .metadata of `size` bytes: at most one value per byte (plus 4096), 50M in
// all, a stack of 1M, so memory stays proportional to the file.
PickleLimits MetadataLimits(uint64_t size);

// Checks that `t`'s chunks lie inside its shape, do not overlap and cover it exactly, and that
// the shape has at most kMaxElements elements. Errors: InvalidArgument naming the tensor.
[[nodiscard]] Status ValidateChunks(const SourceTensor& t);

// Product of `shape`; 0 for an empty shape list means a scalar counts as 1. Unchecked: only for
// shapes ValidateChunks or CheckedNumElements accepted.
uint64_t NumElements(const std::vector<int64_t>& shape);

// Product of `shape`. InvalidArgument for a negative dimension or a product above kMaxElements
// (checked at every step, so it never wraps).
[[nodiscard]] Result<uint64_t> CheckedNumElements(const std::vector<int64_t>& shape);

}  // namespace bragg::reshard
