#include "engine/kv_cache.h"

#include <algorithm>
#include <cassert>
#include <string_view>

#include "common/hash.h"

namespace bragg::engine {
BlockPool::BlockPool(int64_t num_blocks, int block_size, int experts_per_token)
    : block_size_(block_size), experts_per_token_(experts_per_token), blocks_(num_blocks) {
  free_.reserve(num_blocks);
  for (int64_t b = num_blocks - 1; b >= 0; --b) {
    free_.push_back(static_cast<int32_t>(b));
  }
}

uint64_t BlockPool::SaltKey(std::string_view extra_key) {
  uint64_t h = SplitMix64(0x62726167675f6b76ULL);
  for (unsigned char c : extra_key) {
    h = SplitMix64(h ^ c);
  }
  return SplitMix64(h ^ extra_key.size());
}

uint64_t BlockPool::ChainKey(uint64_t parent, std::span<const int32_t> tokens) {
  uint64_t h = SplitMix64(parent);
  for (int32_t t : tokens) {
    h = SplitMix64(h ^ static_cast<uint32_t>(t));
  }
  return h;
}

std::vector<int32_t> BlockPool::Match(uint64_t salt, std::span<const int32_t> tokens,
                                      int64_t max_blocks, std::vector<uint64_t>* keys) {
  std::vector<int32_t> out;
  uint64_t parent = salt;
  int64_t full = static_cast<int64_t>(tokens.size()) / block_size_;
  for (int64_t i = 0; i < std::min(full, max_blocks); ++i) {
    auto part = tokens.subspan(i * block_size_, block_size_);
    uint64_t key = ChainKey(parent, part);
    auto it = by_key_.find(key);
    if (it == by_key_.end()) {
      break;
    }
    Block& b = blocks_[it->second];
    if (b.parent_key != parent || !std::equal(part.begin(), part.end(), b.tokens.begin())) {
      break;  // a hash collision: treat as a miss
    }
    if (b.refs == 0) {
      lru_.erase(b.lru_pos);
    }
    b.refs++;
    out.push_back(it->second);
    if (keys != nullptr) {
      keys->push_back(key);
    }
    parent = key;
  }
  return out;
}

bool BlockPool::Allocate(int64_t n, std::vector<int32_t>* out) {
  if (n > available()) {
    return false;
  }
  for (int64_t i = 0; i < n; ++i) {
    int32_t b;
    if (!free_.empty()) {
      b = free_.back();
      free_.pop_back();
    } else {
      b = lru_.front();
      lru_.pop_front();
      Uncache(b);
    }
    Block& blk = blocks_[b];
    assert(blk.refs == 0);
    blk.refs = 1;
    out->push_back(b);
  }
  return true;
}

uint64_t BlockPool::Commit(int32_t block, uint64_t parent_key, std::span<const int32_t> tokens,
                           std::span<const uint32_t> versions, std::span<const int32_t> experts) {
  uint64_t key = ChainKey(parent_key, tokens);
  Block& b = blocks_[block];
  if (b.key || by_key_.contains(key)) {
    return key;
  }
  b.key = key;
  b.parent_key = parent_key;
  b.tokens.assign(tokens.begin(), tokens.end());
  b.versions.assign(versions.begin(), versions.end());
  b.experts.assign(experts.begin(), experts.end());
  by_key_[key] = block;
  return key;
}

void BlockPool::Uncache(int32_t block) {
  Block& b = blocks_[block];
  if (b.key) {
    by_key_.erase(*b.key);
    b.key.reset();
  }
  b.tokens.clear();
  b.versions.clear();
  b.experts.clear();
}

void BlockPool::Release(std::span<const int32_t> blocks) {
  for (int32_t id : blocks) {
    Block& b = blocks_[id];
    assert(b.refs > 0);
    if (--b.refs > 0) {
      continue;
    }
    if (b.key) {
      lru_.push_back(id);
      b.lru_pos = std::prev(lru_.end());
    } else {
      Uncache(id);
      free_.push_back(id);
    }
  }
}

void BlockPool::FlushUnreferenced() {
  for (int32_t id : lru_) {
    Uncache(id);
    free_.push_back(id);
  }
  lru_.clear();
}

void BlockPool::FlushAll() {
  FlushUnreferenced();
  for (Block& b : blocks_) {
    if (b.key) {
      by_key_.erase(*b.key);
      b.key.reset();
    }
  }
}

}  // namespace bragg::engine
