#include "gateway/radix_cache.h"

#include <gtest/gtest.h>

#include <random>

namespace bragg::gateway {
namespace {

std::vector<int32_t> Seq(std::initializer_list<int32_t> v) { return v; }

TEST(RadixCacheTest, MatchesLongestPrefix) {
  RadixCache c(0);
  EXPECT_EQ(c.Insert(Seq({1, 2, 3, 4})), 0u);
  EXPECT_EQ(c.Match(Seq({1, 2, 3, 4, 5})), 4u);
  EXPECT_EQ(c.Match(Seq({1, 2, 9})), 2u);
  EXPECT_EQ(c.Match(Seq({9})), 0u);
  EXPECT_EQ(c.Match(Seq({})), 0u);
  EXPECT_EQ(c.Insert(Seq({1, 2, 7, 8})), 2u);  // splits the edge
  EXPECT_EQ(c.size_tokens(), 6u);
  EXPECT_EQ(c.Match(Seq({1, 2, 3, 4})), 4u);
  EXPECT_EQ(c.Match(Seq({1, 2, 7, 8})), 4u);
  EXPECT_EQ(c.Insert(Seq({1, 2})), 2u);  // already there: nothing added
  EXPECT_EQ(c.size_tokens(), 6u);
}

TEST(RadixCacheTest, TagsFollowTokens) {
  RadixCache c(0);
  std::vector<TokenTag> tags = {5, 5, 6, 6};
  c.Insert(Seq({1, 2, 3, 4}), tags);
  std::vector<TokenTag> got;
  EXPECT_EQ(c.Match(Seq({1, 2, 3, 9}), &got), 3u);
  EXPECT_EQ(got, (std::vector<TokenTag>{5, 5, 6}));
}

TEST(RadixCacheTest, EvictsLeastRecentlyUsedFirst) {
  RadixCache c(8);
  c.Insert(Seq({1, 1, 1, 1}));
  c.Insert(Seq({2, 2, 2, 2}));
  c.Match(Seq({1, 1, 1, 1}));  // 1s are now newer than 2s
  c.Insert(Seq({3, 3, 3, 3}));
  EXPECT_LE(c.size_tokens(), 8u);
  EXPECT_EQ(c.Peek(Seq({1, 1, 1, 1})), 4u);
  EXPECT_EQ(c.Peek(Seq({3, 3, 3, 3})), 4u);
  EXPECT_EQ(c.Peek(Seq({2, 2, 2, 2})), 0u);
}

TEST(RadixCacheTest, TrimsTailOfLeafAndKeepsSharedPrefix) {
  RadixCache c(10);
  c.Insert(Seq({1, 2, 3, 4, 5, 6}));
  c.Insert(Seq({1, 2, 3, 7, 8, 9}));          // 9 tokens
  c.Insert(Seq({1, 2, 3, 7, 8, 9, 10, 11}));  // 11 > 10: oldest leaf loses its tail
  EXPECT_EQ(c.size_tokens(), 10u);
  EXPECT_EQ(c.Peek(Seq({1, 2, 3, 7, 8, 9, 10, 11})), 8u);
  EXPECT_EQ(c.Peek(Seq({1, 2, 3, 4, 5, 6})), 5u);
}

TEST(RadixCacheTest, SequenceLongerThanCapacityDoesNotCrash) {
  RadixCache c(4);
  std::vector<int32_t> big(100);
  for (int i = 0; i < 100; ++i) {
    big[i] = i;
  }
  c.Insert(big);
  EXPECT_LE(c.size_tokens(), 4u);
  EXPECT_EQ(c.Peek(big), 4u);
}

TEST(RadixCacheTest, RandomizedAgainstBruteForce) {
  // Unbounded cache: match == longest common prefix with any inserted sequence.
  std::mt19937 rng(7);
  RadixCache c(0);
  std::vector<std::vector<int32_t>> seqs;
  for (int i = 0; i < 300; ++i) {
    std::vector<int32_t> s;
    if (!seqs.empty() && rng() % 2 == 0) {
      const auto& base = seqs[rng() % seqs.size()];
      s.assign(base.begin(), base.begin() + rng() % (base.size() + 1));
    }
    size_t extra = rng() % 6;
    for (size_t k = 0; k < extra; ++k) {
      s.push_back(static_cast<int32_t>(rng() % 3));
    }
    size_t expect = 0;
    for (const auto& t : seqs) {
      size_t n = 0;
      while (n < s.size() && n < t.size() && s[n] == t[n]) {
        ++n;
      }
      expect = std::max(expect, n);
    }
    ASSERT_EQ(c.Peek(s), expect) << "step " << i;
    ASSERT_EQ(c.Insert(s), expect) << "step " << i;
    seqs.push_back(s);
  }
}

}  // namespace
}  // namespace bragg::gateway
