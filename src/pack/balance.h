#pragma once

// Assignment of weighted items (traces) to bins (micro-batches) and of bins to DP ranks: the
// algorithms behind PlanPacking() and its baselines. Internal to bragg::pack; exposed for tests
// and the benchmark. All functions are pure and thread-safe.

#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <vector>

namespace bragg::pack::balance {

struct Item {
  double cost = 0;
  int64_t tokens = 0;  // padded tokens, counted against the bin capacity
};

inline constexpr int64_t kNoCapacity = std::numeric_limits<int64_t>::max();

// Longest-processing-time first: items by decreasing cost (ties: lower index first), each to the
// least-loaded bin whose tokens stay <= capacity. Returns the bin of every item, or nullopt when
// some item fits in no bin.
std::optional<std::vector<int32_t>> Lpt(std::span<const Item> items, int bins, int64_t capacity);

// The order Lpt() uses: indices by decreasing cost, equal costs by increasing index.
// Costs must be >= 0 and not NaN.
std::vector<int32_t> DecreasingCostOrder(std::span<const Item> items);

// Indices by decreasing tokens, equal tokens by increasing index: DecreasingCostOrder() when
// cost is an increasing function of tokens (a cost model, no explicit costs), found from keys
// of a few bits instead of 64. Tokens must be >= 0.
std::vector<int32_t> DecreasingTokenOrder(std::span<const Item> items);

// Lpt() with a precomputed order (a subsequence of DecreasingCostOrder() for a subset).
std::optional<std::vector<int32_t>> LptInOrder(std::span<const Item> items,
                                               std::span<const int32_t> order, int bins,
                                               int64_t capacity);

// items[order[j]] for every j: the items in the order LptSequence() takes them.
std::vector<Item> Gather(std::span<const Item> items, std::span<const int32_t> order);

// LptInOrder() over items already gathered in LPT order (seq[j] is the j-th item placed): the
// bin of every position of `seq` rather than of every item, so that a caller that keeps the
// sequence reads and writes it in order. nullopt when some item fits in no bin.
std::optional<std::vector<int32_t>> LptSequence(std::span<const Item> seq, int bins,
                                                int64_t capacity);

// Arrival order, item i to bin i mod bins, or the next bin (cyclically) with room.
std::optional<std::vector<int32_t>> RoundRobin(std::span<const Item> items, int bins,
                                               int64_t capacity);

// Arrival order, each item to the least-loaded bin with room.
std::optional<std::vector<int32_t>> ArrivalGreedy(std::span<const Item> items, int bins,
                                                  int64_t capacity);

// Multiway Karmarkar-Karp (largest differencing) into `parts` parts, capacity ignored. To keep
// memory O(n) the items, sorted by decreasing cost, are seeded as partitions of `parts`
// consecutive items (one per part) which are then combined by largest difference.
std::vector<int32_t> KarmarkarKarp(std::span<const Item> items, int parts);

// Swap refinement: while it lowers the costliest rank, moves one item, or swaps two, between
// the costliest rank and one of the cheapest ranks, keeping every bin within capacity.
// `bin_of` (item -> bin) is updated in place; `rank_bins` is not changed. Returns the number of
// moves made. Stops after `max_moves`, or once the costliest rank costs <= stop_at.
int RefineBySwaps(std::span<const Item> items, std::span<int32_t> bin_of,
                  const std::vector<std::vector<int32_t>>& rank_bins, int64_t capacity,
                  int max_moves, double stop_at = 0);

}  // namespace bragg::pack::balance
