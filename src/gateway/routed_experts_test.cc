#include "gateway/routed_experts.h"

#include <gtest/gtest.h>

namespace bragg::gateway {
namespace {

TEST(RoutedExpertsTest, EncodeDecodeRoundTrip) {
  std::vector<int32_t> v = {0, 1, -1, 63, 1 << 30};
  auto back = DecodeRoutedExperts(EncodeRoutedExperts(v));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, v);
  EXPECT_EQ(DecodeRoutedExperts("").value().size(), 0u);
}

TEST(RoutedExpertsTest, DecodeRejectsGarbage) {
  EXPECT_FALSE(DecodeRoutedExperts("!!!not base64!!!").ok());
  EXPECT_FALSE(DecodeRoutedExperts("AAA=").ok());  // 2 bytes: not whole int32
}

TEST(RoutedExpertsTest, DeterministicAndVersionSensitive) {
  MoeShape shape{3, 2, 16};
  std::vector<int32_t> tokens = {5, 6, 7, 8};
  std::vector<uint32_t> v1(4, VersionId("1"));
  std::vector<uint32_t> v2(4, VersionId("2"));
  std::vector<int32_t> a, b, c;
  AppendSimRoutedExperts(tokens, v1, 0, 3, shape, &a);
  AppendSimRoutedExperts(tokens, v1, 0, 3, shape, &b);
  AppendSimRoutedExperts(tokens, v2, 0, 3, shape, &c);
  ASSERT_EQ(a.size(), 3u * 6u);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  for (int32_t e : a) {
    EXPECT_GE(e, 0);
    EXPECT_LT(e, 16);
  }
  // A suffix computed alone equals the tail of the full array.
  std::vector<int32_t> tail;
  AppendSimRoutedExperts(tokens, v1, 1, 3, shape, &tail);
  EXPECT_TRUE(std::equal(tail.begin(), tail.end(), a.begin() + 6));
}

TEST(RoutedExpertsTest, AssemblerChecksAlignment) {
  RoutedExpertsAssembler asm_;
  std::vector<int32_t> first(4 * 2, 1);  // 5 tokens -> 4 positions, width 2
  ASSERT_TRUE(asm_.Append(0, 5, first).ok());
  EXPECT_EQ(asm_.positions(), 4u);
  std::vector<int32_t> wrong_start(2, 2);
  EXPECT_FALSE(asm_.Append(3, 6, wrong_start).ok());
  std::vector<int32_t> wrong_width(3, 2);
  EXPECT_FALSE(asm_.Append(4, 6, wrong_width).ok());
  std::vector<int32_t> uneven(3, 2);
  EXPECT_FALSE(asm_.Append(4, 7, uneven).ok());
  EXPECT_FALSE(asm_.Append(4, 4, {}).ok());  // total before start
  std::vector<int32_t> next(2 * 2, 3);
  ASSERT_TRUE(asm_.Append(4, 7, next).ok());
  EXPECT_EQ(asm_.positions(), 6u);
  EXPECT_EQ(asm_.data().size(), 12u);
}

}  // namespace
}  // namespace bragg::gateway
