#include "pack/zigzag.h"

#include <numeric>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace bragg::pack {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(CpIndicesTest, MatchesTransformerEngineLayout) {
  // Two traces of padded lengths 8 and 12, cp=2: 4 chunks per trace of 2 and 3 tokens.
  const std::vector<int32_t> cu = {0, 8, 20};
  auto r0 = CpIndices(cu, 2, 0);
  ASSERT_TRUE(r0.ok()) << r0.status();
  EXPECT_THAT(*r0, ElementsAre(0, 1, 6, 7, 8, 9, 10, 17, 18, 19));
  auto r1 = CpIndices(cu, 2, 1);
  ASSERT_TRUE(r1.ok());
  EXPECT_THAT(*r1, ElementsAre(2, 3, 4, 5, 11, 12, 13, 14, 15, 16));
}

TEST(CpIndicesTest, CpOneIsIdentity) {
  const std::vector<int32_t> cu = {0, 3, 4, 9};
  auto r = CpIndices(cu, 1, 0);
  ASSERT_TRUE(r.ok());
  std::vector<int32_t> want(9);
  std::iota(want.begin(), want.end(), 0);
  EXPECT_EQ(*r, want);
}

// Regression: other stacks round a CP length that is not a multiple of 2*cp down, silently
// dropping tokens. Here it is an error that says what to do.
TEST(CpIndicesTest, RefusesLengthsNotDivisibleByTwoCp) {
  const std::vector<int32_t> cu = {0, 8, 18};  // 10 is not a multiple of 4
  auto r = CpIndices(cu, 2, 0);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("not a multiple of 2*cp=4"));
}

TEST(CpIndicesTest, RejectsHostileInput) {
  const std::vector<int32_t> cu = {0, 8};
  EXPECT_FALSE(CpIndices(cu, 0, 0).ok());
  EXPECT_FALSE(CpIndices(cu, 2, 2).ok());
  EXPECT_FALSE(CpIndices(cu, 2, -1).ok());
  EXPECT_FALSE(CpIndices(std::vector<int32_t>{}, 1, 0).ok());
  EXPECT_FALSE(CpIndices(std::vector<int32_t>{4, 8}, 1, 0).ok());
  EXPECT_FALSE(CpIndices(std::vector<int32_t>{0, 8, 4}, 1, 0).ok());
}

TEST(GatherScatterTest, RoundTripsRoutedExpertRows) {
  // [T=8, layers=2, top_k=3]
  const std::vector<int32_t> cu = {0, 4, 8};
  std::vector<int16_t> experts(8 * 6);
  std::iota(experts.begin(), experts.end(), 0);
  std::vector<int16_t> back(experts.size(), -1);
  for (int r = 0; r < 2; ++r) {
    auto idx = CpIndices(cu, 2, r);
    ASSERT_TRUE(idx.ok());
    auto part = GatherTokens<int16_t>(experts, 6, *idx);
    ASSERT_TRUE(part.ok());
    ASSERT_EQ(part->size(), 4u * 6u);
    EXPECT_EQ((*part)[0], static_cast<int16_t>((*idx)[0] * 6));
    ASSERT_TRUE(ScatterTokens<int16_t>(*part, 6, *idx, std::span<int16_t>(back)).ok());
  }
  EXPECT_EQ(back, experts);
}

TEST(GatherScatterTest, RejectsBadShapesAndIndices) {
  std::vector<float> v(10);
  const std::vector<int32_t> bad = {0, 5};
  EXPECT_FALSE(GatherTokens<float>(v, 3, std::vector<int32_t>{0}).ok());  // 10 % 3 != 0
  EXPECT_FALSE(GatherTokens<float>(v, 2, bad).ok());                      // 5 >= 5 tokens
  EXPECT_FALSE(GatherTokens<float>(v, 0, bad).ok());
  std::vector<float> part(4);
  EXPECT_FALSE(ScatterTokens<float>(part, 2, bad, std::span<float>(v)).ok());
  EXPECT_FALSE(ScatterTokens<float>(part, 2, std::vector<int32_t>{0}, std::span<float>(v)).ok());
}

// Regression: routed-expert rows recorded per real token and copied contiguously into the
// padded row end up shifted by the padding of every earlier trace.
TEST(PackToPaddedTest, RoutedExpertRowsLandAtPaddedOffsets) {
  const std::vector<int32_t> cu = {0, 3, 8};          // lengths 3 and 5
  const std::vector<int32_t> cu_padded = {0, 4, 12};  // padded to 4 and 8
  // [5+3 real tokens, layers=1, top_k=2]; token t of trace k has experts (100k+t, 100k+t+50).
  std::vector<int32_t> real;
  for (int k = 0; k < 2; ++k) {
    for (int t = 0; t < cu[k + 1] - cu[k]; ++t) {
      real.push_back(100 * k + t);
      real.push_back(100 * k + t + 50);
    }
  }
  auto padded = PackToPadded<int32_t>(real, 2, cu, cu_padded, -1);
  ASSERT_TRUE(padded.ok()) << padded.status();
  ASSERT_EQ(padded->size(), 24u);
  EXPECT_EQ((*padded)[3 * 2], -1);   // pad of trace 0
  EXPECT_EQ((*padded)[4 * 2], 100);  // first token of trace 1 at padded offset 4, not 3
  EXPECT_EQ((*padded)[4 * 2 + 1], 150);
  EXPECT_EQ((*padded)[11 * 2], -1);
  auto back = UnpackFromPadded<int32_t>(*padded, 2, cu, cu_padded);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, real);
  // Wrong sizes and inconsistent boundaries are refused.
  EXPECT_FALSE(
      PackToPadded<int32_t>(std::span<const int32_t>(real).first(10), 2, cu, cu_padded, -1).ok());
  EXPECT_FALSE(PackToPadded<int32_t>(real, 2, cu, std::vector<int32_t>{0, 2, 12}, -1).ok());
  EXPECT_FALSE(PackToPadded<int32_t>(real, 2, cu, std::vector<int32_t>{0, 4}, -1).ok());
}

TEST(ShiftTest, LabelsShiftWithinTracesAndLastTokenHasNoLoss) {
  const std::vector<int32_t> cu = {0, 3, 4};
  const std::vector<int32_t> cu_padded = {0, 4, 8};
  const std::vector<int64_t> tokens = {10, 11, 12, 0, 20, 0, 0, 0};
  auto labels = ShiftWithinTraces<int64_t>(tokens, 1, cu, cu_padded, -100);
  ASSERT_TRUE(labels.ok());
  EXPECT_THAT(*labels, ElementsAre(11, 12, -100, -100, -100, -100, -100, -100));
  const std::vector<uint8_t> mask = {1, 1, 1, 0, 1, 0, 0, 0};
  auto loss = ShiftWithinTraces<uint8_t>(mask, 1, cu, cu_padded, 0);
  ASSERT_TRUE(loss.ok());
  EXPECT_THAT(*loss, ElementsAre(1, 1, 0, 0, 0, 0, 0, 0));
}

}  // namespace
}  // namespace bragg::pack
