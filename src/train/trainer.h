#pragma once

// bragg-train's door: GRPO/PPO and supervised steps on packed batches of trajectories, over the
// engine's own Qwen3 code (engine/model/qwen3.h), so that the log-probs the trainer computes
// are the engine's (bit for bit with `deterministic` on both sides). docs/train.md.
//
// This header names no torch type; trainer.cc is the torch side. A Trainer is not thread-safe:
// one thread drives it.

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "train/trajectory.h"

namespace bragg::train {

enum class Objective {
  kGrpo,  // group-relative advantages, PPO clipped surrogate, truncated importance sampling
  kSft,   // supervised: maximise the log-prob of the loss-masked tokens (a warm start)
};
Result<Objective> ParseObjective(std::string_view name);  // "grpo" | "sft"
std::string_view Name(Objective o);                       // ParseObjective's inverse

// Activations recomputed in backward instead of kept from forward.
enum class Recompute {
  kNone,
  // Each layer's MLP half (its norm, the SwiGLU or the experts' intermediates: memory-heavy
  // and cheap) is recomputed; the attention half's activations are kept.
  kSelective,
  kFull,  // each whole layer is recomputed from its input
};
Result<Recompute> ParseRecompute(std::string_view name);  // "none" | "selective" | "full"
std::string_view Name(Recompute r);                       // ParseRecompute's inverse

// How a step's trajectories are dealt to the data-parallel ranks (bragg_pack's plan).
enum class DpBalance {
  // Cost-aware: longest first to the least-loaded rank, then swaps between the most and least
  // loaded ranks while that lowers the maximum (pack::Method::kLpt).
  kCost,
  // The baseline: trajectory i to micro-batch i mod (ranks x micro-batches), in batch order,
  // whatever its length (pack::Method::kRoundRobin). For comparisons (bench/train).
  kRoundRobin,
};
Result<DpBalance> ParseDpBalance(std::string_view name);  // "cost" | "round-robin"
std::string_view Name(DpBalance b);                       // ParseDpBalance's inverse

struct TrainOptions {
  std::string model_dir;      // Hugging Face directory (what bragg-engine and bragg-reshard read)
  std::string reference_dir;  // optional: the KL reference policy (same shapes)
  bool bf16 = false;          // compute dtype; master weights and Adam state stay FP32
  int threads = 0;            // torch intra-op threads; 0: torch's default
  bool deterministic =
      false;  // the engine's batch-invariant arithmetic (parity with its log-probs)
  Objective objective = Objective::kGrpo;
  double temperature = 1.0;  // the sampling temperature the log-probs are taken at

  // AdamW (FP32 master weights and moments in host memory, streamed in chunks).
  double lr = 1e-4;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  double max_grad_norm = 1.0;  // 0: no clipping
  int64_t optimizer_chunk_elements = int64_t{1} << 22;

  // GRPO / PPO.
  bool normalize_std = true;  // advantages divided by the group's std (false: Dr. GRPO)
  double clip_low = 0.2, clip_high = 0.28;  // ratio clipped to [1 - low, 1 + high]
  // Truncated importance sampling: tokens sampled by an older policy are weighted by
  // min(pi_proximal / pi_behaviour, cap); 0 turns it off (weight 1).
  double tis_cap = 2.0;
  double kl_coef = 0;       // k3 estimator of KL(policy || reference); needs reference_dir
  double entropy_coef = 0;  // bonus on the policy's entropy
  // Optimizer steps per batch: the batch splits into this many mini-batches, each one step;
  // the ratio is then taken against the proximal policy (log-probs computed before the first).
  int minibatches = 1;

  // Packing (bragg_pack): tokens per micro-batch; every micro-batch is one forward/backward.
  int64_t max_tokens = 8192;
  int64_t lce_token_chunk = 1024;  // rows per chunk of the fused linear cross-entropy

  // For comparisons (bench/train): false computes the [T, V] logits whole (log_softmax); true
  // pads every trace of a micro-batch to its longest (a BSHD batch) instead of packing.
  bool fused_cross_entropy = true;
  bool padded = false;
  Recompute recompute = Recompute::kNone;

  // Data parallelism: world_size trainers (processes, or threads), each given the same batches,
  // each running its rank's share of bragg_pack's plan; gradients are summed over the ranks
  // before every optimizer step, so every rank holds the same weights. rendezvous:
  // "file:PATH" or "tcp:HOST:PORT" (data_parallel.h). Only rank 0 writes models and checkpoints.
  int world_size = 1;
  int rank = 0;
  std::string rendezvous;
  // How Step deals the trajectories to the ranks (with one rank: to its micro-batches). Every
  // rank must be given the same. LogProbs and RoutedExperts always plan by cost; `padded`
  // batches are planned as padded ones whatever this says.
  DpBalance dp_balance = DpBalance::kCost;
};

struct StepMetrics {
  int64_t step = 0;     // optimizer steps done after this one
  int64_t version = 0;  // weight version after it
  int64_t trajectories = 0, tokens = 0, loss_tokens = 0;
  int micro_batches = 0;
  double loss = 0;           // the objective, token-normalised
  double policy_loss = 0;    // its surrogate part
  double entropy = 0;        // mean over loss tokens
  double kl = 0;             // mean k3 over loss tokens (0 without a reference)
  double clip_fraction = 0;  // loss tokens whose clipped term was taken
  double is_weight_mean = 1, is_truncated_fraction = 0;
  double logprob_diff_max = 0;  // max |trainer - behaviour| log-prob at step start
  double grad_norm = 0;
  double reward_mean = 0, advantage_abs_mean = 0;
  int64_t min_version = -1, max_version = -1;  // of the trained tokens (-1: not given)
  double seconds = 0, tokens_per_second = 0;
  // Forward/backward seconds of the slowest rank and the mean over ranks (equal with one rank):
  // how well the plan balanced the work.
  double rank_seconds_max = 0, rank_seconds_mean = 0;
  // The packed tokens (each trajectory's but its last; padding too with `padded`) of the rank
  // given the most and the mean over ranks: the plan's balance, free of timing noise.
  int64_t rank_tokens_max = 0;
  double rank_tokens_mean = 0;
};

class Trainer {
 public:
  // Loads the model (and reference) and makes the optimizer. InvalidArgument for a bad option
  // or model directory (naming what), FailedPrecondition for kl_coef without a reference.
  static Result<std::unique_ptr<Trainer>> Create(const TrainOptions& options);
  // Resumes from a checkpoint SaveCheckpoint wrote (model, optimizer, step, version): the next
  // steps are bit for bit those of the uninterrupted run.
  static Result<std::unique_ptr<Trainer>> Resume(const std::string& checkpoint_dir,
                                                 TrainOptions options);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // One training step (`minibatches` optimizer steps) on `batch`. Every trajectory is checked
  // first; on any error nothing is trained (InvalidArgument naming the trajectory and field).
  Result<StepMetrics> Step(std::span<const Trajectory> batch);

  // The current policy's log-prob of every token given its prefix (index 0: 0), at the
  // options' temperature, computed on the packed batch as Step does.
  Result<std::vector<std::vector<float>>> LogProbs(std::span<const Trajectory> batch);
  // The experts the current policy routes each position but the last to: int32
  // [tokens - 1, moe layers, top_k] per trajectory (empty for a dense model).
  Result<std::vector<std::vector<int32_t>>> RoutedExperts(std::span<const Trajectory> batch);

  // Writes the current weights as a Hugging Face directory `dir` (config.json of the model
  // loaded, model.safetensors in the dtypes it was loaded from) that bragg-engine loads or
  // takes as a weight update; published atomically (safetensors_writer.h).
  Status SaveModel(const std::string& dir) const;
  // Writes the objective's gradient on `batch` (no optimizer step; nothing changes) as a
  // safetensors file of FP32 tensors named as the model's Hugging Face parameters: for checks
  // against other implementations (tests/train).
  Status SaveGradients(std::span<const Trajectory> batch, const std::string& path);
  // Writes `root`/step-N (model, optimizer state, trainer.json) and points `root`/latest at it;
  // Resume(root) continues from latest.
  Status SaveCheckpoint(const std::string& root) const;

  int64_t step() const;
  int64_t version() const;
  void set_version(int64_t v);
  void set_lr(double lr);
  const TrainOptions& options() const;

 private:
  struct Impl;
  explicit Trainer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace bragg::train
