#include "train/run.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/str_cat.h"

namespace bragg::train {

std::string MetricsToJson(const StepMetrics& m) {
  nlohmann::json j = {{"step", m.step},
                      {"version", m.version},
                      {"trajectories", m.trajectories},
                      {"tokens", m.tokens},
                      {"loss_tokens", m.loss_tokens},
                      {"micro_batches", m.micro_batches},
                      {"loss", m.loss},
                      {"policy_loss", m.policy_loss},
                      {"entropy", m.entropy},
                      {"kl", m.kl},
                      {"clip_fraction", m.clip_fraction},
                      {"is_weight_mean", m.is_weight_mean},
                      {"is_truncated_fraction", m.is_truncated_fraction},
                      {"logprob_diff_max", m.logprob_diff_max},
                      {"grad_norm", m.grad_norm},
                      {"reward_mean", m.reward_mean},
                      {"advantage_abs_mean", m.advantage_abs_mean},
                      {"min_version", m.min_version},
                      {"max_version", m.max_version},
                      {"seconds", m.seconds},
                      {"tokens_per_second", m.tokens_per_second},
                      {"rank_seconds_max", m.rank_seconds_max},
                      {"rank_seconds_mean", m.rank_seconds_mean},
                      {"rank_tokens_max", m.rank_tokens_max},
                      {"rank_tokens_mean", m.rank_tokens_mean}};
  return j.dump();
}

Status RunTraining(const RunConfig& c) {
  if (c.trajectories.empty()) {
    return absl::InvalidArgumentError("no trajectory file (--trajectories)");
  }
  if (c.steps < 0 || c.batch_size < 0 || c.checkpoint_every < 0) {
    return absl::InvalidArgumentError("steps, batch size and checkpoint interval must be >= 0");
  }
  if (c.resume && c.checkpoint_dir.empty()) {
    return absl::InvalidArgumentError("--resume needs --checkpoint-dir");
  }
  BRAGG_ASSIGN_OR_RETURN(std::vector<Trajectory> all, ReadTrajectories(c.trajectories));
  if (all.empty()) {
    return absl::InvalidArgumentError(Cat(c.trajectories, ": no trajectories"));
  }
  std::unique_ptr<Trainer> trainer;
  if (c.resume) {
    BRAGG_ASSIGN_OR_RETURN(trainer, Trainer::Resume(c.checkpoint_dir, c.train));
  } else {
    BRAGG_ASSIGN_OR_RETURN(trainer, Trainer::Create(c.train));
  }
  const int64_t bs = c.batch_size > 0 ? std::min<int64_t>(c.batch_size, all.size()) : all.size();
  std::ofstream metrics;
  if (!c.metrics.empty()) {
    metrics.open(c.metrics, std::ios::app);
    if (!metrics) {
      return absl::InvalidArgumentError(Cat("cannot open ", c.metrics));
    }
  }
  std::fprintf(stderr, "bragg-train: %zu trajectories, batches of %lld, from step %lld to %lld\n",
               all.size(), static_cast<long long>(bs), static_cast<long long>(trainer->step()),
               static_cast<long long>(c.steps));
  // Steps already done (a resumed run) are not repeated: `steps` counts from the start.
  for (int64_t s = trainer->version(); s < c.steps; ++s) {
    std::vector<Trajectory> batch;
    for (int64_t i = 0; i < bs; ++i) {
      batch.push_back(all[(s * bs + i) % all.size()]);
      batch.back().id = Cat(batch.back().id, "#", s);
    }
    BRAGG_ASSIGN_OR_RETURN(StepMetrics m, trainer->Step(batch));
    std::fprintf(stderr,
                 "step %lld v%lld  loss %.4f  reward %.3f  entropy %.3f  clip %.3f  "
                 "is-w %.3f  |g| %.3g  %lld tok  %.0f tok/s\n",
                 static_cast<long long>(m.step), static_cast<long long>(m.version), m.loss,
                 m.reward_mean, m.entropy, m.clip_fraction, m.is_weight_mean, m.grad_norm,
                 static_cast<long long>(m.tokens), m.tokens_per_second);
    if (c.train.world_size > 1) {
      // How well the plan balanced the ranks (1: perfectly), by time and by tokens.
      std::fprintf(stderr, "step %lld ranks: time max/mean %.3f  tokens max/mean %.3f\n",
                   static_cast<long long>(m.step),
                   m.rank_seconds_max / std::max(1e-9, m.rank_seconds_mean),
                   static_cast<double>(m.rank_tokens_max) / std::max(1.0, m.rank_tokens_mean));
    }
    // The checkpoint first: a metrics line stands for a step a resume will not redo (with a
    // checkpoint every step).
    if (!c.checkpoint_dir.empty() && c.checkpoint_every > 0 && (s + 1) % c.checkpoint_every == 0) {
      BRAGG_RETURN_IF_ERROR(trainer->SaveCheckpoint(c.checkpoint_dir));
    }
    if (metrics.is_open()) {
      metrics << MetricsToJson(m) << "\n" << std::flush;
    }
  }
  if (!c.checkpoint_dir.empty()) {
    BRAGG_RETURN_IF_ERROR(trainer->SaveCheckpoint(c.checkpoint_dir));
  }
  if (!c.out.empty()) {
    BRAGG_RETURN_IF_ERROR(trainer->SaveModel(c.out));
    std::fprintf(stderr, "bragg-train: wrote %s (version %lld)\n", c.out.c_str(),
                 static_cast<long long>(trainer->version()));
  }
  return absl::OkStatus();
}

Status RunLogProbs(const TrainOptions& options, const std::string& trajectories,
                   const std::string& out) {
  BRAGG_ASSIGN_OR_RETURN(std::vector<Trajectory> all, ReadTrajectories(trajectories));
  BRAGG_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(options));
  BRAGG_ASSIGN_OR_RETURN(std::vector<std::vector<float>> lp, trainer->LogProbs(all));
  std::FILE* f = out == "-" ? stdout : std::fopen(out.c_str(), "w");
  if (f == nullptr) {
    return absl::InvalidArgumentError(Cat("cannot open ", out));
  }
  for (size_t i = 0; i < all.size(); ++i) {
    std::string line = nlohmann::json({{"id", all[i].id}, {"logprobs", lp[i]}}).dump() + "\n";
    std::fwrite(line.data(), 1, line.size(), f);
  }
  bool ok = std::fflush(f) == 0;
  if (f != stdout) {
    ok = std::fclose(f) == 0 && ok;
  }
  return ok ? absl::OkStatus() : absl::InternalError(Cat("writing ", out, " failed"));
}

Status RunGradients(const TrainOptions& options, const std::string& trajectories,
                    const std::string& out) {
  BRAGG_ASSIGN_OR_RETURN(std::vector<Trajectory> all, ReadTrajectories(trajectories));
  BRAGG_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(options));
  return trainer->SaveGradients(all, out);
}

}  // namespace bragg::train
