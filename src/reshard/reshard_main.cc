// bragg-reshard: Megatron torch_dist checkpoints -> Hugging Face safetensors.

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <thread>

#include "common/fs.h"
#include "common/logging.h"
#include "common/units.h"
#include "reshard/convert.h"
#include "reshard/dist_checkpoint.h"
#include "reshard/legacy_checkpoint.h"
#include "reshard/model_map.h"
#include "reshard/plan.h"

namespace {

using bragg::Result;
using bragg::Status;
namespace rs = bragg::reshard;

// torch_dist when .metadata exists in `dir` or in the iteration directory its
// latest_checkpointed_iteration.txt names (iter_NNNNNNN or release), else legacy mp_rank_*
// directories.
Result<rs::CheckpointIndex> ReadIndex(const std::string& dir) {
  auto has_metadata = [](const std::string& d) {
    return ::access((d + "/.metadata").c_str(), F_OK) == 0;
  };
  if (has_metadata(dir)) {
    return rs::ReadDistCheckpointIndex(dir);
  }
  const std::string iter = rs::ResolveIterationDir(dir);
  if (iter != dir && has_metadata(iter)) {
    return rs::ReadDistCheckpointIndex(iter);
  }
  if (rs::IsLegacyCheckpoint(dir)) {
    return rs::ReadLegacyCheckpointIndex(dir);
  }
  return rs::ReadDistCheckpointIndex(dir);
}

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

Status Inspect(const std::string& dir) {
  BRAGG_ASSIGN_OR_RETURN(rs::CheckpointIndex idx, ReadIndex(dir));
  uint64_t total = 0;
  for (const auto& [key, t] : idx.tensors) {
    uint64_t bytes = rs::NumElements(t.shape) * rs::ElementSize(t.dtype);
    total += bytes;
    fmt::print("{} {} [{}] {} chunks\n", key, rs::SafetensorsDType(t.dtype),
               fmt::join(t.shape, ","), t.chunks.size());
    for (const rs::SourceChunk& c : t.chunks) {
      fmt::print("    [{}] + [{}] in {} @{}\n", fmt::join(c.offsets, ","), fmt::join(c.sizes, ","),
                 c.file, c.resolved ? c.data_offset : c.archive_offset);
    }
  }
  for (const std::string& k : idx.byte_items) {
    fmt::print("{} bytes-item\n", k);
  }
  for (const rs::SkippedTensor& t : idx.non_model) {
    fmt::print("{} {} [{}] {} chunks (non-model state, skipped)\n", t.key, t.dtype,
               fmt::join(t.shape, ","), t.chunks);
  }
  fmt::print("{} tensors, {} bytes, {} byte items, {} non-model tensors skipped\n",
             idx.tensors.size(), total, idx.byte_items.size(), idx.non_model.size());
  return absl::OkStatus();
}

struct ConvertArgs {
  std::string src, dst, model, hf_config_dir, mem_budget = "2GiB", max_shard = "5GiB";
  int threads = 0;
  int rank = -1;
  int world_size = -1;
  bool verify = false;
  bool dry_run = false;
  bool fused_gate_up = false;
  bool skip_mtp = false;
  std::string copy_method = "auto";
};

Status Convert(ConvertArgs a) {
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
  BRAGG_ASSIGN_OR_RETURN(rs::ModelConfig cfg, rs::ParseModelConfig(a.model, cfg_text));
  if (a.fused_gate_up && cfg.num_experts == 0) {
    return absl::InvalidArgumentError(fmt::format(
        "--fused-gate-up applies to MoE families (qwen3_moe, deepseek_v3), not {}", a.model));
  }
  cfg.fused_gate_up = a.fused_gate_up;
  cfg.skip_mtp = a.skip_mtp;
  BRAGG_ASSIGN_OR_RETURN(rs::CheckpointIndex idx, ReadIndex(a.src));
  if (!idx.non_model.empty()) {
    spdlog::info("skipping {} tensors of non-model state (optimizer, RNG; e.g. '{}')",
                 idx.non_model.size(), idx.non_model.front().key);
  }
  BRAGG_ASSIGN_OR_RETURN(rs::Plan plan, rs::BuildPlan(idx, cfg, max_shard));
  BRAGG_RETURN_IF_ERROR(rs::AssignRunId(&plan, idx.dir));
  {
    // A tensor larger than the limit gets a shard of its own, larger than the limit.
    size_t over = 0;
    const rs::PlannedTensor* largest = nullptr;
    for (const rs::PlannedShard& s : plan.shards) {
      for (const rs::PlannedTensor& t : s.tensors) {
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
    fmt::print("{}", rs::DescribePlan(plan));
    return absl::OkStatus();
  }
  rs::ConvertOptions o;
  o.src_dir = idx.dir;  // the iteration directory for legacy checkpoints
  o.dst_dir = a.dst;
  o.hf_config_dir = a.hf_config_dir;
  o.threads = a.threads > 0 ? a.threads
                            : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  o.mem_budget = budget;
  o.rank = a.rank;
  o.world_size = a.world_size;
  BRAGG_ASSIGN_OR_RETURN(o.copy_method, rs::ParseCopyMethod(a.copy_method));
  BRAGG_ASSIGN_OR_RETURN(rs::ConvertStats st, rs::ExecutePlan(plan, o));
  if (a.verify) {
    o.verify = true;
    BRAGG_RETURN_IF_ERROR(rs::ExecutePlan(plan, o).status());
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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bragg-reshard: Megatron torch_dist checkpoints to Hugging Face safetensors"};
  app.require_subcommand(1);
  std::string level = "info";
  app.add_option("--log-level", level, "trace, debug, info, warn, error");
  std::string inspect_dir;
  auto* inspect = app.add_subcommand("inspect", "print keys, shapes, dtypes and chunking");
  inspect->add_option("CKPT_DIR", inspect_dir)->required();
  ConvertArgs ca;
  auto* convert = app.add_subcommand("convert", "write Hugging Face safetensors shards");
  convert->add_option("--src", ca.src, "Megatron torch_dist checkpoint directory")->required();
  convert->add_option("--dst", ca.dst, "output directory")->required();
  convert
      ->add_option("--model", ca.model,
                   "llama, qwen2, qwen3, qwen3_moe, deepseek_v3 (also Kimi-K2)")
      ->required();
  convert->add_option("--hf-config-dir", ca.hf_config_dir, "config.json and tokenizer files");
  convert->add_option("--threads", ca.threads, "worker threads (default: all cores)");
  convert->add_option("--mem-budget", ca.mem_budget, "bound on buffer memory (default 2GiB)");
  convert->add_option("--max-shard-size", ca.max_shard, "largest output shard (default 5GiB)");
  convert->add_option("--rank", ca.rank, "this process's rank (default: SLURM_PROCID, else 0)");
  convert->add_option("--world-size", ca.world_size,
                      "processes (default: SLURM_STEP_NUM_TASKS, else SLURM_NTASKS, else 1)");
  convert->add_flag("--verify", ca.verify, "re-read the output and compare with the source");
  convert->add_flag("--dry-run-plan", ca.dry_run, "print the plan and write nothing");
  convert->add_flag("--fused-gate-up", ca.fused_gate_up,
                    "MoE experts as stacked mlp.experts.gate_up_proj [E, 2F, H] and "
                    "mlp.experts.down_proj [E, H, F] per layer (transformers' fused layout)");
  convert->add_flag("--skip-mtp", ca.skip_mtp,
                    "leave multi-token-prediction tensors (mtp.*) out of the output");
  convert->add_option("--copy-method", ca.copy_method,
                      "auto (default), copy_file_range, mmap or pread: how contiguous runs are "
                      "copied (copy_file_range falls back to mmap where the kernel refuses)");
  CLI11_PARSE(app, argc, argv);
  if (Status s = bragg::InitLogging("bragg-reshard", level); !s.ok()) {
    std::cerr << "bragg-reshard: " << s.message() << "\n";
    return 2;
  }
  Status s = inspect->parsed() ? Inspect(inspect_dir) : Convert(ca);
  if (!s.ok()) {
    std::cerr << "bragg-reshard: " << s.message() << "\n";
    return 1;
  }
  return 0;
}
