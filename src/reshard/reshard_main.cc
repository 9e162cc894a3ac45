// bragg-reshard: Megatron torch_dist checkpoints -> Hugging Face safetensors. Parses flags,
// runs `inspect` or `convert` (reshard/commands.h), maps the outcome to an exit code.

#include <CLI/CLI.hpp>
#include <iostream>
#include <string>

#include "common/logging.h"
#include "reshard/commands.h"

namespace {

using bragg::Status;
namespace rs = bragg::reshard;

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bragg-reshard: Megatron torch_dist checkpoints to Hugging Face safetensors"};
  app.require_subcommand(1);
  std::string level = "info";
  app.add_option("--log-level", level, "trace, debug, info, warn, error");
  std::string inspect_dir;
  auto* inspect = app.add_subcommand("inspect", "print keys, shapes, dtypes and chunking");
  inspect->add_option("CKPT_DIR", inspect_dir)->required();
  rs::ConvertArgs ca;
  auto* convert = app.add_subcommand("convert", "write Hugging Face safetensors shards");
  convert->add_option("--src", ca.src, "Megatron torch_dist checkpoint directory")->required();
  convert->add_option("--dst", ca.dst, "output directory")->required();
  convert->add_option("--model", ca.model,
                      "llama, qwen2, qwen3, qwen3_moe, deepseek_v3 (also Kimi-K2); default: from "
                      "model_type in --hf-config-dir's config.json");
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
  Status s = inspect->parsed() ? rs::RunInspect(inspect_dir) : rs::RunConvert(ca);
  if (!s.ok()) {
    std::cerr << "bragg-reshard: " << s.message() << "\n";
    return 1;
  }
  return 0;
}
