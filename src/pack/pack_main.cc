// bragg-pack: plan THD packing from a file of trace lengths, or print zigzag CP indices.
//
//   bragg-pack plan --lengths FILE --dp N (--max-tokens T | --micro-batches M) [--cp C] [--tp P]
//                   [--sp] [--fp8 [--fp8-align trace|row]]
//                   [--cost-a A --cost-b B | --hidden H --layers L]
//                   [--method lpt|round-robin|greedy|kk|bshd] [--json]
//   bragg-pack cp-indices --cu-seqlens-padded 0,8,20 --cp C --rank R

#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "common/fs.h"
#include "fmt/format.h"
#include "pack/plan.h"
#include "pack/plan_json.h"
#include "pack/zigzag.h"

namespace {

using bragg::Result;
using bragg::Status;
namespace pack = bragg::pack;

struct PlanFlags {
  std::string lengths;
  int dp = 0;
  int64_t max_tokens = 0;
  int micro_batches = 0;
  int cp = 1;
  int tp = 1;
  bool sp = false;
  bool fp8 = false;
  std::string fp8_align = "trace";
  double cost_a = -1;
  double cost_b = -1;
  int64_t hidden = 0;
  int64_t layers = 0;
  std::string method = "lpt";
  bool json = false;
};

struct CpFlags {
  std::string cu;
  int cp = 1;
  int rank = 0;
};

Result<pack::PackConfig> MakeConfig(const PlanFlags& f) {
  pack::PackConfig c;
  c.dp = f.dp;
  c.max_tokens = f.max_tokens;
  c.micro_batches = f.micro_batches;
  c.cp = f.cp;
  c.tp = f.tp;
  c.sequence_parallel = f.sp;
  c.fp8 = f.fp8;
  BRAGG_ASSIGN_OR_RETURN(c.fp8_align, pack::ParseFp8Align(f.fp8_align));
  if (!f.fp8 && c.fp8_align != pack::Fp8Align::kTrace) {
    return absl::InvalidArgumentError("--fp8-align row needs --fp8");
  }
  BRAGG_ASSIGN_OR_RETURN(c.method, pack::ParseMethod(f.method));
  if (f.hidden > 0 || f.layers > 0) {
    if (f.cost_a >= 0 || f.cost_b >= 0) {
      return absl::InvalidArgumentError("give either --cost-a/--cost-b or --hidden/--layers");
    }
    BRAGG_ASSIGN_OR_RETURN(c.cost, pack::CostModel::FromModelSize(f.hidden, f.layers));
  } else if (f.cost_a >= 0 || f.cost_b >= 0) {
    c.cost = {.a = std::max(0.0, f.cost_a), .b = std::max(0.0, f.cost_b)};
  }
  return c;
}

Status RunPlan(const PlanFlags& f) {
  BRAGG_ASSIGN_OR_RETURN(pack::PackConfig config, MakeConfig(f));
  BRAGG_ASSIGN_OR_RETURN(std::string text, bragg::ReadFileToString(f.lengths));
  BRAGG_ASSIGN_OR_RETURN(std::vector<int64_t> lengths, pack::ParseLengths(text));
  std::vector<pack::Trace> traces(lengths.size());
  for (size_t i = 0; i < lengths.size(); ++i) {
    traces[i] = {.id = static_cast<int64_t>(i), .length = lengths[i]};
  }
  BRAGG_ASSIGN_OR_RETURN(pack::Plan plan, pack::PlanPacking(traces, config));
  if (f.json) {
    std::cout << pack::PlanToJson(plan).dump() << "\n";
    return absl::OkStatus();
  }
  const pack::PlanSummary& s = plan.summary;
  std::cout << fmt::format(
      "traces {}  ranks {}  micro-batches/rank {}  alignment {} (rows {})\n"
      "max/mean {:.4f}  lower bound {:.4f}  step max/mean {:.4f}\n"
      "padding {:.4f}%  ({} real, {} padded tokens)  plan {:.2f} ms\n",
      s.traces, s.ranks, s.micro_batches_per_rank, s.alignment, s.row_alignment, s.max_over_mean,
      s.lower_bound, s.step_max_over_mean, 100 * s.padding_fraction, s.real_tokens, s.padded_tokens,
      s.plan_ms);
  if (!s.oversized_trace_ids.empty()) {
    std::cout << fmt::format(
        "{} trace(s) cost more than a rank's mean on their own; consider a larger --cp\n",
        s.oversized_trace_ids.size());
  }
  return absl::OkStatus();
}

Status RunCpIndices(const CpFlags& f) {
  BRAGG_ASSIGN_OR_RETURN(std::vector<int32_t> cu, pack::ParseIntList(f.cu));
  BRAGG_ASSIGN_OR_RETURN(std::vector<int32_t> idx, pack::CpIndices(cu, f.cp, f.rank));
  std::string out;
  for (size_t i = 0; i < idx.size(); ++i) {
    if (i > 0) {
      out += ',';
    }
    out += std::to_string(idx[i]);
  }
  std::cout << out << "\n";
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bragg-pack: THD packing, cost-aware balancing, zigzag CP partitioning"};
  app.require_subcommand(1);

  PlanFlags pf;
  CLI::App* plan = app.add_subcommand("plan", "plan packing of traces over DP ranks");
  plan->add_option("--lengths", pf.lengths, "file with one trace length per line")->required();
  plan->add_option("--dp", pf.dp, "data-parallel size")->required();
  auto* mt = plan->add_option("--max-tokens", pf.max_tokens, "padded tokens per micro-batch");
  auto* mb = plan->add_option("--micro-batches", pf.micro_batches, "micro-batches per rank");
  mt->excludes(mb);
  plan->add_option("--cp", pf.cp, "context-parallel size");
  plan->add_option("--tp", pf.tp, "tensor-parallel size");
  plan->add_flag("--sp", pf.sp, "sequence parallel");
  plan->add_flag("--fp8", pf.fp8, "FP8: align to a multiple of 16 (see --fp8-align)");
  plan->add_option("--fp8-align", pf.fp8_align,
                   "with --fp8: 'trace' pads every trace to lcm(16, A) (default); 'row' pads "
                   "traces to A and each packed row so every CP/SP rank holds a multiple of 16");
  plan->add_option("--cost-a", pf.cost_a, "cost per token (cost = a*s + b*s^2)");
  plan->add_option("--cost-b", pf.cost_b, "cost per token^2");
  plan->add_option("--hidden", pf.hidden, "derive the cost model from hidden size...");
  plan->add_option("--layers", pf.layers, "...and layer count");
  plan->add_option("--method", pf.method, "lpt (default), round-robin, greedy, kk, bshd");
  plan->add_flag("--json", pf.json, "print the plan as one JSON object");

  CpFlags cf;
  CLI::App* cpi = app.add_subcommand("cp-indices", "token indices of one zigzag CP rank");
  cpi->add_option("--cu-seqlens-padded", cf.cu, "comma-separated, e.g. 0,8,20")->required();
  cpi->add_option("--cp", cf.cp, "context-parallel size")->required();
  cpi->add_option("--rank", cf.rank, "CP rank")->required();

  CLI11_PARSE(app, argc, argv);

  Status status = plan->parsed() ? RunPlan(pf) : RunCpIndices(cf);
  if (!status.ok()) {
    std::cerr << "bragg-pack: " << status.message() << "\n";
    return 1;
  }
  return 0;
}
