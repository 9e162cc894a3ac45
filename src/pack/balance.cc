#include "pack/balance.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <numeric>
#include <queue>
#include <utility>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace bragg::pack::balance {
namespace {

// Position and value of the least of k[0..7] with k[c] read as v, the first one on ties. The
// 8 keys are read before the caller stores v at k[c]: a 16-byte load over a pending 8-byte store
// cannot be forwarded and would stall every level. SSE2 (every x86-64) does it without a branch;
// the scalar loop elsewhere.
inline std::pair<int, double> ArgMin8With(const double* k, int c, double v) {
#if defined(__SSE2__)
  __m128d a0 = _mm_loadu_pd(k), a1 = _mm_loadu_pd(k + 2);
  __m128d a2 = _mm_loadu_pd(k + 4), a3 = _mm_loadu_pd(k + 6);
  const __m128d vv = _mm_set1_pd(v);
  const __m128d cc = _mm_set1_pd(static_cast<double>(c));
  auto blend = [&](__m128d a, double lane0) {
    const __m128d here = _mm_cmpeq_pd(_mm_set_pd(lane0 + 1, lane0), cc);
    return _mm_or_pd(_mm_and_pd(here, vv), _mm_andnot_pd(here, a));
  };
  a0 = blend(a0, 0);
  a1 = blend(a1, 2);
  a2 = blend(a2, 4);
  a3 = blend(a3, 6);
  __m128d m = _mm_min_pd(_mm_min_pd(a0, a1), _mm_min_pd(a2, a3));
  m = _mm_min_pd(m, _mm_shuffle_pd(m, m, 1));
  const int mask =
      _mm_movemask_pd(_mm_cmpeq_pd(a0, m)) | (_mm_movemask_pd(_mm_cmpeq_pd(a1, m)) << 2) |
      (_mm_movemask_pd(_mm_cmpeq_pd(a2, m)) << 4) | (_mm_movemask_pd(_mm_cmpeq_pd(a3, m)) << 6);
  return {std::countr_zero(static_cast<unsigned>(mask)), _mm_cvtsd_f64(m)};
#else
  int pos = 0;
  double least = c == 0 ? v : k[0];
  for (int j = 1; j < 8; ++j) {
    const double x = j == c ? v : k[j];
    if (x < least) {
      least = x;
      pos = j;
    }
  }
  return {pos, least};
#endif
}

// Tournament (winner) tree over the bins' loads, 8 children a node: the root holds the
// least-loaded bin, ties going to the lower bin. Updating a leaf recomputes its path to the
// root: log8(bins) steps of a branch-free minimum of 8 (ArgMin8With). The binary tree this
// replaces took log2(bins) steps, each a compare-and-jump that mispredicted about half the time
// (loads that differ by little): 512 bins are 3 levels instead of 9. Same choices as the
// binary tree: every node holds the first least-loaded leaf of its subtree.
class LoadTree {
 public:
  static constexpr size_t kFan = 8;

  explicit LoadTree(int bins) {
    size_t width = kFan;
    levels_ = 1;
    while (width < static_cast<size_t>(bins)) {
      width *= kFan;
      ++levels_;
    }
    // Level 0 is the leaves; level l has width / 8^l nodes, the root level one.
    size_t total = 0;
    for (size_t l = 0, w = width; l <= levels_; ++l, w /= kFan) {
      offset_[l] = total;
      total += std::max<size_t>(w, 1);
    }
    key_.assign(total, kGone);
    id_.assign(total, 0);
    for (size_t i = 0; i < width; ++i) {
      id_[i] = static_cast<int32_t>(i);
    }
    for (size_t i = 0; i < static_cast<size_t>(bins); ++i) {
      Set(static_cast<int32_t>(i), 0.0);
    }
  }
  // The least-loaded bin, or -1 when every bin is set aside.
  int32_t top_bin() const {
    const size_t root = offset_[levels_];
    return key_[root] == kGone ? -1 : id_[root];
  }
  double load(int32_t bin) const { return key_[static_cast<size_t>(bin)]; }
  void Set(int32_t bin, double load) {
    size_t g = static_cast<size_t>(bin);
    double key = load;
    int32_t id = bin;
    for (size_t l = 0; l < levels_; ++l) {
      const size_t first = offset_[l] + (g & ~(kFan - 1));
      const int c = static_cast<int>(g & (kFan - 1));
      const auto [pos, least] = ArgMin8With(&key_[first], c, key);
      key_[offset_[l] + g] = key;
      id_[offset_[l] + g] = id;
      id = id_[first + static_cast<size_t>(pos)];  // a load, not a jump on pos == c
      key = least;
      g /= kFan;
    }
    key_[offset_[levels_]] = key;
    id_[offset_[levels_]] = id;
  }

  static constexpr double kGone = std::numeric_limits<double>::infinity();

 private:
  size_t levels_ = 1;
  size_t offset_[12] = {};  // 8^11 leaves are more than int32 bins
  std::vector<double> key_;
  std::vector<int32_t> id_;
};

// Each item of `seq`, in turn, to the least-loaded bin with room (ties to the lower bin): the
// bin of every position. Bins without room for an item are set aside (load +inf) until an item
// fits them.
std::optional<std::vector<int32_t>> LeastLoadedSequence(std::span<const Item> seq, int bins,
                                                        int64_t capacity) {
  LoadTree tree(bins);
  std::vector<int64_t> tokens(static_cast<size_t>(bins), 0);
  std::vector<double> load(static_cast<size_t>(bins), 0.0);
  std::vector<int32_t> bin_at(seq.size());
  // Bins out of the tree because an item did not fit, by room left, most room on top. A bin
  // gets nothing while aside, so its room and load stay put; it comes back as soon as an item
  // fits it. Putting every skipped bin back after each item instead made near-full plans
  // quadratic (each item skipped the same full bins again): 3.7 million skips for 100,000
  // traces into 512 ranks whose capacity was 99.9% used.
  std::priority_queue<std::pair<int64_t, int32_t>> aside;
  for (size_t j = 0; j < seq.size(); ++j) {
    const Item& it = seq[j];
    while (!aside.empty() && aside.top().first >= it.tokens) {
      const int32_t bin = aside.top().second;
      aside.pop();
      tree.Set(bin, load[static_cast<size_t>(bin)]);
    }
    int32_t b = tree.top_bin();
    while (b >= 0 && it.tokens > capacity - tokens[static_cast<size_t>(b)]) {
      aside.emplace(capacity - tokens[static_cast<size_t>(b)], b);
      tree.Set(b, LoadTree::kGone);
      b = tree.top_bin();
    }
    if (b < 0) {
      return std::nullopt;
    }
    bin_at[j] = b;
    tokens[static_cast<size_t>(b)] += it.tokens;
    load[static_cast<size_t>(b)] += it.cost;
    tree.Set(b, load[static_cast<size_t>(b)]);
  }
  return bin_at;
}

// Each item of `order` to the least-loaded bin with room: LeastLoadedSequence() of the items
// gathered in that order, given back by item.
std::optional<std::vector<int32_t>> LeastLoadedInOrder(std::span<const Item> items,
                                                       std::span<const int32_t> order, int bins,
                                                       int64_t capacity) {
  // Gather first: independent loads overlap, while loads inside the placement loop would each
  // wait on a cache miss.
  const std::vector<Item> seq = Gather(items, order);
  auto bin_at = LeastLoadedSequence(seq, bins, capacity);
  if (!bin_at) {
    return std::nullopt;
  }
  std::vector<int32_t> bin_of(items.size(), -1);
  for (size_t j = 0; j < order.size(); ++j) {
    bin_of[static_cast<size_t>(order[j])] = (*bin_at)[j];
  }
  return bin_of;
}

std::vector<int32_t> Iota(size_t n) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

// Indices by increasing key, equal keys by increasing index. LSD radix sort over only the bits
// where keys differ, at most 13 bits a pass: stable, and its <= 8,192 counters stay in L1
// (16-bit digits' 256 KiB of counters and scattered writes cost more than the extra passes).
// Several times faster than a comparison sort on 100k items.
std::vector<int32_t> RadixOrder(std::vector<uint64_t> key) {
  const size_t n = key.size();
  std::vector<int32_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  if (n < 2048) {
    // Small inputs: a comparison sort beats the passes' fixed costs.
    std::vector<std::pair<uint64_t, int32_t>> kv(n);
    for (size_t i = 0; i < n; ++i) {
      kv[i] = {key[i], idx[i]};
    }
    std::sort(kv.begin(), kv.end());
    for (size_t i = 0; i < n; ++i) {
      idx[i] = kv[i].second;
    }
    return idx;
  }
  uint64_t all_or = 0, all_and = ~uint64_t{0};
  for (uint64_t k : key) {
    all_or |= k;
    all_and &= k;
  }
  const uint64_t differ = all_or ^ all_and;
  if (differ == 0) {
    return idx;
  }
  const int lo = std::countr_zero(differ);
  const int hi = 64 - std::countl_zero(differ);
  // Digits of at most 13 bits, as few passes as that allows, the bits shared evenly: token keys
  // padded to 16 that differ in 12 or 13 bits take one pass instead of two.
  constexpr int kMaxBits = 13;
  const int passes = (hi - lo + kMaxBits - 1) / kMaxBits;
  const int bits = (hi - lo + passes - 1) / passes;
  const uint64_t mask = (uint64_t{1} << bits) - 1;
  // The last pass moves only the indices: its keys are not read again.
  std::vector<uint64_t> key2(passes > 1 ? n : 0);
  std::vector<int32_t> idx2(n);
  std::vector<uint32_t> count(size_t{1} << bits);
  for (int shift = lo; shift < hi; shift += bits) {
    const bool last = shift + bits >= hi;
    std::fill(count.begin(), count.end(), 0);
    for (size_t i = 0; i < n; ++i) {
      ++count[(key[i] >> shift) & mask];
    }
    uint32_t sum = 0;
    for (uint32_t& c : count) {
      const uint32_t here = c;
      c = sum;
      sum += here;
    }
    if (last) {
      for (size_t i = 0; i < n; ++i) {
        idx2[count[(key[i] >> shift) & mask]++] = idx[i];
      }
    } else {
      for (size_t i = 0; i < n; ++i) {
        const uint32_t pos = count[(key[i] >> shift) & mask]++;
        key2[pos] = key[i];
        idx2[pos] = idx[i];
      }
      key.swap(key2);
    }
    idx.swap(idx2);
  }
  return idx;
}

std::vector<int32_t> ByDecreasingCost(std::span<const Item> items) {
  std::vector<uint64_t> key(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    uint64_t bits;
    const double c = items[i].cost + 0.0;  // -0.0 -> +0.0
    std::memcpy(&bits, &c, sizeof bits);
    key[i] = ~bits;  // the bits of non-negative doubles order as the values; ~ reverses
  }
  return RadixOrder(std::move(key));
}

}  // namespace

std::vector<int32_t> DecreasingCostOrder(std::span<const Item> items) {
  return ByDecreasingCost(items);
}

std::vector<int32_t> DecreasingTokenOrder(std::span<const Item> items) {
  std::vector<uint64_t> key(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    key[i] = ~static_cast<uint64_t>(items[i].tokens);
  }
  return RadixOrder(std::move(key));
}

std::optional<std::vector<int32_t>> Lpt(std::span<const Item> items, int bins, int64_t capacity) {
  const std::vector<int32_t> order = ByDecreasingCost(items);
  return LeastLoadedInOrder(items, order, bins, capacity);
}

std::vector<Item> Gather(std::span<const Item> items, std::span<const int32_t> order) {
  std::vector<Item> seq;
  seq.reserve(order.size());  // not seq(n): zeroing 16 bytes per item first cost a pass
  for (int32_t i : order) {
    seq.push_back(items[static_cast<size_t>(i)]);
  }
  return seq;
}

std::optional<std::vector<int32_t>> LptSequence(std::span<const Item> seq, int bins,
                                                int64_t capacity) {
  return LeastLoadedSequence(seq, bins, capacity);
}

std::optional<std::vector<int32_t>> LptInOrder(std::span<const Item> items,
                                               std::span<const int32_t> order, int bins,
                                               int64_t capacity) {
  return LeastLoadedInOrder(items, order, bins, capacity);
}

std::optional<std::vector<int32_t>> ArrivalGreedy(std::span<const Item> items, int bins,
                                                  int64_t capacity) {
  const std::vector<int32_t> order = Iota(items.size());
  return LeastLoadedInOrder(items, order, bins, capacity);
}

std::optional<std::vector<int32_t>> RoundRobin(std::span<const Item> items, int bins,
                                               int64_t capacity) {
  std::vector<int64_t> tokens(static_cast<size_t>(bins), 0);
  std::vector<int32_t> bin_of(items.size(), -1);
  for (size_t i = 0; i < items.size(); ++i) {
    const int start = static_cast<int>(i % static_cast<size_t>(bins));
    for (int k = 0; k < bins; ++k) {
      const int b = (start + k) % bins;
      if (items[i].tokens <= capacity - tokens[static_cast<size_t>(b)]) {
        bin_of[i] = b;
        tokens[static_cast<size_t>(b)] += items[i].tokens;
        break;
      }
    }
    if (bin_of[i] < 0) {
      return std::nullopt;
    }
  }
  return bin_of;
}

std::vector<int32_t> KarmarkarKarp(std::span<const Item> items, int parts) {
  const size_t k = static_cast<size_t>(parts);
  struct Subset {
    double sum = 0;
    std::vector<int32_t> members;
  };
  struct Partition {
    std::vector<Subset> subsets;  // kept sorted by decreasing sum
    double Diff() const { return subsets.front().sum - subsets.back().sum; }
  };
  const std::vector<int32_t> order = ByDecreasingCost(items);
  std::vector<Partition> partitions;
  for (size_t g = 0; g < order.size(); g += k) {
    Partition p;
    p.subsets.resize(k);
    for (size_t j = 0; j < k && g + j < order.size(); ++j) {
      const int32_t i = order[g + j];
      p.subsets[j].sum = items[static_cast<size_t>(i)].cost;
      p.subsets[j].members.push_back(i);
    }
    partitions.push_back(std::move(p));
  }
  using Entry = std::pair<double, size_t>;  // (difference, partition), max-heap
  std::priority_queue<Entry> heap;
  for (size_t p = 0; p < partitions.size(); ++p) {
    heap.emplace(partitions[p].Diff(), p);
  }
  while (heap.size() > 1) {
    const size_t a = heap.top().second;
    heap.pop();
    const size_t b = heap.top().second;
    heap.pop();
    Partition& pa = partitions[a];
    Partition& pb = partitions[b];
    // Largest subset of one with the smallest of the other.
    for (size_t j = 0; j < k; ++j) {
      Subset& dst = pa.subsets[j];
      Subset& src = pb.subsets[k - 1 - j];
      dst.sum += src.sum;
      if (dst.members.size() < src.members.size()) {
        std::swap(dst.members, src.members);
      }
      dst.members.insert(dst.members.end(), src.members.begin(), src.members.end());
      src.members = {};
    }
    std::sort(pa.subsets.begin(), pa.subsets.end(),
              [](const Subset& x, const Subset& y) { return x.sum > y.sum; });
    pb.subsets = {};
    heap.emplace(pa.Diff(), a);
  }
  std::vector<int32_t> part_of(items.size(), 0);
  if (!heap.empty()) {
    const Partition& last = partitions[heap.top().second];
    for (size_t j = 0; j < k; ++j) {
      for (int32_t i : last.subsets[j].members) {
        part_of[static_cast<size_t>(i)] = static_cast<int32_t>(j);
      }
    }
  }
  return part_of;
}

int RefineBySwaps(std::span<const Item> items, std::span<int32_t> bin_of,
                  const std::vector<std::vector<int32_t>>& rank_bins, int64_t capacity,
                  int max_moves, double stop_at) {
  const size_t dp = rank_bins.size();
  if (dp < 2) {
    return 0;
  }
  size_t nbins = 0;
  for (const auto& rb : rank_bins) {
    nbins += rb.size();
  }
  std::vector<int32_t> rank_of_bin(nbins, 0);
  for (size_t r = 0; r < dp; ++r) {
    for (int32_t b : rank_bins[r]) {
      rank_of_bin[static_cast<size_t>(b)] = static_cast<int32_t>(r);
    }
  }
  std::vector<double> bin_cost(nbins, 0.0);
  std::vector<int64_t> bin_tokens(nbins, 0);
  std::vector<int32_t> count(nbins, 0);
  for (size_t i = 0; i < items.size(); ++i) {
    const size_t b = static_cast<size_t>(bin_of[i]);
    bin_cost[b] += items[i].cost;
    bin_tokens[b] += items[i].tokens;
    ++count[b];
  }
  std::vector<double> rank_cost(dp, 0.0);
  for (size_t b = 0; b < nbins; ++b) {
    rank_cost[static_cast<size_t>(rank_of_bin[b])] += bin_cost[b];
  }
  // Most plans are within stop_at after LPT: return before building the member lists, which
  // cost more than the check (a vector per bin, one push per item).
  if (*std::max_element(rank_cost.begin(), rank_cost.end()) <= stop_at) {
    return 0;
  }
  std::vector<std::vector<int32_t>> members(nbins);
  for (size_t b = 0; b < nbins; ++b) {
    members[b].reserve(static_cast<size_t>(count[b]));
  }
  std::vector<size_t> slot(items.size(), 0);  // position of an item in members[bin]
  for (size_t i = 0; i < items.size(); ++i) {
    const size_t b = static_cast<size_t>(bin_of[i]);
    slot[i] = members[b].size();
    members[b].push_back(static_cast<int32_t>(i));
  }
  auto remove = [&](int32_t i) {
    const size_t b = static_cast<size_t>(bin_of[static_cast<size_t>(i)]);
    std::vector<int32_t>& v = members[b];
    const size_t s = slot[static_cast<size_t>(i)];
    v[s] = v.back();
    slot[static_cast<size_t>(v[s])] = s;
    v.pop_back();
    bin_cost[b] -= items[static_cast<size_t>(i)].cost;
    bin_tokens[b] -= items[static_cast<size_t>(i)].tokens;
    rank_cost[static_cast<size_t>(rank_of_bin[b])] -= items[static_cast<size_t>(i)].cost;
  };
  auto insert = [&](int32_t i, int32_t b) {
    const size_t bb = static_cast<size_t>(b);
    bin_of[static_cast<size_t>(i)] = b;
    slot[static_cast<size_t>(i)] = members[bb].size();
    members[bb].push_back(i);
    bin_cost[bb] += items[static_cast<size_t>(i)].cost;
    bin_tokens[bb] += items[static_cast<size_t>(i)].tokens;
    rank_cost[static_cast<size_t>(rank_of_bin[bb])] += items[static_cast<size_t>(i)].cost;
  };

  const size_t receivers = std::min<size_t>(dp - 1, 8);
  std::vector<int32_t> ranks = Iota(dp);
  struct Cand {
    double cost;
    int32_t item;
  };
  std::vector<Cand> low;
  int moves = 0;
  while (moves < max_moves) {
    const size_t hi = static_cast<size_t>(std::max_element(rank_cost.begin(), rank_cost.end()) -
                                          rank_cost.begin());
    if (rank_cost[hi] <= stop_at) {
      break;
    }
    std::partial_sort(ranks.begin(), ranks.begin() + static_cast<long>(receivers), ranks.end(),
                      [&](int32_t x, int32_t y) {
                        return rank_cost[static_cast<size_t>(x)] <
                               rank_cost[static_cast<size_t>(y)];
                      });
    bool moved = false;
    for (size_t q = 0; q < receivers && !moved; ++q) {
      const size_t lo = static_cast<size_t>(ranks[q]);
      const double gap = rank_cost[hi] - rank_cost[lo];
      if (lo == hi || gap <= 1e-12 * rank_cost[hi]) {
        break;
      }
      low.clear();
      int32_t roomiest = -1;
      for (int32_t b : rank_bins[lo]) {
        if (roomiest < 0 ||
            bin_tokens[static_cast<size_t>(b)] < bin_tokens[static_cast<size_t>(roomiest)]) {
          roomiest = b;
        }
        for (int32_t i : members[static_cast<size_t>(b)]) {
          low.push_back({items[static_cast<size_t>(i)].cost, i});
        }
      }
      std::sort(low.begin(), low.end(),
                [](const Cand& x, const Cand& y) { return x.cost < y.cost; });
      // Best transfer delta is gap/2: both ranks end at the midpoint.
      double best_score = gap;  // |delta - gap/2| must beat gap/2 to lower the max
      int32_t best_x = -1, best_y = -1;
      for (int32_t b : rank_bins[hi]) {
        for (int32_t x : members[static_cast<size_t>(b)]) {
          const Item& ix = items[static_cast<size_t>(x)];
          const int64_t room_x = capacity == kNoCapacity
                                     ? kNoCapacity
                                     : capacity - bin_tokens[static_cast<size_t>(b)] + ix.tokens;
          // Move x alone.
          if (ix.cost > 0 && ix.cost < gap && roomiest >= 0 &&
              ix.tokens <= capacity - bin_tokens[static_cast<size_t>(roomiest)]) {
            const double score = std::abs(ix.cost - gap / 2);
            if (score < best_score) {
              best_score = score;
              best_x = x;
              best_y = -1;
            }
          }
          // Swap with y: delta = c_x - c_y, closest to gap/2.
          const double target = ix.cost - gap / 2;
          auto it = std::lower_bound(low.begin(), low.end(), target,
                                     [](const Cand& c, double v) { return c.cost < v; });
          const long center = it - low.begin();
          for (long j = std::max(0L, center - 3);
               j < std::min(static_cast<long>(low.size()), center + 3); ++j) {
            const Cand& c = low[static_cast<size_t>(j)];
            const double delta = ix.cost - c.cost;
            if (delta <= 0 || delta >= gap) {
              continue;
            }
            const Item& iy = items[static_cast<size_t>(c.item)];
            const size_t by = static_cast<size_t>(bin_of[static_cast<size_t>(c.item)]);
            if (capacity != kNoCapacity &&
                (iy.tokens > room_x || ix.tokens > capacity - bin_tokens[by] + iy.tokens)) {
              continue;
            }
            const double score = std::abs(delta - gap / 2);
            if (score < best_score) {
              best_score = score;
              best_x = x;
              best_y = c.item;
            }
          }
        }
      }
      if (best_x < 0 || best_score >= gap / 2 * (1 - 1e-12)) {
        continue;
      }
      const int32_t bx = bin_of[static_cast<size_t>(best_x)];
      if (best_y < 0) {
        remove(best_x);
        insert(best_x, roomiest);
      } else {
        const int32_t by = bin_of[static_cast<size_t>(best_y)];
        remove(best_x);
        remove(best_y);
        insert(best_x, by);
        insert(best_y, bx);
      }
      moved = true;
      ++moves;
    }
    if (!moved) {
      break;
    }
  }
  return moves;
}

}  // namespace bragg::pack::balance
