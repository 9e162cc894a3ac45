#pragma once

// JSON form of a Plan, as printed by `bragg-pack plan --json` (scripts depend on its keys).

#include <string>
#include <vector>

#include "common/status.h"
#include "nlohmann/json.hpp"
#include "pack/plan.h"

namespace bragg::pack {

// {"summary": {traces, ranks, micro_batches_per_rank, max_over_mean, lower_bound,
//  padding_fraction, plan_ms, ...}, "ranks": [{"rank", "cost", "micro_batches": [{"trace_ids",
//  "cu_seqlens", "cu_seqlens_padded", "max_seqlen", "total_tokens", "cost", ...}]}]}.
// With include_ranks = false only "summary" is filled.
nlohmann::json PlanToJson(const Plan& plan, bool include_ranks = true);

// Parses one integer length per line (blank lines and lines starting with '#' skipped).
// InvalidArgument names the line of the first bad entry.
Result<std::vector<int64_t>> ParseLengths(const std::string& text);

// Parses "0,8,20" into integers. InvalidArgument on anything else.
Result<std::vector<int32_t>> ParseIntList(const std::string& text);

}  // namespace bragg::pack
