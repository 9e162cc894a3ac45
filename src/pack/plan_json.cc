#include "pack/plan_json.h"

#include <charconv>
#include <limits>

#include "fmt/format.h"

namespace bragg::pack {

nlohmann::json PlanToJson(const Plan& plan, bool include_ranks) {
  const PlanSummary& s = plan.summary;
  nlohmann::json out;
  out["summary"] = {
      {"method", std::string(MethodName(plan.config.method))},
      {"traces", s.traces},
      {"ranks", s.ranks},
      {"micro_batches_per_rank", s.micro_batches_per_rank},
      {"alignment", s.alignment},
      {"row_alignment", s.row_alignment},
      {"fp8_align", plan.config.fp8 ? std::string(Fp8AlignName(plan.config.fp8_align)) : "none"},
      {"real_tokens", s.real_tokens},
      {"padded_tokens", s.padded_tokens},
      {"padding_fraction", s.padding_fraction},
      {"max_rank_cost", s.max_rank_cost},
      {"mean_rank_cost", s.mean_rank_cost},
      {"max_over_mean", s.max_over_mean},
      {"lower_bound", s.lower_bound},
      {"step_max_over_mean", s.step_max_over_mean},
      {"oversized_trace_ids", s.oversized_trace_ids},
      {"plan_ms", s.plan_ms},
  };
  nlohmann::json ranks = nlohmann::json::array();
  if (include_ranks) {
    for (size_t r = 0; r < plan.ranks.size(); ++r) {
      nlohmann::json mbs = nlohmann::json::array();
      for (const MicroBatch& mb : plan.ranks[r].micro_batches) {
        nlohmann::json rows = nlohmann::json::array();
        for (const Row& row : mb.rows) {
          rows.push_back({{"trace_ids", row.trace_ids},
                          {"cu_seqlens", row.cu_seqlens},
                          {"cu_seqlens_padded", row.cu_seqlens_padded},
                          {"max_seqlen", row.max_seqlen},
                          {"total_tokens", row.total_tokens},
                          {"real_tokens", row.real_tokens},
                          {"loss_tokens", row.loss_tokens},
                          {"cost", row.cost}});
        }
        nlohmann::json j = {{"cost", mb.cost}, {"total_tokens", mb.total_tokens}};
        if (mb.rows.size() == 1) {
          // THD: the micro-batch is its single row; its fields are inlined.
          for (auto& [k, v] : rows[0].items()) {
            j[k] = v;
          }
        } else {
          j["rows"] = std::move(rows);
        }
        mbs.push_back(std::move(j));
      }
      ranks.push_back(
          {{"rank", r}, {"cost", plan.ranks[r].cost}, {"micro_batches", std::move(mbs)}});
    }
  }
  out["ranks"] = std::move(ranks);
  return out;
}

namespace {

template <typename Int>
Result<Int> ParseInt(std::string_view s, std::string_view what) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) {
    s.remove_prefix(1);
  }
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) {
    s.remove_suffix(1);
  }
  Int v{};
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || ptr != s.data() + s.size()) {
    return absl::InvalidArgumentError(
        fmt::format("{}: '{}' is not an integer", std::string(what), std::string(s)));
  }
  return v;
}

}  // namespace

Result<std::vector<int64_t>> ParseLengths(const std::string& text) {
  std::vector<int64_t> out;
  size_t pos = 0;
  int line_no = 0;
  while (pos <= text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) {
      end = text.size();
    }
    ++line_no;
    std::string_view line(text.data() + pos, end - pos);
    pos = end + 1;
    const size_t first = line.find_first_not_of(" \t\r");
    if (first == std::string_view::npos || line[first] == '#') {
      continue;
    }
    BRAGG_ASSIGN_OR_RETURN(int64_t v, ParseInt<int64_t>(line, fmt::format("line {}", line_no)));
    out.push_back(v);
  }
  return out;
}

Result<std::vector<int32_t>> ParseIntList(const std::string& text) {
  std::vector<int32_t> out;
  size_t pos = 0;
  int item = 0;
  while (true) {
    size_t end = text.find(',', pos);
    if (end == std::string::npos) {
      end = text.size();
    }
    BRAGG_ASSIGN_OR_RETURN(int32_t v,
                           ParseInt<int32_t>(std::string_view(text).substr(pos, end - pos),
                                             fmt::format("item {}", item)));
    out.push_back(v);
    ++item;
    if (end == text.size()) {
      break;
    }
    pos = end + 1;
  }
  return out;
}

}  // namespace bragg::pack
