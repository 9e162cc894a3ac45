#include "pack/balance.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <numeric>
#include <queue>
#include <utility>

namespace bragg::pack::balance {
namespace {

// Tournament (winner) tree over the bins' loads: the root holds the least-loaded bin, ties
// going to the lower bin. Updating a leaf recomputes its path to the root: always log2(bins)
// steps, about three times faster than a binary heap's sift-down for LPT's one-update-per-item
// pattern. (GCC compiles Pull's minimum to a jump, mispredicted more often when loads differ
// by little, as with FP8 aligned per row; neither an index select nor integer keys were faster
// over both length sets of the benchmark.)
class LoadTree {
 public:
  explicit LoadTree(int bins) {
    while (leaves_ < static_cast<size_t>(bins)) {
      leaves_ *= 2;
    }
    key_.assign(2 * leaves_, std::numeric_limits<double>::infinity());
    id_.assign(2 * leaves_, 0);
    for (size_t i = 0; i < leaves_; ++i) {
      id_[leaves_ + i] = static_cast<int32_t>(i);
      if (i < static_cast<size_t>(bins)) {
        key_[leaves_ + i] = 0.0;
      }
    }
    for (size_t n = leaves_ - 1; n >= 1; --n) {
      Pull(n);
    }
  }
  // The least-loaded bin, or -1 when every bin is set aside.
  int32_t top_bin() const { return key_[1] == kGone ? -1 : id_[1]; }
  double load(int32_t bin) const { return key_[leaves_ + static_cast<size_t>(bin)]; }
  void Set(int32_t bin, double load) {
    size_t n = leaves_ + static_cast<size_t>(bin);
    key_[n] = load;
    for (n /= 2; n >= 1; n /= 2) {
      Pull(n);
    }
  }

  static constexpr double kGone = std::numeric_limits<double>::infinity();

 private:
  void Pull(size_t n) {
    const size_t l = 2 * n, r = 2 * n + 1;
    const bool right = key_[r] < key_[l];
    key_[n] = right ? key_[r] : key_[l];
    id_[n] = right ? id_[r] : id_[l];
  }

  size_t leaves_ = 1;
  std::vector<double> key_;
  std::vector<int32_t> id_;
};

// Each item of `order` to the least-loaded bin with room (ties to the lower bin). Bins without
// room for an item are set aside (load +inf) until an item fits them.
std::optional<std::vector<int32_t>> LeastLoadedInOrder(std::span<const Item> items,
                                                       std::span<const int32_t> order, int bins,
                                                       int64_t capacity) {
  LoadTree tree(bins);
  std::vector<int64_t> tokens(static_cast<size_t>(bins), 0);
  std::vector<double> load(static_cast<size_t>(bins), 0.0);
  std::vector<int32_t> bin_of(items.size(), -1);
  // Gather first: independent loads overlap, while loads inside the placement loop below would
  // each wait on a cache miss.
  std::vector<Item> seq(order.size());
  for (size_t j = 0; j < order.size(); ++j) {
    seq[j] = items[static_cast<size_t>(order[j])];
  }
  // Bins out of the tree because an item did not fit, by room left, most room on top. A bin
  // gets nothing while aside, so its room and load stay put; it comes back as soon as an item
  // fits it. Putting every skipped bin back after each item instead made near-full plans
  // quadratic (each item skipped the same full bins again): 3.7 million skips for 100,000
  // traces into 512 ranks whose capacity was 99.9% used.
  std::priority_queue<std::pair<int64_t, int32_t>> aside;
  for (size_t j = 0; j < order.size(); ++j) {
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
    bin_of[static_cast<size_t>(order[j])] = b;
    tokens[static_cast<size_t>(b)] += it.tokens;
    load[static_cast<size_t>(b)] += it.cost;
    tree.Set(b, load[static_cast<size_t>(b)]);
  }
  return bin_of;
}

std::vector<int32_t> Iota(size_t n) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}

// Indices by increasing key, equal keys by increasing index. LSD radix sort over only the bits
// where keys differ, 11 bits a pass: stable, and its 2,048 counters stay in L1 (16-bit digits'
// 256 KiB of counters and scattered writes cost more than the extra passes). Several times
// faster than a comparison sort on 100k items; token keys of up to 64K need two passes.
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
  constexpr int kBits = 11;
  constexpr uint64_t kMask = (uint64_t{1} << kBits) - 1;
  std::vector<uint64_t> key2(n);
  std::vector<int32_t> idx2(n);
  std::vector<uint32_t> count(size_t{1} << kBits);
  for (int shift = lo; shift < hi; shift += kBits) {
    std::fill(count.begin(), count.end(), 0);
    for (size_t i = 0; i < n; ++i) {
      ++count[(key[i] >> shift) & kMask];
    }
    uint32_t sum = 0;
    for (uint32_t& c : count) {
      const uint32_t here = c;
      c = sum;
      sum += here;
    }
    for (size_t i = 0; i < n; ++i) {
      const uint32_t pos = count[(key[i] >> shift) & kMask]++;
      key2[pos] = key[i];
      idx2[pos] = idx[i];
    }
    key.swap(key2);
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
  std::vector<std::vector<int32_t>> members(nbins);
  std::vector<size_t> slot(items.size(), 0);  // position of an item in members[bin]
  for (size_t i = 0; i < items.size(); ++i) {
    const size_t b = static_cast<size_t>(bin_of[i]);
    bin_cost[b] += items[i].cost;
    bin_tokens[b] += items[i].tokens;
    slot[i] = members[b].size();
    members[b].push_back(static_cast<int32_t>(i));
  }
  std::vector<double> rank_cost(dp, 0.0);
  for (size_t b = 0; b < nbins; ++b) {
    rank_cost[static_cast<size_t>(rank_of_bin[b])] += bin_cost[b];
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
