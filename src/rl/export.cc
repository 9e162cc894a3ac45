#include "rl/export.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <numeric>
#include <vector>

#include "common/fs.h"
#include "common/str_cat.h"
#include "pack/plan.h"

namespace bragg::rl {

using json = nlohmann::json;

Status WritePackedBatch(std::span<const train::Trajectory> batch,
                        std::span<const double> advantages, const ExportConfig& layout,
                        int64_t max_tokens, int64_t step, int64_t version,
                        const std::string& path) {
  if (advantages.size() != batch.size()) {
    return absl::InvalidArgumentError(
        Cat(advantages.size(), " advantages for ", batch.size(), " trajectories"));
  }
  if (batch.empty()) {
    return absl::InvalidArgumentError("no trajectories to export");
  }
  std::vector<pack::Trace> traces;
  traces.reserve(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) {
    const train::Trajectory& t = batch[i];
    if (t.tokens.empty() || t.loss_mask.size() != t.tokens.size() ||
        t.logprobs.size() != t.tokens.size()) {
      return absl::InvalidArgumentError(
          Cat("trajectory ", t.id, ": tokens, loss_mask and logprobs differ in length"));
    }
    pack::Trace tr;
    tr.id = static_cast<int64_t>(i);
    tr.length = static_cast<int64_t>(t.tokens.size());
    tr.loss_tokens = std::accumulate(t.loss_mask.begin(), t.loss_mask.end(), int64_t{0});
    traces.push_back(tr);
  }
  pack::PackConfig pc;
  pc.dp = layout.dp;
  pc.cp = layout.cp;
  pc.tp = layout.tp;
  pc.sequence_parallel = layout.sequence_parallel;
  pc.max_tokens = max_tokens;
  BRAGG_ASSIGN_OR_RETURN(pack::Plan plan, pack::PlanPacking(traces, pc));

  std::string out;
  for (size_t rank = 0; rank < plan.ranks.size(); ++rank) {
    const auto& mbs = plan.ranks[rank].micro_batches;
    for (size_t m = 0; m < mbs.size(); ++m) {
      for (const pack::Row& row : mbs[m].rows) {
        size_t total = static_cast<size_t>(row.total_tokens);
        std::vector<int32_t> tokens(total, 0), loss(total, 0);
        std::vector<double> adv(total, 0.0), lps(total, 0.0);
        json ids = json::array();
        for (size_t k = 0; k < row.trace_ids.size(); ++k) {
          const size_t i = static_cast<size_t>(row.trace_ids[k]);
          const train::Trajectory& t = batch[i];
          const size_t at = static_cast<size_t>(row.cu_seqlens_padded[k]);
          for (size_t j = 0; j < t.tokens.size(); ++j) {
            tokens[at + j] = t.tokens[j];
            loss[at + j] = t.loss_mask[j] ? 1 : 0;
            adv[at + j] = t.loss_mask[j] ? advantages[i] : 0.0;
            lps[at + j] = t.loss_mask[j] ? static_cast<double>(t.logprobs[j]) : 0.0;
          }
          ids.push_back(t.id);
        }
        json j = {{"tokens", tokens},  {"cu_seqlens", row.cu_seqlens},
                  {"loss_mask", loss}, {"advantages", adv},
                  {"logprobs", lps},   {"trajectory_ids", ids},
                  {"dp_rank", rank},   {"micro_batch", m},
                  {"step", step},      {"version", version}};
        if (row.cu_seqlens_padded != row.cu_seqlens) {
          j["cu_seqlens_padded"] = row.cu_seqlens_padded;
        }
        out += j.dump(-1, ' ', false, json::error_handler_t::replace);
        out += "\n";
      }
    }
  }
  const std::string tmp = path + ".tmp";
  BRAGG_RETURN_IF_ERROR(WriteStringToFile(tmp, out));
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(Cat("renaming ", tmp, " to ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace bragg::rl
