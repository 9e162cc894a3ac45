#pragma once

// bragg-rl's door: the asynchronous RL loop (docs/rl.md). Rollouts run in `concurrency` agent
// loops (rollout.h) while the trainer (train/trainer.h, in this process) steps on the groups that
// are done; after each step the weights go to the fleet through the gateway's in-place update,
// and rollouts in flight go on on the new weights. Admission bounds staleness (AReaL's rule): a
// group may start only while the groups started and not dropped number fewer than
// (trainer version + max_staleness + 1) x groups_per_step, and a trajectory whose oldest token
// is more than max_staleness versions behind the trainer is dropped, never trained on.

#include <string>
#include <vector>

#include "common/status.h"
#include "rl/config.h"

namespace bragg::rl {

struct RunOptions {
  bool resume = false;  // continue from run.dir/checkpoints/latest
  // Where bragg-engine and bragg-gateway are (config fleet.bin_dir wins when set).
  std::string bin_dir;
};

// Checks what can be checked without starting anything: the vocabulary, every prompt encodes
// and fits (prompt + max_new_tokens <= max_tokens <= the model's context), the warm-start
// traces parse. InvalidArgument naming the file and line.
Status Preflight(const Config& config);

// The flags (all but --listen and --weight-version) of a bragg-engine that serves this run from
// a host bragg-rl does not start engines on (a Slurm job's other nodes): the first model
// (model.path, or [model.init]'s random model, written to run.dir/models/init) and the run's engine
// settings. bragg-rl run with fleet.engine_urls then loads the run's weights into such engines.
Result<std::vector<std::string>> EngineArgs(const Config& config);

// Runs the whole loop: warm start, fleet, rollouts and training, evaluation, plots. Writes
// run.dir/metrics.jsonl, run.dir/trained.jsonl (trajectory ids per step) and run.dir/summary.json.
Status Run(const Config& config, const RunOptions& options);

}  // namespace bragg::rl
