// bragg-train --model DIR --trajectories FILE.jsonl [--out DIR] [--objective grpo|sft] ...
// bragg-train logprobs --model DIR --trajectories FILE.jsonl [--output FILE]
// bragg-train gradients --model DIR --trajectories FILE.jsonl --output G.safetensors
// GRPO/PPO and supervised training of Qwen3 models on packed trajectories (docs/train.md).

#include <CLI/CLI.hpp>
#include <cstdio>

#include "common/blas_core.h"
#include "train/run.h"

namespace {

void AddModelOptions(CLI::App* app, bragg::train::TrainOptions* o, bool required) {
  app->add_option("--model", o->model_dir, "Hugging Face model directory")->required(required);
  app->add_option("--threads", o->threads, "torch threads (0: torch's default)");
  app->add_flag("--deterministic", o->deterministic,
                "the engine's batch-invariant arithmetic: log-probs equal to a --deterministic "
                "engine's bit for bit");
  app->add_flag("--bf16", o->bf16, "compute in bfloat16 (master weights stay FP32)");
  app->add_option("--temperature", o->temperature, "the sampling temperature of the rollouts");
  app->add_option("--max-tokens", o->max_tokens, "tokens per packed micro-batch");
}

}  // namespace

int main(int argc, char** argv) {
  bragg::ReexecForKnownBlasCore(argv);  // before anything else runs
  CLI::App app{"bragg-train: GRPO/PPO and supervised training on packed trajectories"};
  bragg::train::RunConfig c;
  bragg::train::TrainOptions& o = c.train;
  std::string objective = "grpo", recompute = "none", dp_balance = "cost";
  AddModelOptions(&app, &o, /*required=*/false);
  app.add_option("--trajectories", c.trajectories, "JSONL of trajectories (required)");
  app.add_option("--out", c.out, "write the trained model here (Hugging Face directory)");
  app.add_option("--objective", objective, "grpo | sft")->check(CLI::IsMember({"grpo", "sft"}));
  app.add_option("--steps", c.steps, "training steps (batches in file order, wrapping)");
  app.add_option("--batch-size", c.batch_size, "trajectories per step (0: the whole file)");
  app.add_option("--lr", o.lr, "AdamW learning rate");
  app.add_option("--weight-decay", o.weight_decay, "AdamW decoupled weight decay");
  app.add_option("--max-grad-norm", o.max_grad_norm, "clip the global grad norm (0: off)");
  app.add_option("--minibatches", o.minibatches, "optimizer steps per batch");
  app.add_option("--clip-low", o.clip_low, "PPO ratio clip below 1");
  app.add_option("--clip-high", o.clip_high, "PPO ratio clip above 1");
  app.add_option("--tis-cap", o.tis_cap, "truncated importance sampling cap (0: off)");
  app.add_option("--kl-coef", o.kl_coef, "KL to --reference (k3 estimator)");
  app.add_option("--reference", o.reference_dir, "reference model for the KL term");
  app.add_option("--entropy-coef", o.entropy_coef, "entropy bonus");
  app.add_flag("!--no-std-normalization", o.normalize_std,
               "GRPO advantages without dividing by the group's std");
  app.add_option("--recompute", recompute,
                 "activations recomputed in backward: none | "
                 "selective (each layer's MLP half) | full (whole layers)")
      ->check(CLI::IsMember({"none", "selective", "full"}));
  app.add_option("--optimizer-chunk", o.optimizer_chunk_elements,
                 "FP32 elements per streamed optimizer chunk");
  app.add_option("--checkpoint-dir", c.checkpoint_dir, "write checkpoints here");
  app.add_option("--checkpoint-every", c.checkpoint_every, "steps between checkpoints");
  app.add_flag("--resume", c.resume, "continue from --checkpoint-dir/latest");
  app.add_option("--metrics", c.metrics, "append one JSON line of metrics per step");
  app.add_option("--world-size", o.world_size,
                 "data-parallel ranks (processes given the same "
                 "trajectories; gradients summed over them)");
  app.add_option("--rank", o.rank, "this process's data-parallel rank");
  app.add_option("--rendezvous", o.rendezvous,
                 "where the ranks meet: file:PATH (one machine) or tcp:HOST:PORT (rank 0 listens)");
  app.add_option("--dp-balance", dp_balance,
                 "how trajectories are dealt to the ranks: cost (bragg_pack's cost-aware plan) | "
                 "round-robin (the baseline, for comparisons)");

  bragg::train::TrainOptions lo;
  std::string lp_in, lp_out = "-";
  CLI::App* logprobs = app.add_subcommand("logprobs", "the model's log-prob of every token");
  AddModelOptions(logprobs, &lo, /*required=*/true);
  logprobs->add_option("--trajectories", lp_in, "JSONL of trajectories")->required();
  logprobs->add_option("--output", lp_out, "JSONL out (- : stdout)");
  bragg::train::TrainOptions go;
  std::string g_in, g_out, g_objective = "sft";
  CLI::App* grads = app.add_subcommand(
      "gradients", "the objective's gradient on a trajectory file, as safetensors (no step)");
  AddModelOptions(grads, &go, /*required=*/true);
  grads->add_option("--trajectories", g_in, "JSONL of trajectories")->required();
  grads->add_option("--output", g_out, "safetensors file to write")->required();
  grads->add_option("--objective", g_objective, "grpo | sft")
      ->check(CLI::IsMember({"grpo", "sft"}));
  app.require_subcommand(0, 1);
  CLI11_PARSE(app, argc, argv);
  bragg::Status s;
  if (logprobs->parsed()) {
    s = bragg::train::RunLogProbs(lo, lp_in, lp_out);
  } else if (grads->parsed()) {
    auto obj = bragg::train::ParseObjective(g_objective);
    s = obj.ok() ? (go.objective = *obj, bragg::train::RunGradients(go, g_in, g_out))
                 : obj.status();
  } else {
    auto obj = bragg::train::ParseObjective(objective);
    auto rec = bragg::train::ParseRecompute(recompute);
    auto bal = bragg::train::ParseDpBalance(dp_balance);
    if (!obj.ok()) {
      s = obj.status();
    } else if (!rec.ok()) {
      s = rec.status();
    } else if (!bal.ok()) {
      s = bal.status();
    } else {
      o.objective = *obj;
      o.recompute = *rec;
      o.dp_balance = *bal;
      s = bragg::train::RunTraining(c);
    }
  }
  if (!s.ok()) {
    std::fprintf(stderr, "bragg-train: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
