#include "pack/plan.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pack/plan_json.h"
#include "pack/zigzag.h"

namespace bragg::pack {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<Trace> Traces(const std::vector<int64_t>& lengths) {
  std::vector<Trace> t;
  for (size_t i = 0; i < lengths.size(); ++i) {
    t.push_back({.id = static_cast<int64_t>(i) + 100, .length = lengths[i]});
  }
  return t;
}

TEST(AlignmentTest, FollowsTheIssueRules) {
  PackConfig c;
  EXPECT_EQ(*Alignment(c), 1);
  c.tp = 4;
  EXPECT_EQ(*Alignment(c), 1);
  c.sequence_parallel = true;
  EXPECT_EQ(*Alignment(c), 4);
  c.cp = 2;
  EXPECT_EQ(*Alignment(c), 16);
  c.cp = 3;
  c.tp = 1;
  EXPECT_EQ(*Alignment(c), 6);
  c.fp8 = true;
  EXPECT_EQ(*Alignment(c), 48);
  c.cp = 1;
  c.sequence_parallel = false;
  EXPECT_EQ(*Alignment(c), 16);
  c.cp = 0;
  EXPECT_FALSE(Alignment(c).ok());
}

TEST(AlignmentTest, Fp8PerRowAlignsTracesToAAndRowsToEveryRanksShare) {
  PackConfig c{.fp8 = true, .fp8_align = Fp8Align::kRow};
  EXPECT_EQ(*Alignment(c), 1);
  EXPECT_EQ(*RowAlignment(c), 16);
  c.cp = 2;  // A = 4; each CP rank holds total / 2 tokens
  EXPECT_EQ(*Alignment(c), 4);
  EXPECT_EQ(*RowAlignment(c), 32);
  c.tp = 4;  // A = 16 without sequence parallel: the TP ranks hold the same tokens
  EXPECT_EQ(*Alignment(c), 16);
  EXPECT_EQ(*RowAlignment(c), 32);
  c.sequence_parallel = true;  // ...and with it, total / (cp * tp) each
  EXPECT_EQ(*RowAlignment(c), 128);
  c.cp = 3;
  c.tp = 1;
  EXPECT_EQ(*Alignment(c), 6);
  EXPECT_EQ(*RowAlignment(c), 48);
  c.fp8 = false;  // without FP8 the row needs nothing beyond A
  EXPECT_EQ(*RowAlignment(c), 6);
  c.fp8 = true;
  c.fp8_align = Fp8Align::kTrace;
  EXPECT_EQ(*Alignment(c), 48);
  EXPECT_EQ(*RowAlignment(c), 48);
  EXPECT_EQ(*ParseFp8Align("row"), Fp8Align::kRow);
  EXPECT_EQ(*ParseFp8Align("trace"), Fp8Align::kTrace);
  EXPECT_THAT(std::string(ParseFp8Align("rows").status().message()), HasSubstr("trace or row"));
}

TEST(PlanTest, Fp8PerRowPadsTheRowOnceAtItsLastTrace) {
  PackConfig c{.dp = 1,
               .micro_batches = 1,
               .fp8 = true,
               .fp8_align = Fp8Align::kRow,
               .cost = {.a = 1, .b = 0}};
  auto plan = PlanPacking(Traces({3, 5, 7}), c);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const Row& row = plan->ranks[0].micro_batches[0].rows[0];
  // 15 real tokens, one row padded to 16; per trace (the default) it would be 48.
  EXPECT_THAT(row.cu_seqlens, ElementsAre(0, 3, 8, 15));
  EXPECT_EQ(row.cu_seqlens_padded.back(), 16);
  EXPECT_EQ(row.total_tokens, 16);
  EXPECT_EQ(row.max_seqlen, 8);  // the last trace's span, 7 + 1, is the longest
  EXPECT_EQ(row.cost, 16);       // padding is computed too
  EXPECT_NEAR(plan->summary.padding_fraction, 1.0 / 16.0, 1e-12);
  EXPECT_EQ(plan->summary.alignment, 1);
  EXPECT_EQ(plan->summary.row_alignment, 16);
  std::vector<int32_t> seg = SegmentIds(row);
  EXPECT_EQ(seg[14], 2);
  EXPECT_EQ(seg[15], -1);
  EXPECT_EQ(PositionIds(row)[15], 7);  // padding continues its trace's count

  c.fp8_align = Fp8Align::kTrace;
  auto per_trace = PlanPacking(Traces({3, 5, 7}), c);
  ASSERT_TRUE(per_trace.ok());
  EXPECT_EQ(per_trace->ranks[0].micro_batches[0].rows[0].total_tokens, 48);
}

TEST(PlanTest, Fp8PerRowKeepsRowsWithinMaxTokensAfterTheirPadding) {
  // max_tokens 40 is not a multiple of 16: rows may hold 32 tokens, so 17 + 15 (= 32) share
  // a row but 17 + 16 does not, though 33 <= 40.
  PackConfig c{.dp = 1, .max_tokens = 40, .fp8 = true, .fp8_align = Fp8Align::kRow};
  auto plan = PlanPacking(Traces({17, 16, 15}), c);
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (const MicroBatch& mb : plan->ranks[0].micro_batches) {
    EXPECT_LE(mb.total_tokens, 32);
    EXPECT_EQ(mb.total_tokens % 16, 0);
  }
  // A trace whose row cannot fit at all is refused, naming the row multiple.
  auto too_long = PlanPacking(Traces({33}), c);
  ASSERT_FALSE(too_long.ok());
  EXPECT_THAT(std::string(too_long.status().message()), HasSubstr("multiple of 16"));
  // CP: the row is a multiple of 2*cp*16 / 2 = 32, and the zigzag split stays exact.
  PackConfig cpc{.dp = 1, .micro_batches = 1, .cp = 2, .fp8 = true, .fp8_align = Fp8Align::kRow};
  auto cp_plan = PlanPacking(Traces({5, 9}), cpc);
  ASSERT_TRUE(cp_plan.ok()) << cp_plan.status();
  const Row& row = cp_plan->ranks[0].micro_batches[0].rows[0];
  EXPECT_THAT(row.cu_seqlens_padded, ElementsAre(0, 8, 32));
  for (int r = 0; r < 2; ++r) {
    auto idx = CpIndices(row.cu_seqlens_padded, 2, r);
    ASSERT_TRUE(idx.ok()) << idx.status();
    EXPECT_EQ(idx->size(), 16u);
  }
}

TEST(PlanTest, SmallPlanHasExactLayout) {
  PackConfig c{.dp = 1, .micro_batches = 1, .cp = 2};
  auto plan = PlanPacking(Traces({3, 5}), c);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->ranks.size(), 1u);
  const Row& row = plan->ranks[0].micro_batches[0].rows[0];
  EXPECT_THAT(row.trace_ids, ElementsAre(100, 101));
  EXPECT_THAT(row.cu_seqlens, ElementsAre(0, 3, 8));
  EXPECT_THAT(row.cu_seqlens_padded, ElementsAre(0, 4, 12));
  EXPECT_EQ(row.max_seqlen, 8);
  EXPECT_EQ(row.total_tokens, 12);
  EXPECT_EQ(row.loss_tokens, 2 + 4);
  EXPECT_THAT(PositionIds(row), ElementsAre(0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7));
  EXPECT_THAT(SegmentIds(row), ElementsAre(0, 0, 0, -1, 1, 1, 1, 1, 1, -1, -1, -1));
  EXPECT_NEAR(plan->summary.padding_fraction, 4.0 / 12.0, 1e-12);
}

TEST(PlanTest, BalancesAndReportsLowerBound) {
  std::mt19937 rng(1);
  std::lognormal_distribution<double> len(std::log(2000.0), 1.0);
  std::vector<int64_t> lengths;
  for (int i = 0; i < 5000; ++i) {
    lengths.push_back(std::clamp<int64_t>(static_cast<int64_t>(len(rng)), 64, 65536));
  }
  PackConfig c{.dp = 16, .max_tokens = 65536, .fp8 = true, .cost = {.a = 1, .b = 1.0 / 4096}};
  auto plan = PlanPacking(Traces(lengths), c);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const PlanSummary& s = plan->summary;
  EXPECT_LE(s.max_over_mean, s.lower_bound * 1.005);
  EXPECT_LT(s.padding_fraction, 0.005);
  for (const RankPlan& r : plan->ranks) {
    EXPECT_EQ(static_cast<int>(r.micro_batches.size()), s.micro_batches_per_rank);
    // Costlier micro-batches first so that pipeline step j is alike on every rank.
    for (size_t j = 1; j < r.micro_batches.size(); ++j) {
      EXPECT_GE(r.micro_batches[j - 1].cost, r.micro_batches[j].cost);
    }
  }
}

// The issue's heavy-tailed mix: 98% lognormal (median 2048), 2% uniform in 20K..60K tokens.
std::vector<int64_t> HeavyTail(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> body(std::log(2048.0), 1.0);
  std::uniform_int_distribution<int64_t> tail(20000, 60000);
  std::vector<int64_t> lengths(n);
  for (size_t i = 0; i < n; ++i) {
    lengths[i] =
        i < n / 50 ? tail(rng) : std::clamp<int64_t>(static_cast<int64_t>(body(rng)), 64, 19999);
  }
  std::shuffle(lengths.begin(), lengths.end(), rng);
  return lengths;
}

// Checks a plan of Traces(lengths) against the balance target and recomputes what the summary
// says from the rows: every trace once, rows within max_tokens, rank costs, max/mean.
void ExpectBalancedAndConsistent(const std::vector<int64_t>& lengths, const Plan& plan) {
  const PlanSummary& s = plan.summary;
  EXPECT_LE(s.max_over_mean, s.lower_bound * 1.005);
  std::vector<int> placed(lengths.size(), 0);
  double max_cost = 0, sum_cost = 0;
  for (const RankPlan& r : plan.ranks) {
    double rank_cost = 0;
    ASSERT_EQ(static_cast<int>(r.micro_batches.size()), s.micro_batches_per_rank);
    for (const MicroBatch& mb : r.micro_batches) {
      ASSERT_EQ(mb.rows.size(), 1u);
      const Row& row = mb.rows[0];
      EXPECT_LE(row.total_tokens, plan.config.max_tokens);
      for (size_t k = 0; k < row.trace_ids.size(); ++k) {
        const size_t i = static_cast<size_t>(row.trace_ids[k] - 100);
        ASSERT_LT(i, lengths.size());
        ++placed[i];
        EXPECT_EQ(row.cu_seqlens[k + 1] - row.cu_seqlens[k], lengths[i]);
      }
      rank_cost += row.cost;
    }
    max_cost = std::max(max_cost, rank_cost);
    sum_cost += rank_cost;
  }
  EXPECT_EQ(std::count(placed.begin(), placed.end(), 1), static_cast<long>(lengths.size()));
  EXPECT_NEAR(s.max_over_mean, max_cost / (sum_cost / plan.config.dp), 1e-9);
}

// The issue's mix at the issue's size, 100,000 traces into 512 ranks, both FP8 alignments: the
// ranks within 0.5% of the lower bound (a planner made faster by balancing worse fails here).
TEST(PlanTest, BalancesTheHeavyTailedMix) {
  const std::vector<int64_t> lengths = HeavyTail(100000, 5);
  for (Fp8Align align : {Fp8Align::kTrace, Fp8Align::kRow}) {
    PackConfig c{.dp = 512,
                 .max_tokens = 131072,
                 .fp8 = true,
                 .fp8_align = align,
                 .cost = *CostModel::FromModelSize(4096, 32)};
    auto plan = PlanPacking(Traces(lengths), c);
    ASSERT_TRUE(plan.ok()) << plan.status();
    SCOPED_TRACE(std::string(Fp8AlignName(align)));
    ExpectBalancedAndConsistent(lengths, *plan);
  }
}

// Few traces per rank of a heavy (Pareto, alpha 1.5) tail, where LPT alone is not within the
// refinement's margin of the bound: the swap refinement must close the gap (4096 traces into 64
// ranks, as in bench/pack: 1.0046 x LB with LPT alone, 1.0015 refined).
TEST(PlanTest, RefinementClosesWhatLptLeavesOnAHeavyTail) {
  std::mt19937_64 rng(4);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<int64_t> lengths(4096);
  for (int64_t& x : lengths) {
    x = std::clamp<int64_t>(static_cast<int64_t>(1024.0 / std::pow(1.0 - u(rng), 1.0 / 1.5)), 64,
                            65536);
  }
  PackConfig c{.dp = 64,
               .max_tokens = 131072,
               .fp8 = true,
               .cost = *CostModel::FromModelSize(4096, 32),
               .refine = false};
  auto lpt_only = PlanPacking(Traces(lengths), c);
  c.refine = true;
  auto refined = PlanPacking(Traces(lengths), c);
  ASSERT_TRUE(lpt_only.ok() && refined.ok());
  const double lb = refined->summary.lower_bound;
  EXPECT_GT(lpt_only->summary.max_over_mean, lb * 1.002)
      << "LPT alone already balances this set: the test no longer exercises refinement";
  EXPECT_LT(refined->summary.max_over_mean, lpt_only->summary.max_over_mean);
  ExpectBalancedAndConsistent(lengths, *refined);
}

// Capacity 99.9% used at the first micro-batch count: the ranks balance at that count but
// some rank's traces then do not split into its micro-batches, so the planner must balance the
// ranks again for one more micro-batch each, not keep the assignment made under the tighter
// rank capacity (which left ranks 3% apart).
TEST(PlanTest, BalancesAgainWhenTheFirstMicroBatchCountDoesNotSplit) {
  std::mt19937 rng(11);
  std::lognormal_distribution<double> len(std::log(2048.0), 1.0);
  std::vector<int64_t> lengths;
  int64_t total = 0;
  for (int i = 0; i < 100000; ++i) {
    lengths.push_back(std::clamp<int64_t>(static_cast<int64_t>(len(rng)), 64, 65536));
    total += lengths.back();
  }
  const int dp = 512, m = 5;
  int retried = 0;
  for (double fill : {0.999, 0.9995, 0.9998, 0.9999}) {
    const int64_t cap = static_cast<int64_t>(static_cast<double>(total) / dp / m / fill);
    PackConfig c{.dp = dp, .max_tokens = cap, .cost = *CostModel::FromModelSize(4096, 32)};
    auto plan = PlanPacking(Traces(lengths), c);
    ASSERT_TRUE(plan.ok()) << plan.status();
    const PlanSummary& s = plan->summary;
    retried += s.micro_batches_per_rank == m + 1 ? 1 : 0;
    EXPECT_LE(s.max_over_mean, s.lower_bound * 1.005) << "fill " << fill;
    for (const RankPlan& r : plan->ranks) {
      for (const MicroBatch& mb : r.micro_batches) {
        EXPECT_LE(mb.total_tokens, cap);
      }
    }
  }
  EXPECT_GT(retried, 0) << "no case needed a second micro-batch count: tighten the fills";
}

TEST(PlanTest, FlagsTracesCostlierThanARank) {
  PackConfig c{.dp = 4, .micro_batches = 1, .cost = {.a = 0, .b = 1}};
  auto plan = PlanPacking(Traces({1000, 10, 10, 10, 10, 10}), c);
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(plan->summary.oversized_trace_ids, ElementsAre(100));
  EXPECT_GT(plan->summary.lower_bound, 3.9);
  EXPECT_NEAR(plan->summary.max_over_mean, plan->summary.lower_bound, 1e-9);
}

TEST(PlanTest, ExplicitCostsOverrideTheModel) {
  std::vector<Trace> t = Traces({10, 10, 10, 10});
  t[0].cost = 30;  // as costly as the other three together
  t[1].cost = t[2].cost = t[3].cost = 10;
  auto plan = PlanPacking(t, {.dp = 2, .micro_batches = 1});
  ASSERT_TRUE(plan.ok());
  EXPECT_DOUBLE_EQ(plan->summary.max_over_mean, 1.0);
  for (const RankPlan& r : plan->ranks) {
    EXPECT_DOUBLE_EQ(r.cost, 30);
  }
}

TEST(PlanTest, MoreTracesThanSlotsLeavesEmptyMicroBatchesAlike) {
  auto plan = PlanPacking(Traces({5}), {.dp = 3, .micro_batches = 2});
  ASSERT_TRUE(plan.ok());
  int nonempty = 0;
  for (const RankPlan& r : plan->ranks) {
    ASSERT_EQ(r.micro_batches.size(), 2u);
    for (const MicroBatch& mb : r.micro_batches) {
      nonempty += mb.rows[0].trace_ids.empty() ? 0 : 1;
      EXPECT_EQ(mb.rows[0].cu_seqlens.front(), 0);
    }
  }
  EXPECT_EQ(nonempty, 1);
}

TEST(PlanTest, RejectsBadInputWithActionableErrors) {
  EXPECT_FALSE(PlanPacking(Traces({}), {.dp = 1, .micro_batches = 1}).ok());
  EXPECT_FALSE(PlanPacking(Traces({0}), {.dp = 1, .micro_batches = 1}).ok());
  EXPECT_FALSE(PlanPacking(Traces({-5}), {.dp = 1, .micro_batches = 1}).ok());
  EXPECT_FALSE(PlanPacking(Traces({5}), {.dp = 0, .micro_batches = 1}).ok());
  EXPECT_FALSE(PlanPacking(Traces({5}), {.dp = 1}).ok());
  EXPECT_FALSE(PlanPacking(Traces({5}), {.dp = 1, .max_tokens = 8, .micro_batches = 1}).ok());
  EXPECT_FALSE(
      PlanPacking(Traces({5}), {.dp = 1, .micro_batches = 1, .cost = {.a = 0, .b = 0}}).ok());
  EXPECT_FALSE(
      PlanPacking(Traces({5}), {.dp = 1, .micro_batches = 1, .cost = {.a = -1, .b = 0}}).ok());
  std::vector<Trace> nan = Traces({5});
  nan[0].cost = std::nan("");
  EXPECT_FALSE(PlanPacking(nan, {.dp = 1, .micro_batches = 1}).ok());
  std::vector<Trace> loss = Traces({5});
  loss[0].loss_tokens = 6;
  EXPECT_FALSE(PlanPacking(loss, {.dp = 1, .micro_batches = 1}).ok());
  auto too_long = PlanPacking(Traces({100}), {.dp = 1, .max_tokens = 64, .cp = 2});
  ASSERT_FALSE(too_long.ok());
  EXPECT_THAT(std::string(too_long.status().message()), HasSubstr("raise max_tokens"));
  // One row over int32 offsets.
  auto huge = PlanPacking(Traces({2000000000, 2000000000}), {.dp = 1, .micro_batches = 1});
  ASSERT_FALSE(huge.ok());
  EXPECT_THAT(std::string(huge.status().message()), HasSubstr("int32"));
}

TEST(PlanTest, EveryMethodPlacesEveryTraceOnce) {
  std::vector<int64_t> lengths;
  for (int i = 1; i <= 300; ++i) {
    lengths.push_back((i * 7919) % 997 + 1);
  }
  for (Method m : {Method::kLpt, Method::kRoundRobin, Method::kArrivalGreedy,
                   Method::kKarmarkarKarp, Method::kPaddedBshd}) {
    auto plan = PlanPacking(Traces(lengths), {.dp = 4, .max_tokens = 4096, .method = m});
    ASSERT_TRUE(plan.ok()) << MethodName(m) << ": " << plan.status();
    std::multiset<int64_t> seen;
    for (const RankPlan& r : plan->ranks) {
      EXPECT_EQ(static_cast<int>(r.micro_batches.size()), plan->summary.micro_batches_per_rank);
      for (const MicroBatch& mb : r.micro_batches) {
        for (const Row& row : mb.rows) {
          seen.insert(row.trace_ids.begin(), row.trace_ids.end());
        }
        if (m != Method::kPaddedBshd) {
          EXPECT_LE(mb.total_tokens, 4096) << MethodName(m);
        }
      }
    }
    EXPECT_EQ(seen.size(), lengths.size()) << MethodName(m);
    EXPECT_EQ(std::set<int64_t>(seen.begin(), seen.end()).size(), lengths.size());
    if (m == Method::kPaddedBshd) {
      EXPECT_GT(plan->summary.padding_fraction, 0.2);
    } else {
      EXPECT_EQ(plan->summary.padding_fraction, 0.0);
    }
  }
}

TEST(PlanJsonTest, HasTheContractKeys) {
  auto plan = PlanPacking(Traces({3, 5, 9}), {.dp = 2, .micro_batches = 1, .cp = 2});
  ASSERT_TRUE(plan.ok());
  auto j = PlanToJson(*plan);
  for (const char* k : {"traces", "ranks", "micro_batches_per_rank", "max_over_mean", "lower_bound",
                        "padding_fraction", "plan_ms"}) {
    EXPECT_TRUE(j["summary"].contains(k)) << k;
  }
  ASSERT_EQ(j["ranks"].size(), 2u);
  const auto& mb = j["ranks"][0]["micro_batches"][0];
  EXPECT_TRUE(mb.contains("trace_ids"));
  EXPECT_TRUE(mb.contains("cu_seqlens"));
  EXPECT_TRUE(mb.contains("cu_seqlens_padded"));
}

TEST(ParseTest, LengthsAndLists) {
  auto l = ParseLengths("5\n 7 \n\n# comment\n9\r\n");
  ASSERT_TRUE(l.ok());
  EXPECT_THAT(*l, ElementsAre(5, 7, 9));
  auto bad = ParseLengths("5\nseven\n");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("line 2"));
  EXPECT_FALSE(ParseLengths("5x\n").ok());
  auto list = ParseIntList("0,8,20");
  ASSERT_TRUE(list.ok());
  EXPECT_THAT(*list, ElementsAre(0, 8, 20));
  EXPECT_FALSE(ParseIntList("0,,8").ok());
  EXPECT_FALSE(ParseIntList("").ok());
  EXPECT_FALSE(ParseIntList("0,99999999999").ok());
}

}  // namespace
}  // namespace bragg::pack
