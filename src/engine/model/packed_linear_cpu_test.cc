// PackedLinear against torch's linear, on both layouts the engine packs from (an lm_head in the
// [in, out] memory of TransposeLinearWeights, a tied one that is the embedding, row-major), and
// the calls it must refuse.

#include "engine/model/packed_linear_cpu.h"

#include <gtest/gtest.h>

#include "engine/model/cpu_isa_testing.h"

namespace bragg::engine::qwen3 {
namespace {

namespace F = torch::nn::functional;

struct Shape {
  int64_t rows, in, out;
};

void ExpectClose(const torch::Tensor& got, const torch::Tensor& want) {
  ASSERT_EQ(got.sizes(), want.sizes());
  const double err = (got - want).abs().max().item<double>();
  const double scale = want.abs().max().item<double>();
  EXPECT_LE(err, 1e-5 * std::max(1.0, scale)) << "max |diff| " << err;
}

TEST(PackedLinear, EqualsTorchOnDecodeShapesAndBothLayouts) {
  for (CpuIsa isa : TestedIsas()) {
    SCOPED_TRACE(CpuIsaName(isa));
    c10::InferenceMode guard;
    torch::manual_seed(11);
    // The benchmark's lm_head at its batch sizes, and odd shapes: row counts around the tile of 8,
    // column counts around the block of 48 (and under one vector), `in` not a vector multiple.
    for (Shape s :
         {Shape{1, 256, 32000}, Shape{32, 256, 32000}, Shape{64, 256, 32000}, Shape{7, 37, 47},
          Shape{8, 16, 48}, Shape{9, 64, 49}, Shape{33, 3, 5}, Shape{17, 100, 1000},
          Shape{63, 1, 97}, Shape{32, 256, 384}, Shape{64, 256, 256}}) {
      for (bool transposed : {true, false}) {
        SCOPED_TRACE(::testing::Message() << "rows " << s.rows << " in " << s.in << " out " << s.out
                                          << (transposed ? " [in, out] memory" : " row-major"));
        torch::Tensor w = torch::randn({s.out, s.in}).mul(0.05);
        if (transposed) {
          w = w.t().contiguous().t();
        }
        torch::Tensor packed = PackLinearWeight(w);
        ASSERT_EQ(packed.size(0), (s.out + kPackedLinearCols - 1) / kPackedLinearCols);
        torch::Tensor x = torch::randn({s.rows, s.in});
        ASSERT_TRUE(PackedLinearFits(x, packed, isa));
        ExpectClose(PackedLinear(x, packed, s.out, isa), F::linear(x, w));
        // A row of a strided view (the engine's hidden states may be one).
        torch::Tensor wide = torch::randn({s.rows, s.in * 2});
        torch::Tensor view = wide.narrow(1, 0, s.in);
        ExpectClose(PackedLinear(view, packed, s.out, isa), F::linear(view, w));
      }
    }
  }
}

TEST(PackedLinear, ARowsResultDoesNotDependOnItsBatch) {
  for (CpuIsa isa : TestedIsas()) {
    SCOPED_TRACE(CpuIsaName(isa));
    c10::InferenceMode guard;
    torch::manual_seed(12);
    torch::Tensor w = torch::randn({1000, 256}).t().contiguous().t();
    torch::Tensor packed = PackLinearWeight(w);
    torch::Tensor x = torch::randn({33, 256});
    torch::Tensor all = PackedLinear(x, packed, 1000, isa);
    for (int64_t r : {0, 7, 8, 32}) {
      EXPECT_TRUE(
          torch::equal(PackedLinear(x.narrow(0, r, 1), packed, 1000, isa), all.narrow(0, r, 1)))
          << "row " << r;
    }
  }
}

TEST(PackedLinear, RepackFollowsAnUpdateInPlace) {
  for (CpuIsa isa : TestedIsas()) {
    SCOPED_TRACE(CpuIsaName(isa));
    c10::InferenceMode guard;
    torch::manual_seed(13);
    torch::Tensor w = torch::randn({100, 64}).t().contiguous().t();
    torch::Tensor packed = PackLinearWeight(w);
    const void* where = packed.data_ptr();
    w.copy_(torch::randn({100, 64}));  // as Model::ApplyUpdate writes new weights through the view
    RepackLinearWeight(w, packed);
    EXPECT_EQ(packed.data_ptr(), where);
    torch::Tensor x = torch::randn({5, 64});
    ExpectClose(PackedLinear(x, packed, 100, isa), F::linear(x, w));
    // The padding of the last block stays zero: a block of 48 columns holds 100 = 2 * 48 + 4.
    EXPECT_EQ(packed.select(0, 2).narrow(1, 4, kPackedLinearCols - 4).abs().max().item<float>(), 0);
    torch::Tensor other = torch::randn({150, 64});  // 4 blocks, not 3
    EXPECT_THROW(RepackLinearWeight(other, packed), c10::Error);
  }
}

TEST(PackedLinear, RefusesWhatItCannotTake) {
  torch::manual_seed(14);
  torch::Tensor w = torch::randn({100, 64});
  torch::Tensor packed = PackLinearWeight(w);
  torch::Tensor x = torch::randn({4, 64});
  EXPECT_FALSE(PackedLinearAvailable(CpuIsa::kNone));
  EXPECT_FALSE(PackedLinearFits(x, packed, CpuIsa::kNone));
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    SCOPED_TRACE(CpuIsaName(isa));
    if (!CpuRuns(isa)) {
      EXPECT_FALSE(PackedLinearFits(x, packed, isa));
      EXPECT_THROW(PackedLinear(x, packed, 100, isa), c10::Error);
      continue;
    }
    EXPECT_TRUE(PackedLinearFits(x, packed, isa));
    EXPECT_FALSE(PackedLinearFits(torch::randn({kPackedLinearMaxRows + 1, 64}), packed, isa));
    EXPECT_FALSE(PackedLinearFits(torch::randn({0, 64}), packed, isa));
    EXPECT_FALSE(PackedLinearFits(torch::randn({4, 63}), packed, isa));
    EXPECT_FALSE(PackedLinearFits(x.to(torch::kBFloat16), packed, isa));
    EXPECT_FALSE(PackedLinearFits(x.to(torch::kFloat64), packed, isa));
    EXPECT_FALSE(PackedLinearFits(torch::randn({4}), packed, isa));
    EXPECT_FALSE(PackedLinearFits(x, torch::Tensor(), isa));
    EXPECT_FALSE(PackedLinearFits(torch::randn({4, 64}, torch::requires_grad()), packed, isa));
    EXPECT_THROW(PackedLinear(x, packed, 200, isa), c10::Error);  // more columns than were packed
    EXPECT_THROW(PackedLinear(x, packed, 48, isa), c10::Error);  // fewer: a block would be left out
  }
  EXPECT_THROW(PackLinearWeight(torch::randn({4, 4}, torch::kFloat64)), c10::Error);
}

}  // namespace
}  // namespace bragg::engine::qwen3
