#pragma once

// A radix tree over token ids with LRU eviction, as SGLang's RadixCache keeps KV: the simulated
// worker uses it as its exact prefix cache, the router as its approximate per-worker view.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

namespace bragg::gateway {

// Per-token payload stored beside each cached token (the weight version that computed its KV).
using TokenTag = uint32_t;

// Prefix cache over int32 token sequences holding at most `capacity_tokens` tokens; when full,
// the least recently used leaf is trimmed from its tail. Not thread-safe: callers lock.
class RadixCache {
 public:
  // `capacity_tokens` 0 means unbounded.
  explicit RadixCache(size_t capacity_tokens);
  ~RadixCache();
  RadixCache(const RadixCache&) = delete;
  RadixCache& operator=(const RadixCache&) = delete;

  // Length of the longest cached prefix of `tokens`; marks it most recently used. If `tags` is
  // not null it receives the stored tags of the matched prefix.
  size_t Match(std::span<const int32_t> tokens, std::vector<TokenTag>* tags = nullptr);

  // Same as Match but leaves LRU order alone.
  size_t Peek(std::span<const int32_t> tokens) const;

  // Caches `tokens` (tags[i] for token i; `tags` must be as long as `tokens` or empty, meaning
  // tag 0). Returns the length that was already cached before the call. Evicts LRU leaves to stay
  // within capacity; the sequence just inserted is the most recent, evicted last.
  size_t Insert(std::span<const int32_t> tokens, std::span<const TokenTag> tags = {});

  // Drops everything.
  void Clear();

  size_t size_tokens() const { return size_; }
  size_t capacity_tokens() const { return capacity_; }

 private:
  struct Node;
  void Touch(Node* node);
  void EvictTo(size_t limit);
  void SplitAt(Node* node, size_t at);

  size_t capacity_;
  size_t size_ = 0;
  uint64_t clock_ = 0;
  std::unique_ptr<Node> root_;
  // Leaves ordered by last access: the eviction queue.
  std::set<std::pair<uint64_t, Node*>> leaves_;
};

}  // namespace bragg::gateway
