#pragma once

// The subcommands of bragg-reshard: `inspect` prints a checkpoint's index, `convert` writes
// Hugging Face safetensors shards (this process's share of them under srun).

#include <string>

#include "common/status.h"
#include "reshard/dist_checkpoint.h"

namespace bragg::reshard {

// The index of the checkpoint in `dir`: torch_dist when .metadata exists in `dir` or in the
// iteration directory its latest_checkpointed_iteration.txt names (iter_NNNNNNN or release), else
// legacy mp_rank_* directories. The readers' errors when it is neither.
Result<CheckpointIndex> ReadAnyCheckpointIndex(const std::string& dir);

// `inspect CKPT_DIR`: prints every tensor (key, dtype, shape, chunks), byte item and skipped
// non-model tensor of the checkpoint to stdout, then a summary line.
Status RunInspect(const std::string& dir);

// The flags of `convert`.
struct ConvertArgs {
  std::string src, dst, model, hf_config_dir, mem_budget = "2GiB", max_shard = "5GiB";
  int threads = 0;      // 0: every core
  int rank = -1;        // -1: $SLURM_PROCID, else 0
  int world_size = -1;  // -1: $SLURM_STEP_NUM_TASKS, else $SLURM_NTASKS, else 1
  bool verify = false;
  bool dry_run = false;  // print the plan to stdout, write nothing
  bool fused_gate_up = false;
  bool skip_mtp = false;
  std::string copy_method = "auto";
};

// `convert`: plans the output shards and writes this rank's (logging progress through
// spdlog). InvalidArgument for flags or Slurm variables that do not fit (no --hf-config-dir, a
// rank outside the world size, a bad size, --fused-gate-up on a dense model); the readers' and
// writers' errors otherwise.
Status RunConvert(ConvertArgs a);

}  // namespace bragg::reshard
