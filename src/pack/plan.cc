#include "pack/plan.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>

#include "fmt/format.h"
#include "pack/balance.h"

namespace bragg::pack {

Result<Method> ParseMethod(std::string_view name) {
  if (name == "lpt") {
    return Method::kLpt;
  }
  if (name == "round-robin") {
    return Method::kRoundRobin;
  }
  if (name == "greedy") {
    return Method::kArrivalGreedy;
  }
  if (name == "kk") {
    return Method::kKarmarkarKarp;
  }
  if (name == "bshd") {
    return Method::kPaddedBshd;
  }
  return absl::InvalidArgumentError(fmt::format(
      "unknown method '{}': use lpt, round-robin, greedy, kk or bshd", std::string(name)));
}

Result<Fp8Align> ParseFp8Align(std::string_view name) {
  if (name == "trace") {
    return Fp8Align::kTrace;
  }
  if (name == "row") {
    return Fp8Align::kRow;
  }
  return absl::InvalidArgumentError(
      fmt::format("unknown FP8 alignment '{}': use trace or row", std::string(name)));
}

std::string_view Fp8AlignName(Fp8Align a) { return a == Fp8Align::kRow ? "row" : "trace"; }

std::string_view MethodName(Method m) {
  switch (m) {
    case Method::kLpt:
      return "lpt";
    case Method::kRoundRobin:
      return "round-robin";
    case Method::kArrivalGreedy:
      return "greedy";
    case Method::kKarmarkarKarp:
      return "kk";
    case Method::kPaddedBshd:
      return "bshd";
  }
  return "?";
}

Result<int64_t> Alignment(const PackConfig& c) {
  if (c.cp < 1 || c.tp < 1) {
    return absl::InvalidArgumentError(
        fmt::format("cp={} tp={}: parallel sizes must be >= 1", c.cp, c.tp));
  }
  int64_t a = 1;
  if (c.cp > 1) {
    a = 2 * static_cast<int64_t>(c.cp) * c.tp;
  } else if (c.sequence_parallel) {
    a = c.tp;
  }
  if (c.fp8 && c.fp8_align == Fp8Align::kTrace) {
    a = std::lcm(a, int64_t{16});
  }
  return a;
}

Result<int64_t> RowAlignment(const PackConfig& c) {
  BRAGG_ASSIGN_OR_RETURN(const int64_t a, Alignment(c));
  if (!c.fp8 || c.fp8_align != Fp8Align::kRow) {
    return a;
  }
  // Zigzag gives each CP rank total/cp tokens of the row, and sequence parallel splits those
  // over the TP ranks.
  const int64_t split = static_cast<int64_t>(c.cp) * (c.sequence_parallel ? c.tp : 1);
  return std::lcm(a, 16 * split);
}

std::vector<int32_t> PositionIds(const Row& row) {
  std::vector<int32_t> pos(static_cast<size_t>(row.total_tokens), 0);
  for (size_t k = 0; k + 1 < row.cu_seqlens_padded.size(); ++k) {
    for (int32_t t = row.cu_seqlens_padded[k]; t < row.cu_seqlens_padded[k + 1]; ++t) {
      pos[static_cast<size_t>(t)] = t - row.cu_seqlens_padded[k];
    }
  }
  return pos;
}

std::vector<int32_t> SegmentIds(const Row& row) {
  std::vector<int32_t> seg(static_cast<size_t>(row.total_tokens), -1);
  for (size_t k = 0; k + 1 < row.cu_seqlens_padded.size(); ++k) {
    const int32_t len = row.cu_seqlens[k + 1] - row.cu_seqlens[k];
    for (int32_t t = 0; t < len; ++t) {
      seg[static_cast<size_t>(row.cu_seqlens_padded[k] + t)] = static_cast<int32_t>(k);
    }
  }
  return seg;
}

namespace {

constexpr int64_t kMaxRowTokens = std::numeric_limits<int32_t>::max();

Status ValidateConfig(const PackConfig& c) {
  if (c.dp < 1) {
    return absl::InvalidArgumentError(fmt::format("dp={}: need at least one DP rank", c.dp));
  }
  if ((c.max_tokens > 0) == (c.micro_batches > 0)) {
    return absl::InvalidArgumentError(
        "give exactly one of max_tokens (tokens per micro-batch) and micro_batches (per rank), "
        "both > 0");
  }
  if (c.max_tokens < 0 || c.micro_batches < 0) {
    return absl::InvalidArgumentError("max_tokens and micro_batches must not be negative");
  }
  if (!std::isfinite(c.cost.a) || !std::isfinite(c.cost.b) || c.cost.a < 0 || c.cost.b < 0 ||
      (c.cost.a == 0 && c.cost.b == 0)) {
    return absl::InvalidArgumentError(fmt::format(
        "cost model a={} b={}: both must be finite and >= 0, not both 0", c.cost.a, c.cost.b));
  }
  return absl::OkStatus();
}

// n padded to a multiple of `align`; a mask instead of a division when align is a power of two
// (FP8's 16, 2*cp*tp of power-of-two sizes): a division per trace was a tenth of building rows.
class Padder {
 public:
  explicit Padder(int64_t align)
      : align_(align), mask_((align & (align - 1)) == 0 ? align - 1 : -1) {}
  int64_t operator()(int64_t n) const {
    return mask_ >= 0 ? (n + mask_) & ~mask_ : AlignUp(n, align_);
  }

 private:
  int64_t align_;
  int64_t mask_;  // align - 1, or -1 when align is not a power of two
};

struct Prepared {
  std::vector<balance::Item> items;
  int64_t real_tokens = 0;
  int64_t padded_tokens = 0;
  int64_t longest_padded = 0;
  double total_cost = 0;  // summed in trace order
  double largest_cost = 0;
  bool explicit_costs = false;  // some trace gave its own cost
};

// The most padded-to-A tokens one micro-batch may hold so that its row, padded to a multiple of
// row_align, still fits max_tokens; kNoCapacity without max_tokens.
int64_t Capacity(const PackConfig& c, int64_t row_align) {
  return c.max_tokens > 0 ? c.max_tokens / row_align * row_align : balance::kNoCapacity;
}

Result<Prepared> Prepare(std::span<const Trace> traces, const PackConfig& c, int64_t align,
                         int64_t row_align) {
  const int64_t cap = Capacity(c, row_align);
  const Padder pad(align);
  Prepared p;
  p.items.resize(traces.size());
  for (size_t i = 0; i < traces.size(); ++i) {
    const Trace& t = traces[i];
    if (t.length < 1 || t.length > kMaxRowTokens) {
      return absl::InvalidArgumentError(fmt::format(
          "trace {} (id {}) has length {}; lengths must be in [1, 2^31)", i, t.id, t.length));
    }
    if (!std::isfinite(t.cost)) {
      return absl::InvalidArgumentError(
          fmt::format("trace {} (id {}) has a non-finite cost", i, t.id));
    }
    if (t.loss_tokens > t.length) {
      return absl::InvalidArgumentError(
          fmt::format("trace {} (id {}) has {} loss tokens but only {} tokens", i, t.id,
                      t.loss_tokens, t.length));
    }
    const int64_t padded = pad(t.length);
    if (padded > cap) {
      return absl::InvalidArgumentError(fmt::format(
          "trace {} (id {}) has length {} ({} padded to {}, its row to a multiple of {}), more "
          "than max_tokens={}: raise max_tokens or split the trace over a larger CP size",
          i, t.id, t.length, padded, align, row_align, c.max_tokens));
    }
    p.items[i] = {.cost = t.cost >= 0 ? t.cost : c.cost.Cost(padded), .tokens = padded};
    p.total_cost += p.items[i].cost;
    p.largest_cost = std::max(p.largest_cost, p.items[i].cost);
    p.explicit_costs |= t.cost >= 0;
    p.real_tokens += t.length;
    p.padded_tokens += padded;
    p.longest_padded = std::max(p.longest_padded, padded);
  }
  return p;
}

// The row of `members`, its total padded up to a multiple of row_align (the extra tokens
// lengthen the last trace's padded span, and its cost when that comes from the cost model).
// Reads only `traces` (one cache line per member, the members being spread over all traces):
// padded lengths and model costs are recomputed as Prepare() computed them, bit for bit.
Row MakeRow(std::span<const Trace> traces, std::span<const int32_t> members, const PackConfig& c,
            const Padder& pad, int64_t row_align) {
  Row row;
  const size_t n = members.size();
  row.trace_ids.resize(n);
  row.cu_seqlens.resize(n + 1);
  row.cu_seqlens_padded.resize(n + 1);
  int64_t* ids = row.trace_ids.data();
  int32_t* cu = row.cu_seqlens.data();
  int32_t* cu_padded = row.cu_seqlens_padded.data();
  cu[0] = 0;
  cu_padded[0] = 0;
  int64_t real = 0, padded = 0, loss = 0, longest = 0;
  double cost = 0;
  // A row's members are spread over all traces: ask for the next ones' data early.
  constexpr size_t kAhead = 8;
  for (size_t k = 0; k < n; ++k) {
    if (k + kAhead < n) {
      __builtin_prefetch(&traces[static_cast<size_t>(members[k + kAhead])]);
    }
    const Trace& t = traces[static_cast<size_t>(members[k])];
    const int64_t span = pad(t.length);
    ids[k] = t.id;
    real += t.length;
    padded += span;
    cu[k + 1] = static_cast<int32_t>(real);
    cu_padded[k + 1] = static_cast<int32_t>(padded);
    longest = std::max(longest, span);
    loss += t.loss_tokens >= 0 ? t.loss_tokens : t.length - 1;
    cost += t.cost >= 0 ? t.cost : c.cost.Cost(span);
  }
  row.max_seqlen = static_cast<int32_t>(longest);
  row.loss_tokens = loss;
  row.cost = cost;
  const int64_t total = AlignUp(padded, row_align);
  if (total != padded && n > 0) {
    const Trace& last = traces[static_cast<size_t>(members.back())];
    const int64_t last_padded = pad(last.length);
    const int64_t last_span = last_padded + (total - padded);
    row.cu_seqlens_padded.back() = static_cast<int32_t>(total);
    row.max_seqlen = std::max(row.max_seqlen, static_cast<int32_t>(last_span));
    if (last.cost < 0) {
      row.cost += c.cost.Cost(last_span) - c.cost.Cost(last_padded);
    }
  }
  row.real_tokens = real;
  row.total_tokens = total;
  return row;
}

// Assignment of traces to dp*m micro-batches and of micro-batches to ranks.
struct Assignment {
  int m = 0;
  std::vector<int32_t> bin_of;
  std::vector<std::vector<int32_t>> rank_bins;  // rank -> bins in step order
};

std::optional<std::vector<int32_t>> AssignBins(Method method, std::span<const balance::Item> items,
                                               int bins, int64_t cap) {
  switch (method) {
    case Method::kLpt:
      return balance::Lpt(items, bins, cap);
    case Method::kRoundRobin:
      return balance::RoundRobin(items, bins, cap);
    case Method::kArrivalGreedy:
      return balance::ArrivalGreedy(items, bins, cap);
    default:
      return std::nullopt;
  }
}

std::vector<std::vector<int32_t>> IdentityRankBins(int dp, int m) {
  // Bin b is step b / dp of rank b % dp.
  std::vector<std::vector<int32_t>> rank_bins(static_cast<size_t>(dp));
  for (int s = 0; s < m; ++s) {
    for (int r = 0; r < dp; ++r) {
      rank_bins[static_cast<size_t>(r)].push_back(s * dp + r);
    }
  }
  return rank_bins;
}

// Splits every rank's traces into m micro-batches, each trace to its rank's least-loaded
// micro-batch with room, in LPT order (`seq`, the items in `order`; rank_at[j] is the rank of
// seq[j]). Ranks are independent, so one pass in LPT order serves all of them, reading the
// sequence in order instead of gathering each rank's traces. m is small: a linear scan beats a
// heap. Writes a.bin_of; false if some rank's traces do not fit.
bool SplitRanks(std::span<const balance::Item> seq, std::span<const int32_t> order,
                std::span<const int32_t> rank_at, int dp, int m, int64_t cap, Assignment& a) {
  const size_t mm = static_cast<size_t>(m);
  std::vector<double> load(static_cast<size_t>(dp) * mm, 0.0);
  std::vector<int64_t> tokens(static_cast<size_t>(dp) * mm, 0);
  for (size_t j = 0; j < seq.size(); ++j) {
    const balance::Item& it = seq[j];
    const int32_t r = rank_at[j];
    double* rank_load = &load[static_cast<size_t>(r) * mm];
    int64_t* rank_tokens = &tokens[static_cast<size_t>(r) * mm];
    // Selects, not jumps: which micro-batch is least loaded changes from item to item, and a
    // jump on it mispredicted about once per item.
    int best = -1;
    double best_load = std::numeric_limits<double>::infinity();
    for (int b = 0; b < m; ++b) {
      const bool fits = it.tokens <= cap - rank_tokens[b];
      const double here = fits ? rank_load[b] : std::numeric_limits<double>::infinity();
      const bool better = here < best_load;
      best_load = better ? here : best_load;
      best = better ? b : best;
    }
    if (best < 0) {
      return false;
    }
    rank_load[best] += it.cost;
    rank_tokens[best] += it.tokens;
    a.bin_of[static_cast<size_t>(order[j])] = best * dp + r;
  }
  return true;
}

// The library's method: LPT over ranks (each rank holding at most m*cap tokens), swap
// refinement between ranks while the costliest rank is more than 0.2% above the bound, then LPT of
// each rank's traces into its micro-batches. Rank-level balance is what DP waits on; splitting
// a balanced rank into equal micro-batches keeps every pipeline step alike across ranks. False
// if the traces do not fit m micro-batches per rank (the caller tries m + 1); at max_m, raises
// a.m instead until every rank's traces fit. `seq` holds the items in `order`.
bool AssignLpt(const Prepared& p, const PackConfig& c, int m, int64_t max_m, int64_t cap,
               std::span<const int32_t> order, std::span<const balance::Item> seq, Assignment& a) {
  const int64_t rank_cap = cap == balance::kNoCapacity || cap > balance::kNoCapacity / m
                               ? balance::kNoCapacity
                               : cap * m;
  auto rank_at = balance::LptSequence(seq, c.dp, rank_cap);
  if (!rank_at) {
    return false;
  }
  if (c.refine) {
    const double stop_at = std::max(p.largest_cost, p.total_cost / c.dp) * (1 + 2e-3);
    std::vector<double> rank_cost(static_cast<size_t>(c.dp), 0.0);
    for (size_t j = 0; j < seq.size(); ++j) {
      rank_cost[static_cast<size_t>((*rank_at)[j])] += seq[j].cost;
    }
    // RefineBySwaps() would stop at once (it sums the same costs in another order, hence the
    // margin, far above the rounding of a few hundred additions): skip handing it the ranks by
    // trace, which takes a scattered write per trace.
    if (*std::max_element(rank_cost.begin(), rank_cost.end()) > stop_at * (1 - 1e-9)) {
      std::vector<int32_t> rank_of(p.items.size(), -1);
      for (size_t j = 0; j < order.size(); ++j) {
        rank_of[static_cast<size_t>(order[j])] = (*rank_at)[j];
      }
      std::vector<std::vector<int32_t>> single(static_cast<size_t>(c.dp));
      for (int r = 0; r < c.dp; ++r) {
        single[static_cast<size_t>(r)] = {r};
      }
      if (balance::RefineBySwaps(p.items, rank_of, single, rank_cap, 8 * c.dp + 64, stop_at) > 0) {
        for (size_t j = 0; j < order.size(); ++j) {
          (*rank_at)[j] = rank_of[static_cast<size_t>(order[j])];
        }
      }
    }
  }
  a.bin_of.assign(p.items.size(), -1);
  while (!SplitRanks(seq, order, *rank_at, c.dp, m, cap, a)) {
    if (m < max_m) {
      // Balance the ranks again with room for one more micro-batch each: keeping this
      // assignment, made under the tighter rank capacity, left ranks 3% apart.
      return false;
    }
    // Every trace fits alone, so m = the most traces of a rank always succeeds; all ranks need
    // the same count, so all are split again.
    ++m;
  }
  a.m = m;
  a.rank_bins = IdentityRankBins(c.dp, m);
  return true;
}

Result<Assignment> Assign(const Prepared& p, const PackConfig& c, int64_t row_align) {
  const int64_t cap = Capacity(c, row_align);
  const int64_t n = static_cast<int64_t>(p.items.size());
  int m = c.micro_batches;
  if (c.max_tokens > 0) {
    const int64_t per_rank = (p.padded_tokens + c.dp - 1) / c.dp;
    m = static_cast<int>(std::max<int64_t>(1, (per_rank + cap - 1) / cap));
  }
  const int64_t max_m = std::max<int64_t>(m, (n + c.dp - 1) / c.dp);
  std::vector<int32_t> order;
  std::vector<balance::Item> seq;
  if (c.method == Method::kLpt) {
    // Model costs increase with tokens, so ordering by tokens is ordering by cost, from keys of
    // a few bits.
    order = p.explicit_costs ? balance::DecreasingCostOrder(p.items)
                             : balance::DecreasingTokenOrder(p.items);
    seq = balance::Gather(p.items, order);
  }
  for (;; ++m) {
    if (static_cast<int64_t>(m) * c.dp > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError("too many micro-batches (dp * micro_batches >= 2^31)");
    }
    Assignment a;
    a.m = m;
    const int bins = m * c.dp;
    if (c.method == Method::kKarmarkarKarp) {
      const std::vector<int32_t> rank_of = balance::KarmarkarKarp(p.items, c.dp);
      // Within each rank, LPT into m micro-batches.
      std::vector<std::vector<int32_t>> per_rank(static_cast<size_t>(c.dp));
      for (size_t i = 0; i < rank_of.size(); ++i) {
        per_rank[static_cast<size_t>(rank_of[i])].push_back(static_cast<int32_t>(i));
      }
      a.bin_of.assign(p.items.size(), -1);
      bool ok = true;
      for (int r = 0; r < c.dp && ok; ++r) {
        std::vector<balance::Item> sub;
        for (int32_t i : per_rank[static_cast<size_t>(r)]) {
          sub.push_back(p.items[static_cast<size_t>(i)]);
        }
        auto local = balance::Lpt(sub, m, cap);
        if (!local) {
          ok = false;
          break;
        }
        for (size_t j = 0; j < sub.size(); ++j) {
          a.bin_of[static_cast<size_t>(per_rank[static_cast<size_t>(r)][j])] =
              (*local)[j] * c.dp + r;
        }
      }
      if (!ok) {
        if (m >= max_m) {
          break;
        }
        continue;
      }
      a.rank_bins = IdentityRankBins(c.dp, m);
      return a;
    }
    if (c.method == Method::kPaddedBshd) {
      // Arrival order, equal trace counts per micro-batch; capacity is not enforced (see
      // header): the baseline exists to measure padding and imbalance.
      const int64_t per_bin = std::max<int64_t>(1, (n + bins - 1) / bins);
      a.bin_of.resize(p.items.size());
      for (int64_t i = 0; i < n; ++i) {
        a.bin_of[static_cast<size_t>(i)] = static_cast<int32_t>(i / per_bin);
      }
      a.rank_bins = IdentityRankBins(c.dp, m);
      return a;
    }
    if (c.method == Method::kLpt) {
      if (!AssignLpt(p, c, m, max_m, cap, order, seq, a)) {
        if (m >= max_m) {
          break;
        }
        continue;
      }
      return a;
    }
    auto bin_of = AssignBins(c.method, p.items, bins, cap);
    if (!bin_of) {
      if (m >= max_m) {
        break;
      }
      continue;
    }
    a.bin_of = std::move(*bin_of);
    a.rank_bins = IdentityRankBins(c.dp, m);
    return a;
  }
  return absl::InvalidArgumentError(fmt::format(
      "could not fit the traces into micro-batches of {} tokens; raise max_tokens", c.max_tokens));
}

}  // namespace

Result<Plan> PlanPacking(std::span<const Trace> traces, const PackConfig& config) {
  const auto t0 = std::chrono::steady_clock::now();
  BRAGG_RETURN_IF_ERROR(ValidateConfig(config));
  if (traces.empty()) {
    return absl::InvalidArgumentError("no traces to plan");
  }
  if (traces.size() >= static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError("too many traces (>= 2^31)");
  }
  BRAGG_ASSIGN_OR_RETURN(const int64_t align, Alignment(config));
  BRAGG_ASSIGN_OR_RETURN(const int64_t row_align, RowAlignment(config));
  BRAGG_ASSIGN_OR_RETURN(Prepared p, Prepare(traces, config, align, row_align));
  BRAGG_ASSIGN_OR_RETURN(Assignment a, Assign(p, config, row_align));

  const size_t bins = static_cast<size_t>(a.m) * static_cast<size_t>(config.dp);
  // Members of each bin in arrival order (counting sort keeps it linear).
  std::vector<int32_t> start(bins + 1, 0);
  for (int32_t b : a.bin_of) {
    ++start[static_cast<size_t>(b) + 1];
  }
  std::partial_sum(start.begin(), start.end(), start.begin());
  std::vector<int32_t> flat(traces.size());
  {
    std::vector<int32_t> fill(start.begin(), start.end() - 1);
    for (size_t i = 0; i < traces.size(); ++i) {
      flat[static_cast<size_t>(fill[static_cast<size_t>(a.bin_of[i])]++)] = static_cast<int32_t>(i);
    }
  }

  const Padder pad(align);
  Plan plan;
  plan.config = config;
  plan.ranks.resize(static_cast<size_t>(config.dp));
  const bool bshd = config.method == Method::kPaddedBshd;
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    RankPlan& rank = plan.ranks[r];
    rank.micro_batches.reserve(static_cast<size_t>(a.m));
    for (int32_t b : a.rank_bins[r]) {
      std::span<const int32_t> members(flat.data() + start[static_cast<size_t>(b)],
                                       flat.data() + start[static_cast<size_t>(b) + 1]);
      MicroBatch mb;
      if (!bshd) {
        mb.rows.push_back(MakeRow(traces, members, config, pad, row_align));
        if (mb.rows[0].total_tokens > kMaxRowTokens) {
          return absl::InvalidArgumentError(fmt::format(
              "a packed row would hold {} tokens, over the int32 limit of cu_seqlens; use "
              "max_tokens or more micro-batches",
              mb.rows[0].total_tokens));
        }
        mb.cost = mb.rows[0].cost;
        mb.total_tokens = mb.rows[0].total_tokens;
      } else {
        int64_t longest = 0;
        for (int32_t i : members) {
          longest = std::max(longest, pad(traces[static_cast<size_t>(i)].length));
        }
        longest = AlignUp(longest, row_align);
        for (int32_t i : members) {
          Row row = MakeRow(traces, std::span<const int32_t>(&i, 1), config, pad, 1);
          row.cu_seqlens_padded.back() = static_cast<int32_t>(longest);
          row.max_seqlen = static_cast<int32_t>(longest);
          row.total_tokens = longest;
          if (traces[static_cast<size_t>(i)].cost < 0) {
            row.cost = config.cost.Cost(longest);  // padding is computed too
          }
          mb.cost += row.cost;
          mb.total_tokens += row.total_tokens;
          mb.rows.push_back(std::move(row));
        }
      }
      rank.cost += mb.cost;
      rank.micro_batches.push_back(std::move(mb));
    }
    if (config.method == Method::kLpt) {
      std::stable_sort(rank.micro_batches.begin(), rank.micro_batches.end(),
                       [](const MicroBatch& x, const MicroBatch& y) { return x.cost > y.cost; });
    }
  }

  PlanSummary& s = plan.summary;
  s.traces = static_cast<int64_t>(traces.size());
  s.ranks = config.dp;
  s.micro_batches_per_rank = a.m;
  s.alignment = align;
  s.row_alignment = row_align;
  s.real_tokens = p.real_tokens;
  for (const RankPlan& rank : plan.ranks) {
    for (const MicroBatch& mb : rank.micro_batches) {
      s.padded_tokens += mb.total_tokens;
    }
    s.max_rank_cost = std::max(s.max_rank_cost, rank.cost);
    s.mean_rank_cost += rank.cost;
  }
  s.mean_rank_cost /= config.dp;
  s.padding_fraction = s.padded_tokens > 0 ? static_cast<double>(s.padded_tokens - s.real_tokens) /
                                                 static_cast<double>(s.padded_tokens)
                                           : 0.0;
  s.max_over_mean = s.mean_rank_cost > 0 ? s.max_rank_cost / s.mean_rank_cost : 1.0;
  s.lower_bound = s.mean_rank_cost > 0 ? std::max(1.0, p.largest_cost / s.mean_rank_cost) : 1.0;
  if (s.mean_rank_cost > 0 && p.largest_cost > s.mean_rank_cost) {
    for (size_t i = 0; i < traces.size(); ++i) {
      if (p.items[i].cost > s.mean_rank_cost) {
        s.oversized_trace_ids.push_back(traces[i].id);
      }
    }
  }
  for (int step = 0; step < a.m; ++step) {
    double mx = 0, sum = 0;
    for (const RankPlan& rank : plan.ranks) {
      const double cst = rank.micro_batches[static_cast<size_t>(step)].cost;
      mx = std::max(mx, cst);
      sum += cst;
    }
    if (sum > 0) {
      s.step_max_over_mean = std::max(s.step_max_over_mean, mx / (sum / config.dp));
    }
  }
  s.plan_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return plan;
}

}  // namespace bragg::pack
