#include "reshard/commands.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <thread>

#include "common/fs.h"
#include "common/units.h"
#include "reshard/convert.h"
#include "reshard/dist_checkpoint.h"
#include "reshard/legacy_checkpoint.h"
#include "reshard/model_map.h"
#include "reshard/plan.h"

namespace bragg::reshard {
namespace {

// The integer in environment variable `name`; nullopt when unset or empty. InvalidArgument
// when it is not a non-negative decimal integer.
Result<std::optional<int>> EnvInt(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') {
    return std::optional<int>();
  }
  int n = 0;
  const char* end = v + std::strlen(v);
  auto [p, ec] = std::from_chars(v, end, n);
  if (ec != std::errc() || p != end || n < 0) {
    return absl::InvalidArgumentError(
        fmt::format("{}='{}' is not a non-negative integer", name, v));
  }
  return std::optional<int>(n);
}

}  // namespace

// torch_dist when .metadata exists in `dir` or in the iteration directory its
// latest_checkpointed_iteration.txt names (iter_NNNNNNN or release), else legacy mp_rank_*
// directories.
Result<CheckpointIndex> ReadAnyCheckpointIndex(const std::string& dir) {
  auto has_metadata = [](const std::string& d) {
    return ::access((d + "/.metadata").c_str(), F_OK) == 0;
  };
  if (has_metadata(dir)) {
    return ReadDistCheckpointIndex(dir);
  }
  const std::string iter = ResolveIterationDir(dir);
  if (iter != dir && has_metadata(iter)) {
    return ReadDistCheckpointIndex(iter);
  }
  if (IsLegacyCheckpoint(dir)) {
    return ReadLegacyCheckpointIndex(dir);
  }
  return ReadDistCheckpointIndex(dir);
}

Status RunInspect(const std::string& dir) {
  BRAGG_ASSIGN_OR_RETURN(CheckpointIndex idx, ReadAnyCheckpointIndex(dir));
  uint64_t total = 0;
  for (const auto& [key, t] : idx.tensors) {
    uint64_t bytes = NumElements(t.shape) * ElementSize(t.dtype);
    total += bytes;
    fmt::print("{} {} [{}] {} chunks\n", key, SafetensorsDType(t.dtype), fmt::join(t.shape, ","),
               t.chunks.size());
    for (const SourceChunk& c : t.chunks) {
      fmt::print("    [{}] + [{}] in {} @{}\n", fmt::join(c.offsets, ","), fmt::join(c.sizes, ","),
                 c.file, c.resolved ? c.data_offset : c.archive_offset);
    }
  }
  for (const std::string& k : idx.byte_items) {
    fmt::print("{} bytes-item\n", k);
  }
  for (const SkippedTensor& t : idx.non_model) {
    fmt::print("{} {} [{}] {} chunks (non-model state, skipped)\n", t.key, t.dtype,
               fmt::join(t.shape, ","), t.chunks);
  }
  fmt::print("{} tensors, {} bytes, {} byte items, {} non-model tensors skipped\n",
             idx.tensors.size(), total, idx.byte_items.size(), idx.non_model.size());
  return absl::OkStatus();
}

Status RunConvert(ConvertArgs a) {
  using clock = std::chrono::steady_clock;
  auto t0 = clock::now();
  if (a.hf_config_dir.empty()) {
    return absl::InvalidArgumentError("--hf-config-dir with the model's config.json is required");
  }
  // Under srun each of rank and world size not given comes from Slurm on its own, so that
  // `--world-size 4` alone still gives every task its own rank.
  std::string rank_from = "--rank";
  std::string world_from = "--world-size";
  if (a.rank == -1) {
    BRAGG_ASSIGN_OR_RETURN(std::optional<int> r, EnvInt("SLURM_PROCID"));
    a.rank = r.value_or(0);
    rank_from = r ? "SLURM_PROCID" : "default";
  }
  if (a.world_size == -1) {
    // A step's task count: SLURM_NTASKS is the allocation's when srun runs fewer tasks.
    for (const char* name : {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"}) {
      BRAGG_ASSIGN_OR_RETURN(std::optional<int> w, EnvInt(name));
      if (w) {
        a.world_size = *w;
        world_from = name;
        break;
      }
    }
    if (a.world_size == -1) {
      a.world_size = 1;
      world_from = "default";
    }
  }
  if (a.rank < 0 || a.world_size < 1 || a.rank >= a.world_size) {
    return absl::InvalidArgumentError(fmt::format(
        "rank {} (from {}) and world size {} (from {}) do not fit: the rank must be in [0, world "
        "size); give both --rank and --world-size, or run under srun",
        a.rank, rank_from, a.world_size, world_from));
  }
  spdlog::info("rank {} (from {}) of {} (from {})", a.rank, rank_from, a.world_size, world_from);
  BRAGG_ASSIGN_OR_RETURN(uint64_t budget, bragg::ParseSize(a.mem_budget));
  BRAGG_ASSIGN_OR_RETURN(uint64_t max_shard, bragg::ParseSize(a.max_shard));
  if (max_shard == 0) {
    return absl::InvalidArgumentError("--max-shard-size must be positive");
  }
  BRAGG_ASSIGN_OR_RETURN(std::string cfg_text,
                         bragg::ReadFileToString(a.hf_config_dir + "/config.json"));
  if (a.model.empty()) {
    BRAGG_ASSIGN_OR_RETURN(a.model, FamilyFromModelType(cfg_text));
    spdlog::info("--model {} (from config.json's model_type)", a.model);
  }
  BRAGG_ASSIGN_OR_RETURN(ModelConfig cfg, ParseModelConfig(a.model, cfg_text));
  if (a.fused_gate_up && cfg.num_experts == 0) {
    return absl::InvalidArgumentError(fmt::format(
        "--fused-gate-up applies to MoE families (qwen3_moe, deepseek_v3), not {}", a.model));
  }
  cfg.fused_gate_up = a.fused_gate_up;
  cfg.skip_mtp = a.skip_mtp;
  BRAGG_ASSIGN_OR_RETURN(CheckpointIndex idx, ReadAnyCheckpointIndex(a.src));
  if (!idx.non_model.empty()) {
    spdlog::info("skipping {} tensors of non-model state (optimizer, RNG; e.g. '{}')",
                 idx.non_model.size(), idx.non_model.front().key);
  }
  BRAGG_ASSIGN_OR_RETURN(Plan plan, BuildPlan(idx, cfg, max_shard));
  BRAGG_RETURN_IF_ERROR(AssignRunId(&plan, idx.dir));
  {
    // A tensor larger than the limit gets a shard of its own, larger than the limit.
    size_t over = 0;
    const PlannedTensor* largest = nullptr;
    for (const PlannedShard& s : plan.shards) {
      for (const PlannedTensor& t : s.tensors) {
        if (t.bytes > max_shard) {
          ++over;
          largest = largest == nullptr || t.bytes > largest->bytes ? &t : largest;
        }
      }
    }
    if (largest != nullptr) {
      spdlog::warn(
          "--max-shard-size {} is smaller than {} tensors (largest '{}', {} bytes): each gets a "
          "shard of its own, larger than the limit",
          a.max_shard, over, largest->map.hf_name, largest->bytes);
    }
  }
  double plan_s = std::chrono::duration<double>(clock::now() - t0).count();
  spdlog::info(
      "plan: {} output tensors in {} shards, {:.3f} GB, {} work items, run id {}, {:.3f} s",
      [&] {
        size_t n = 0;
        for (const auto& s : plan.shards) {
          n += s.tensors.size();
        }
        return n;
      }(),
      plan.shards.size(), plan.total_bytes / 1e9, plan.items.size(), plan.run_id, plan_s);
  if (a.dry_run) {
    fmt::print("{}", DescribePlan(plan));
    return absl::OkStatus();
  }
  ConvertOptions o;
  o.src_dir = idx.dir;  // the iteration directory for legacy checkpoints
  o.dst_dir = a.dst;
  o.hf_config_dir = a.hf_config_dir;
  o.threads = a.threads > 0 ? a.threads
                            : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  o.mem_budget = budget;
  o.rank = a.rank;
  o.world_size = a.world_size;
  BRAGG_ASSIGN_OR_RETURN(o.copy_method, ParseCopyMethod(a.copy_method));
  BRAGG_ASSIGN_OR_RETURN(ConvertStats st, ExecutePlan(plan, o));
  if (a.verify) {
    o.verify = true;
    BRAGG_RETURN_IF_ERROR(ExecutePlan(plan, o).status());
    spdlog::info("verify: every byte of this rank's shards matches the source");
  }
  spdlog::info("rank {}/{}: {} shards written, index {}, total {:.2f} s", a.rank, a.world_size,
               st.shards_written, st.index_written ? "written" : "left to another rank",
               std::chrono::duration<double>(clock::now() - t0).count());
  if (!st.index_written) {
    spdlog::warn(
        "rank {}/{}: model.safetensors.index.json NOT written: shard {} of this run is not in "
        "place yet; the rank that finishes last writes it (if every rank has finished and there "
        "is no index, a rank failed: run it again)",
        a.rank, a.world_size, st.index_waits_for);
  }
  return absl::OkStatus();
}

}  // namespace bragg::reshard
