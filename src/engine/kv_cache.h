#pragma once

// The KV cache's bookkeeping (no tensors here: model.cc owns the storage, one slot per token,
// block b holding slots [b * block_size, (b + 1) * block_size)).
//
// A prefix cache over full blocks. Each full block is named by a chain key: the hash of its
// parent's key and its own tokens, the first block's parent being the request's cache salt
// (extra_key). Matching a prompt walks its full blocks from the start and takes the cached blocks
// while their keys (and stored tokens, so a hash collision cannot alias two prefixes) agree: a
// radix tree over blocks, kept as a hash map of chains, as vLLM's automatic prefix caching is.
// Blocks are reference-counted; a cached block no request holds stays until memory is needed and
// is then evicted least recently used first. A block carries what later requests reuse with its
// KV: the weight version each token's KV was computed under and the routed experts of its tokens.
//
// Not thread-safe: the engine thread alone uses it.

#include <cstdint>
#include <list>
#include <optional>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace bragg::engine {

class BlockPool {
 public:
  BlockPool(int64_t num_blocks, int block_size, int experts_per_token);

  int block_size() const { return block_size_; }
  int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  // Blocks an Allocate could hand out now: free ones and evictable cached ones.
  int64_t available() const { return static_cast<int64_t>(free_.size() + lru_.size()); }
  int64_t in_use() const { return num_blocks() - available(); }
  int64_t cached_blocks() const { return static_cast<int64_t>(by_key_.size()); }

  static uint64_t SaltKey(std::string_view extra_key);

  // The longest run of cached full blocks that starts `tokens` under `salt`, at most
  // `max_blocks`, each now referenced by the caller; `keys` gets each block's chain key.
  std::vector<int32_t> Match(uint64_t salt, std::span<const int32_t> tokens, int64_t max_blocks,
                             std::vector<uint64_t>* keys);

  // `n` fresh blocks (evicting least recently used cached blocks as needed), referenced by the
  // caller; false, with nothing taken, if fewer than `n` are available.
  bool Allocate(int64_t n, std::vector<int32_t>* out);

  // Publishes a block the caller filled: `tokens` (block_size of them) under `parent_key`, with
  // each token's weight-version id and routed experts. Returns the block's chain key. A block
  // whose content is already cached elsewhere stays private (its twin serves later matches).
  uint64_t Commit(int32_t block, uint64_t parent_key, std::span<const int32_t> tokens,
                  std::span<const uint32_t> versions, std::span<const int32_t> experts);

  // Drops the caller's reference to each block: an unreferenced cached block becomes evictable,
  // an unreferenced private one free.
  void Release(std::span<const int32_t> blocks);

  // Forgets every cached block no request holds (their KV is gone for matching purposes).
  void FlushUnreferenced();
  // Forgets every cached block, held or not (held ones stay valid for their holders).
  void FlushAll();

  std::span<const uint32_t> versions(int32_t block) const { return blocks_[block].versions; }
  std::span<const int32_t> experts(int32_t block) const { return blocks_[block].experts; }

 private:
  struct Block {
    int32_t refs = 0;
    std::optional<uint64_t> key;  // set while cached (in by_key_)
    uint64_t parent_key = 0;
    std::vector<int32_t> tokens;
    std::vector<uint32_t> versions;
    std::vector<int32_t> experts;
    std::list<int32_t>::iterator lru_pos;  // valid while refs == 0 and cached
  };
  static uint64_t ChainKey(uint64_t parent, std::span<const int32_t> tokens);
  void Uncache(int32_t block);

  int block_size_;
  int experts_per_token_;
  std::vector<Block> blocks_;
  std::vector<int32_t> free_;
  std::list<int32_t> lru_;  // evictable cached blocks, least recently used first
  std::unordered_map<uint64_t, int32_t> by_key_;
};

}  // namespace bragg::engine
