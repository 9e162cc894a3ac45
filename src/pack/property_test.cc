// Property tests over random plans: 100,000 cases with 1-token traces, odd lengths, cp up to
// 16, tp up to 8, FP8 on and off (aligned per trace or per row). Sizes are kept small so the whole
// run takes seconds.

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "fmt/format.h"
#include "gtest/gtest.h"
#include "pack/plan.h"
#include "pack/zigzag.h"

namespace bragg::pack {
namespace {

constexpr int kCases = 100000;

struct Case {
  std::vector<Trace> traces;
  PackConfig config;
};

Case RandomCase(std::mt19937_64& rng) {
  auto uni = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  Case c;
  const int n = static_cast<int>(uni(1, 8));
  for (int i = 0; i < n; ++i) {
    int64_t len = 0;
    switch (uni(0, 3)) {
      case 0:
        len = 1;
        break;
      case 1:
        len = 2 * uni(0, 40) + 1;  // odd
        break;
      default:
        len = uni(1, 200);
    }
    Trace t{.id = i, .length = len};
    if (uni(0, 9) == 0) {
      t.loss_tokens = uni(0, len);
    }
    c.traces.push_back(t);
  }
  PackConfig& k = c.config;
  k.dp = static_cast<int>(uni(1, 4));
  k.cp = static_cast<int>(uni(0, 3) == 0 ? 1 : uni(1, 16));
  k.tp = static_cast<int>(uni(1, 8));
  k.sequence_parallel = uni(0, 1) == 1;
  k.fp8 = uni(0, 1) == 1;
  k.fp8_align = uni(0, 1) == 1 ? Fp8Align::kRow : Fp8Align::kTrace;
  k.cost = {.a = 1, .b = static_cast<double>(uni(0, 4)) / 64};
  const int64_t align = *Alignment(k);
  const int64_t row_align = *RowAlignment(k);
  int64_t longest = 0;
  for (const Trace& t : c.traces) {
    longest = std::max(longest, AlignUp(AlignUp(t.length, align), row_align));
  }
  if (uni(0, 1) == 0) {
    k.micro_batches = static_cast<int>(uni(1, 3));
  } else {
    // Not always a multiple of the row alignment: rows must still fit after their padding.
    k.max_tokens = longest * uni(1, 3) + align * uni(0, 2) + uni(0, 1) * uni(0, row_align - 1);
  }
  return c;
}

// Runs every property on one case; returns "" or a description of the first failure.
std::string Check(const Case& c) {
  const PackConfig& k = c.config;
  auto plan_or = PlanPacking(c.traces, k);
  if (!plan_or.ok()) {
    return "plan failed: " + std::string(plan_or.status().message());
  }
  const Plan& plan = *plan_or;
  const int64_t align = *Alignment(k);
  const int64_t row_align = *RowAlignment(k);
  if (k.fp8 && (k.fp8_align == Fp8Align::kTrace ? align % 16 != 0 : row_align % 16 != 0)) {
    return "FP8 alignment is not a multiple of 16";
  }
  // Every CP rank (and, with sequence parallel, TP rank) of an FP8 row holds a multiple of 16.
  const int64_t share = static_cast<int64_t>(k.cp) * (k.sequence_parallel ? k.tp : 1);
  const int cp = k.cp;
  std::vector<int> placed(c.traces.size(), 0);
  if (static_cast<int>(plan.ranks.size()) != k.dp) {
    return "wrong rank count";
  }
  for (const RankPlan& rank : plan.ranks) {
    if (static_cast<int>(rank.micro_batches.size()) != plan.summary.micro_batches_per_rank) {
      return "unequal micro-batch counts";
    }
    if (k.micro_batches > 0 && plan.summary.micro_batches_per_rank != k.micro_batches) {
      return "micro-batch count differs from the config";
    }
    for (const MicroBatch& mb : rank.micro_batches) {
      if (mb.rows.size() != 1) {
        return "THD micro-batch with more than one row";
      }
      const Row& row = mb.rows[0];
      if (k.max_tokens > 0 && row.total_tokens > k.max_tokens) {
        return "capacity exceeded";
      }
      const size_t nt = row.trace_ids.size();
      if (row.cu_seqlens.size() != nt + 1 || row.cu_seqlens_padded.size() != nt + 1 ||
          row.cu_seqlens[0] != 0 || row.cu_seqlens_padded[0] != 0 ||
          row.cu_seqlens_padded[nt] != row.total_tokens) {
        return "malformed cu_seqlens";
      }
      // Independent reference layout from the trace lengths alone.
      std::vector<int64_t> ref_off;
      int64_t off = 0;
      for (size_t j = 0; j < nt; ++j) {
        const int64_t id = row.trace_ids[j];
        if (id < 0 || id >= static_cast<int64_t>(c.traces.size())) {
          return "unknown trace id";
        }
        ++placed[static_cast<size_t>(id)];
        const int64_t len = c.traces[static_cast<size_t>(id)].length;
        const int64_t real = row.cu_seqlens[j + 1] - row.cu_seqlens[j];
        const int64_t padded = row.cu_seqlens_padded[j + 1] - row.cu_seqlens_padded[j];
        // Only the last trace's span also holds the row's padding (less than row_align).
        const int64_t slack = j + 1 == nt ? row_align : align;
        if (real != len || padded % align != 0 || padded < len || padded - len >= slack) {
          return fmt::format("alignment broken: len {} padded {} align {} row {}", len, padded,
                             align, row_align);
        }
        ref_off.push_back(off);
        off += AlignUp(len, align);
      }
      const int64_t total = row.total_tokens;
      if (total != AlignUp(off, row_align)) {
        return fmt::format("row of {} tokens, expected {} padded to {}", total, off, row_align);
      }
      if (total % cp != 0) {
        return "row not divisible by cp";
      }
      if (k.fp8 && k.fp8_align == Fp8Align::kRow && total % (16 * share) != 0) {
        return fmt::format("an FP8 rank holds {} tokens, not a multiple of 16", total / share);
      }
      const std::vector<int32_t> seg = SegmentIds(row);
      const std::vector<int32_t> pos = PositionIds(row);
      // Per-token payload [T, inner] for the round trip.
      const size_t inner = 1 + static_cast<size_t>(total % 3);
      std::vector<int64_t> payload(static_cast<size_t>(total) * inner);
      std::iota(payload.begin(), payload.end(), 1000);
      std::vector<int64_t> restored(payload.size(), -1);
      std::vector<int> owner(static_cast<size_t>(total), -1);
      std::vector<double> work(static_cast<size_t>(cp), 0);
      for (int r = 0; r < cp; ++r) {
        auto idx = CpIndices(row.cu_seqlens_padded, cp, r);
        if (!idx.ok()) {
          return "cp indices failed: " + std::string(idx.status().message());
        }
        if (static_cast<int64_t>(idx->size()) * cp != total) {
          return "CP ranks hold different token counts";
        }
        for (int32_t t : *idx) {
          if (t < 0 || t >= total || owner[static_cast<size_t>(t)] != -1) {
            return "CP indices are not a permutation";
          }
          owner[static_cast<size_t>(t)] = r;
          // Exact causal work of query t: it attends to pos[t] + 1 keys of its trace.
          work[static_cast<size_t>(r)] += pos[static_cast<size_t>(t)] + 1;
        }
        auto part = GatherTokens<int64_t>(payload, inner, *idx);
        if (!part.ok() ||
            !ScatterTokens<int64_t>(*part, inner, *idx, std::span<int64_t>(restored)).ok()) {
          return "gather/scatter failed";
        }
        // Segment ids of this rank's queries against the dense reference mask.
        if (total <= 96) {
          for (int32_t q : *idx) {
            for (int64_t key = 0; key < total; ++key) {
              bool ref = false;
              for (size_t j = 0; j < nt; ++j) {
                const int64_t len = c.traces[static_cast<size_t>(row.trace_ids[j])].length;
                if (ref_off[j] <= key && key <= q && q < ref_off[j] + len) {
                  ref = true;
                }
              }
              const bool got = seg[static_cast<size_t>(q)] >= 0 &&
                               seg[static_cast<size_t>(q)] == seg[static_cast<size_t>(key)] &&
                               pos[static_cast<size_t>(key)] <= pos[static_cast<size_t>(q)];
              if (ref != got) {
                return fmt::format("mask mismatch q={} k={}", q, key);
              }
            }
          }
        }
      }
      if (restored != payload) {
        return "round trip did not restore the input";
      }
      if (total > 0) {
        const double mean = std::accumulate(work.begin(), work.end(), 0.0) / cp;
        for (double w : work) {
          if (std::abs(w - mean) > 0.01 * mean) {
            return fmt::format("causal work {} vs mean {}", w, mean);
          }
        }
      }
      // Padded <-> real round trip and label shift staying inside traces.
      std::vector<int32_t> real_vals(static_cast<size_t>(row.real_tokens));
      std::iota(real_vals.begin(), real_vals.end(), 1);
      auto padded = PackToPadded<int32_t>(real_vals, 1, row.cu_seqlens, row.cu_seqlens_padded, 0);
      if (!padded.ok()) {
        return "pack to padded failed";
      }
      auto back = UnpackFromPadded<int32_t>(*padded, 1, row.cu_seqlens, row.cu_seqlens_padded);
      if (!back.ok() || *back != real_vals) {
        return "padded round trip failed";
      }
      auto labels =
          ShiftWithinTraces<int32_t>(*padded, 1, row.cu_seqlens, row.cu_seqlens_padded, -1);
      if (!labels.ok()) {
        return "shift failed";
      }
      for (int64_t t = 0; t < total; ++t) {
        const int32_t l = (*labels)[static_cast<size_t>(t)];
        const int32_t s = seg[static_cast<size_t>(t)];
        const bool last_or_pad = s < 0 || t + 1 >= total || seg[static_cast<size_t>(t + 1)] != s;
        if (last_or_pad ? l != -1 : l != (*padded)[static_cast<size_t>(t + 1)]) {
          return fmt::format("label at {} crosses a trace boundary", t);
        }
      }
    }
  }
  for (int p : placed) {
    if (p != 1) {
      return "a trace was not placed exactly once";
    }
  }
  if (plan.summary.max_over_mean < 1 - 1e-9 ||
      plan.summary.lower_bound > plan.summary.max_over_mean * (1 + 1e-9)) {
    return "summary bounds inconsistent";
  }
  return "";
}

TEST(PackPropertyTest, HundredThousandRandomCases) {
  std::mt19937_64 rng(20240607);
  int failures = 0;
  int checked_cp = 0;
  for (int i = 0; i < kCases && failures < 5; ++i) {
    const Case c = RandomCase(rng);
    checked_cp += c.config.cp > 1 ? 1 : 0;
    const std::string err = Check(c);
    if (!err.empty()) {
      ++failures;
      ADD_FAILURE() << "case " << i << " (dp=" << c.config.dp << " cp=" << c.config.cp
                    << " tp=" << c.config.tp << " sp=" << c.config.sequence_parallel
                    << " fp8=" << c.config.fp8 << " fp8_align=" << Fp8AlignName(c.config.fp8_align)
                    << " traces=" << c.traces.size() << "): " << err;
    }
  }
  EXPECT_EQ(failures, 0);
  EXPECT_GT(checked_cp, kCases / 2);
}

// The checker itself must catch a broken layout: a hand-made row with a trace shifted by one
// token (the routed-expert bug) fails the dense-mask comparison.
TEST(PackPropertyTest, CheckerDetectsShiftedLayout) {
  Row row;
  row.trace_ids = {0, 1};
  row.cu_seqlens = {0, 3, 6};
  row.cu_seqlens_padded = {0, 4, 8};
  row.total_tokens = 8;
  std::vector<int32_t> seg = SegmentIds(row);
  // Contiguous (unpadded) placement would put trace 1 at offset 3, which is padding here.
  EXPECT_EQ(seg[3], -1);
  EXPECT_EQ(seg[4], 1);
}

}  // namespace
}  // namespace bragg::pack
