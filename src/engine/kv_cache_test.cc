#include "engine/kv_cache.h"

#include <gtest/gtest.h>

#include <numeric>
#include <random>

namespace bragg::engine {
namespace {

std::vector<int32_t> Seq(int n, int base) {
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), base);
  return v;
}

// Fills and commits `blocks` as the request holding `tokens` would.
void CommitAll(BlockPool& pool, uint64_t salt, const std::vector<int32_t>& tokens,
               const std::vector<int32_t>& blocks) {
  int bs = pool.block_size();
  uint64_t parent = salt;
  std::vector<uint32_t> versions(bs, 7);
  for (size_t i = 0; i < tokens.size() / bs; ++i) {
    std::vector<int32_t> experts(bs * 2, static_cast<int32_t>(i));
    parent =
        pool.Commit(blocks[i], parent, std::span(tokens).subspan(i * bs, bs), versions, experts);
  }
}

TEST(BlockPool, MatchesOnlyFullBlocksOfTheSamePrefixAndSalt) {
  BlockPool pool(8, 4, 2);
  uint64_t salt = BlockPool::SaltKey("");
  std::vector<int32_t> a = Seq(10, 100);  // two full blocks and a partial one
  std::vector<int32_t> blocks;
  ASSERT_TRUE(pool.Allocate(3, &blocks));
  CommitAll(pool, salt, a, blocks);
  pool.Release(blocks);
  EXPECT_EQ(pool.cached_blocks(), 2);

  std::vector<uint64_t> keys;
  auto m = pool.Match(salt, a, 100, &keys);
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[0], blocks[0]);
  EXPECT_EQ(m[1], blocks[1]);
  EXPECT_EQ(keys.size(), 2u);
  EXPECT_EQ(pool.versions(m[1])[0], 7u);
  EXPECT_EQ(pool.experts(m[1])[0], 1);
  pool.Release(m);

  // max_blocks caps the match.
  EXPECT_EQ(pool.Match(salt, a, 1, nullptr).size(), 1u);
  pool.Release(std::vector<int32_t>{blocks[0]});
  // Another salt (extra_key) matches nothing.
  EXPECT_TRUE(pool.Match(BlockPool::SaltKey("v2"), a, 100, nullptr).empty());
  // A different first block breaks the chain even if the second is equal.
  std::vector<int32_t> b = a;
  b[0] = 1;
  EXPECT_TRUE(pool.Match(salt, b, 100, nullptr).empty());
  // The same first block, a different second: one block.
  std::vector<int32_t> c = a;
  c[5] = 1;
  auto mc = pool.Match(salt, c, 100, nullptr);
  EXPECT_EQ(mc.size(), 1u);
  pool.Release(mc);
}

TEST(BlockPool, EvictsLeastRecentlyUsedAndNeverAHeldBlock) {
  BlockPool pool(4, 2, 0);
  uint64_t salt = BlockPool::SaltKey("");
  std::vector<int32_t> x = Seq(4, 0), y = Seq(4, 50);
  std::vector<int32_t> bx, by;
  ASSERT_TRUE(pool.Allocate(2, &bx));
  CommitAll(pool, salt, x, bx);
  ASSERT_TRUE(pool.Allocate(2, &by));
  CommitAll(pool, salt, y, by);
  pool.Release(bx);
  pool.Release(by);
  EXPECT_EQ(pool.available(), 4);
  // Touch x so y is least recently used.
  auto mx = pool.Match(salt, x, 10, nullptr);
  ASSERT_EQ(mx.size(), 2u);
  EXPECT_EQ(pool.available(), 2);
  std::vector<int32_t> fresh;
  ASSERT_TRUE(pool.Allocate(2, &fresh));  // evicts y's blocks
  EXPECT_TRUE(pool.Match(salt, y, 10, nullptr).empty());
  // x is held: nothing is left to hand out, and a failed Allocate takes nothing.
  std::vector<int32_t> none;
  EXPECT_FALSE(pool.Allocate(1, &none));
  EXPECT_TRUE(none.empty());
  pool.Release(mx);
  pool.Release(fresh);
  EXPECT_EQ(pool.available(), 4);
  auto again = pool.Match(salt, x, 10, nullptr);
  EXPECT_EQ(again.size(), 2u);
  pool.Release(again);
}

TEST(BlockPool, DuplicateContentStaysPrivateAndFlushForgets) {
  BlockPool pool(4, 2, 0);
  uint64_t salt = BlockPool::SaltKey("");
  std::vector<int32_t> x = Seq(2, 0);
  std::vector<int32_t> b1, b2;
  ASSERT_TRUE(pool.Allocate(1, &b1));
  ASSERT_TRUE(pool.Allocate(1, &b2));
  CommitAll(pool, salt, x, b1);
  CommitAll(pool, salt, x, b2);  // same content computed twice concurrently
  EXPECT_EQ(pool.cached_blocks(), 1);
  pool.Release(b2);  // private: straight back to free
  EXPECT_EQ(pool.available(), 3);
  pool.Release(b1);
  EXPECT_EQ(pool.available(), 4);
  pool.FlushUnreferenced();
  EXPECT_EQ(pool.cached_blocks(), 0);
  EXPECT_TRUE(pool.Match(salt, x, 10, nullptr).empty());
}

TEST(BlockPool, RandomisedRefcountsNeverLeakOrDoubleHandOut) {
  std::mt19937 rng(3);
  BlockPool pool(32, 4, 0);
  uint64_t salt = BlockPool::SaltKey("");
  std::vector<std::vector<int32_t>> held;
  for (int step = 0; step < 5000; ++step) {
    if (held.empty() || rng() % 2 == 0) {
      std::vector<int32_t> toks(4 * (1 + rng() % 3));
      for (auto& t : toks) t = static_cast<int32_t>(rng() % 3);
      std::vector<int32_t> got = pool.Match(salt, toks, 100, nullptr);
      int64_t need = static_cast<int64_t>(toks.size() / 4) - static_cast<int64_t>(got.size());
      if (!pool.Allocate(need, &got)) {
        pool.Release(got);
        continue;
      }
      CommitAll(pool, salt, toks, got);
      held.push_back(got);
    } else {
      size_t i = rng() % held.size();
      pool.Release(held[i]);
      held.erase(held.begin() + static_cast<std::ptrdiff_t>(i));
    }
    // No block is held twice by different holders unless shared through Match, and in_use
    // counts distinct held blocks.
    std::set<int32_t> distinct;
    for (auto& h : held) distinct.insert(h.begin(), h.end());
    ASSERT_EQ(pool.in_use(), static_cast<int64_t>(distinct.size()));
  }
  for (auto& h : held) pool.Release(h);
  EXPECT_EQ(pool.available(), 32);
}

}  // namespace
}  // namespace bragg::engine
