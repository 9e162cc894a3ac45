#pragma once

// THD packing and cost-aware balancing of RL traces over data-parallel (DP) ranks and pipeline
// micro-batches.
//
// PlanPacking() takes traces (id, length, optional loss-token count, optional explicit cost)
// and returns, for every DP rank, the same number of micro-batches; each micro-batch is one
// packed THD row (several rows per micro-batch only for the BSHD baseline). Each trace is padded
// to the alignment A (see Alignment()) inside the row, so `cu_seqlens_padded` is what
// TransformerEngine's THD attention and CP partitioning want, and `cu_seqlens` holds the real
// lengths.
//
// The default method (kLpt) sorts traces by cost and gives each to the least-loaded
// micro-batch that still has room (longest-processing-time first), deals the micro-batches to
// ranks so that every rank runs similar cost at the same pipeline step, then refines by
// swapping traces between the most and least loaded ranks while that lowers the maximum.

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "pack/cost_model.h"

namespace bragg::pack {

struct Trace {
  int64_t id = 0;
  int64_t length = 0;  // real tokens, >= 1
  // Tokens that carry loss; < 0 means length - 1 (every next-token prediction of the trace).
  int64_t loss_tokens = -1;
  // Explicit cost; < 0 means "use the config's cost model on the padded length".
  double cost = -1;
};

enum class Method {
  kLpt,            // this library: LPT over micro-batches with capacity, then swap refinement
  kRoundRobin,     // baseline: trace i to micro-batch i mod (dp*M), arrival order
  kArrivalGreedy,  // baseline: arrival order, least-loaded micro-batch with room
  kKarmarkarKarp,  // baseline: multiway largest-differencing over ranks, then first fit
  kPaddedBshd,     // baseline: arrival order, fixed traces per micro-batch, padded to the max
};

// Where FP8's multiple of 16 applies (only with fp8).
enum class Fp8Align {
  // Every trace is padded to lcm(16, A): each trace's span is FP8-aligned on its own, which
  // FP8 attention over THD may need.
  kTrace,
  // Traces are padded to A only, and each packed row's total to RowAlignment(), so the tokens
  // every CP (and, with sequence parallel, TP) rank holds are a multiple of 16: the M dimension
  // of its FP8 GEMMs and the K of their weight gradients. What FP8 linear layers need when
  // attention runs in BF16 (TransformerEngine's default), and what NeMo-RL pads. The row's
  // extra tokens lengthen its last trace's padded span, so cu_seqlens_padded still ends at the
  // row's total and CP partitioning stays exact. Up to RowAlignment() - 1 tokens per row
  // instead of up to 15 per trace.
  kRow,
};

// Parses "trace" or "row". InvalidArgument otherwise.
Result<Fp8Align> ParseFp8Align(std::string_view name);
std::string_view Fp8AlignName(Fp8Align a);

// Parses "lpt", "round-robin", "greedy", "kk", "bshd". InvalidArgument otherwise.
Result<Method> ParseMethod(std::string_view name);
std::string_view MethodName(Method m);

struct PackConfig {
  int dp = 1;
  // Exactly one of max_tokens (capacity of one micro-batch, in padded tokens) and
  // micro_batches (per DP rank, capacity unlimited) must be > 0. With max_tokens the planner
  // uses the smallest micro-batch count per rank for which every micro-batch fits.
  int64_t max_tokens = 0;
  int micro_batches = 0;
  int cp = 1;
  int tp = 1;
  bool sequence_parallel = false;
  bool fp8 = false;
  Fp8Align fp8_align = Fp8Align::kTrace;
  CostModel cost;
  Method method = Method::kLpt;
  // kLpt only: run the swap refinement after LPT.
  bool refine = true;
};

// Per-trace padding multiple A: 2*cp*tp when cp > 1, else tp with sequence parallel, else 1; with
// FP8 aligned per trace (Fp8Align::kTrace), lcm(16, that). InvalidArgument for non-positive
// sizes.
Result<int64_t> Alignment(const PackConfig& config);

// Multiple of every packed row's total: A, or with FP8 aligned per row (Fp8Align::kRow)
// lcm(A, 16*cp*(sp ? tp : 1)), the least total whose every CP/SP rank's share is a multiple of
// 16. InvalidArgument for non-positive sizes.
Result<int64_t> RowAlignment(const PackConfig& config);

inline int64_t AlignUp(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

// One packed THD row. cu_seqlens / cu_seqlens_padded have trace_ids.size() + 1 entries starting
// at 0; trace k occupies [cu_seqlens_padded[k], cu_seqlens_padded[k] + length_k) for real tokens
// and the rest of its padded span is padding (the last trace's span also holds the row's own
// padding with Fp8Align::kRow).
struct Row {
  std::vector<int64_t> trace_ids;
  std::vector<int32_t> cu_seqlens;
  std::vector<int32_t> cu_seqlens_padded;
  int32_t max_seqlen = 0;    // largest padded length in the row (TE max_seqlen_q/kv)
  int64_t total_tokens = 0;  // padded tokens = cu_seqlens_padded.back() (BSHD: rows * max len)
  int64_t real_tokens = 0;
  int64_t loss_tokens = 0;
  double cost = 0;
};

struct MicroBatch {
  std::vector<Row> rows;  // exactly one for THD methods
  double cost = 0;
  int64_t total_tokens = 0;
};

struct RankPlan {
  std::vector<MicroBatch> micro_batches;
  double cost = 0;
};

struct PlanSummary {
  int64_t traces = 0;
  int ranks = 0;
  int micro_batches_per_rank = 0;
  int64_t alignment = 1;      // per trace (Alignment())
  int64_t row_alignment = 1;  // per packed row (RowAlignment())
  int64_t real_tokens = 0;
  int64_t padded_tokens = 0;
  double padding_fraction = 0;  // (padded - real) / padded
  double max_rank_cost = 0;
  double mean_rank_cost = 0;
  double max_over_mean = 1;  // max rank cost / mean rank cost (1 when all costs are 0)
  double lower_bound = 1;    // max(1, largest trace cost / mean rank cost)
  // Largest over pipeline steps of (max / mean micro-batch cost across ranks at that step).
  double step_max_over_mean = 1;
  // Traces whose own cost exceeds the mean rank cost: nothing can balance them; a larger CP
  // size would split them.
  std::vector<int64_t> oversized_trace_ids;
  double plan_ms = 0;
};

struct Plan {
  PackConfig config;
  std::vector<RankPlan> ranks;
  PlanSummary summary;
};

// Plans `traces` under `config`. Pure function of its inputs; thread-safe; the result owns all
// its data. Errors (InvalidArgument, with what to change): bad sizes, no traces, non-positive
// lengths, duplicate-free ids not required; a padded trace longer than max_tokens; padded
// offsets that would overflow int32 in one row.
Result<Plan> PlanPacking(std::span<const Trace> traces, const PackConfig& config);

// Position ids of a THD row: 0, 1, ... restarting at every trace, over the padded layout
// (padding continues the count of its trace). Size = row.total_tokens.
std::vector<int32_t> PositionIds(const Row& row);

// Per token of the padded row: index of its trace in the row, or -1 for padding.
std::vector<int32_t> SegmentIds(const Row& row);

}  // namespace bragg::pack
