#pragma once

// What the bragg-train command runs: steps over a trajectory file with progress lines, a
// metrics JSONL, checkpoints and the final model; or the log-probs of a trajectory file.

#include <cstdint>
#include <string>

#include "common/status.h"
#include "train/trainer.h"

namespace bragg::train {

struct RunConfig {
  TrainOptions train;
  std::string trajectories;      // JSONL (docs/train.md)
  int64_t batch_size = 0;        // trajectories per step; 0: the whole file
  int64_t steps = 1;             // steps; batches are taken in file order, wrapping around
  std::string out;               // the trained model (a Hugging Face directory), written at the end
  std::string checkpoint_dir;    // where checkpoints go (step-N, latest); empty: none
  int64_t checkpoint_every = 0;  // steps between checkpoints; 0: only at the end
  bool resume = false;           // continue from checkpoint_dir/latest
  std::string metrics;           // JSONL of StepMetrics, one line per step; empty: none
};

// Runs the steps. Refuses a bad trajectory file before training anything.
Status RunTraining(const RunConfig& config);

// Writes one JSON line per trajectory, {"id", "logprobs"}, with the model's log-probs, to `out`
// ("-": stdout).
Status RunLogProbs(const TrainOptions& options, const std::string& trajectories,
                   const std::string& out);

// Writes the objective's gradient on the whole trajectory file to `out` (safetensors).
Status RunGradients(const TrainOptions& options, const std::string& trajectories,
                    const std::string& out);

std::string MetricsToJson(const StepMetrics& m);

}  // namespace bragg::train
