// cpu_simd.h's building blocks, each instruction set's instance that this CPU runs: exp against
// libm over its whole range and at its edges, masked loads and stores that must not touch
// memory outside their lanes (a guard page after the data), the 16 x 16 transpose and the
// reductions, and the register tile on every row count and column count against a float64
// product, its weights ending at a guard page.

#include "engine/model/cpu_simd.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace bragg::engine::qwen3::simd512 {
#include "engine/model/cpu_simd_test_ops.inc"
}  // namespace bragg::engine::qwen3::simd512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace bragg::engine::qwen3::simd256 {
#include "engine/model/cpu_simd_test_ops.inc"
}  // namespace bragg::engine::qwen3::simd256
#pragma GCC pop_options

namespace bragg::engine::qwen3 {
namespace {

struct Ops {
  CpuIsa isa;
  void (*exp)(const float*, float*, int64_t);
  void (*masked_copy)(const float*, float*, int64_t, float*);
  void (*transpose)(float*);
  float (*max_of)(const float*);
  float (*sum_of)(const float*);
  TileFn (*tile)(int);
};

// The instances this CPU runs; the test fails rather than skips where it runs none of them on
// x86-64 (every CPU the engine is built for has AVX2 since 2013: a detection bug is likelier).
std::vector<Ops> Instances() {
  std::vector<Ops> ops;
  if (CpuRuns(CpuIsa::kAvx512)) {
    ops.push_back({CpuIsa::kAvx512, simd512::ExpArray, simd512::MaskedCopy, simd512::Transpose,
                   simd512::MaxOf, simd512::SumOf, simd512::TileFor});
  }
  if (CpuRuns(CpuIsa::kAvx2)) {
    ops.push_back({CpuIsa::kAvx2, simd256::ExpArray, simd256::MaskedCopy, simd256::Transpose,
                   simd256::MaxOf, simd256::SumOf, simd256::TileFor});
  }
  return ops;
}

// `floats` floats that end where an inaccessible page begins: reading one past the end faults.
class GuardedFloats {
 public:
  explicit GuardedFloats(size_t floats) {
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    data_bytes_ = (floats * sizeof(float) + page - 1) / page * page;
    size_ = data_bytes_ + page;
    base_ = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base_ == MAP_FAILED) {
      base_ = nullptr;
      return;
    }
    if (::mprotect(static_cast<char*>(base_) + data_bytes_, page, PROT_NONE) != 0) {
      ::munmap(base_, size_);  // without its guard the test could not see an over-read
      base_ = nullptr;
      return;
    }
    end_ = reinterpret_cast<float*>(static_cast<char*>(base_) + data_bytes_);
  }
  ~GuardedFloats() {
    if (base_ != nullptr) {
      ::munmap(base_, size_);
    }
  }
  GuardedFloats(const GuardedFloats&) = delete;
  GuardedFloats& operator=(const GuardedFloats&) = delete;
  bool ok() const { return base_ != nullptr; }
  float* end() const { return end_; }  // the first float past the accessible ones

 private:
  void* base_ = nullptr;
  size_t size_ = 0, data_bytes_ = 0;
  float* end_ = nullptr;
};

TEST(CpuSimd, ThisCpuRunsAnInstance) {
  ASSERT_FALSE(Instances().empty()) << "neither AVX2 with FMA nor AVX-512F detected";
  EXPECT_EQ(BestCpuIsa(), Instances().front().isa);  // BRAGG_ENGINE_CPU_ISA unset in tests
}

TEST(CpuSimd, ExpMatchesLibmAndHoldsItsEdges) {
  std::vector<float> x;
  for (float v = -87.0f; v <= 88.0f; v += 0.0137f) {
    x.push_back(v);
  }
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> edges = {0.0f,   -0.0f, 1e-30f, -1e-30f, -87.0f, -87.5f, -100.0f,
                                    -1e30f, -inf,  88.7f,  89.0f,   1e30f,  inf,    std::nanf("")};
  x.insert(x.end(), edges.begin(), edges.end());
  x.resize((x.size() + 15) / 16 * 16, 0.0f);
  std::vector<float> first;
  for (const Ops& ops : Instances()) {
    SCOPED_TRACE(CpuIsaName(ops.isa));
    std::vector<float> y(x.size());
    ops.exp(x.data(), y.data(), static_cast<int64_t>(x.size()));
    const float floor = std::exp(-87.0f);
    for (size_t i = 0; i < x.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << "x " << x[i]);
      if (std::isnan(x[i])) {
        EXPECT_TRUE(std::isnan(y[i]));
      } else if (x[i] < -87.0f) {
        EXPECT_NEAR(y[i], floor, floor * 1e-6);  // documented: exp(-87) below -87
      } else if (x[i] > 88.73f) {
        EXPECT_EQ(y[i], inf);
      } else {
        const double want = std::exp(static_cast<double>(x[i]));
        EXPECT_LE(std::abs(y[i] - want), 3e-7 * want);
      }
    }
    // The same polynomial and the same exact scaling: every instance gives the same floats.
    if (first.empty()) {
      first = y;
    } else {
      EXPECT_EQ(std::memcmp(first.data(), y.data(), y.size() * sizeof(float)), 0);
    }
  }
}

TEST(CpuSimd, MaskedLoadsAndStoresTouchTheirLanesAlone) {
  GuardedFloats src(16);
  ASSERT_TRUE(src.ok());
  for (const Ops& ops : Instances()) {
    SCOPED_TRACE(CpuIsaName(ops.isa));
    for (int64_t n : {-5, 0, 1, 7, 8, 9, 15, 16, 17, 100}) {
      SCOPED_TRACE(::testing::Message() << "n " << n);
      const int64_t k = std::clamp<int64_t>(n, 0, 16);
      // The k floats read end at the guard page: lanes past them are not read.
      float* in = src.end() - k;
      for (int64_t i = 0; i < k; ++i) {
        in[i] = static_cast<float>(i + 1);
      }
      float dst[16], lanes[16];
      std::fill(dst, dst + 16, -7.0f);
      ops.masked_copy(in, dst, n, lanes);
      for (int64_t i = 0; i < 16; ++i) {
        EXPECT_EQ(lanes[i], i < k ? static_cast<float>(i + 1) : 0.0f) << "lane " << i;
        EXPECT_EQ(dst[i], i < k ? static_cast<float>(i + 1) : -7.0f) << "lane " << i;
      }
    }
  }
}

TEST(CpuSimd, TransposeAndReductions) {
  for (const Ops& ops : Instances()) {
    SCOPED_TRACE(CpuIsaName(ops.isa));
    float a[256];
    for (int i = 0; i < 256; ++i) {
      a[i] = static_cast<float>(i);
    }
    ops.transpose(a);
    for (int i = 0; i < 16; ++i) {
      for (int j = 0; j < 16; ++j) {
        ASSERT_EQ(a[i * 16 + j], static_cast<float>(j * 16 + i)) << i << "," << j;
      }
    }
    float v[16];
    for (int i = 0; i < 16; ++i) {
      v[i] = static_cast<float>((i * 7) % 16) - 20.0f;
    }
    EXPECT_EQ(ops.max_of(v), -5.0f);
    EXPECT_EQ(ops.sum_of(v), -200.0f);
    v[11] = std::numeric_limits<float>::infinity();
    EXPECT_EQ(ops.max_of(v), std::numeric_limits<float>::infinity());
    EXPECT_EQ(ops.sum_of(v), std::numeric_limits<float>::infinity());
  }
}

TEST(CpuSimd, TileEqualsAFloat64ProductOnEveryShape) {
  std::mt19937 gen(5);
  std::normal_distribution<float> normal;
  const int64_t in = 37;
  for (const Ops& ops : Instances()) {
    SCOPED_TRACE(CpuIsaName(ops.isa));
    for (int rows = 1; rows <= kTileRows; ++rows) {
      for (int64_t ncols : {1, 5, 15, 16, 17, 31, 32, 33, 47, 48}) {
        SCOPED_TRACE(::testing::Message() << rows << " rows, " << ncols << " columns");
        // w [in][ncols] at stride ncols, ending at the guard page: no column past ncols read.
        GuardedFloats wmem(static_cast<size_t>(in * ncols));
        ASSERT_TRUE(wmem.ok());
        float* w = wmem.end() - in * ncols;
        for (int64_t i = 0; i < in * ncols; ++i) {
          w[i] = normal(gen);
        }
        std::vector<float> x(static_cast<size_t>(rows * (in + 3)));
        for (float& v : x) {
          v = normal(gen);
        }
        const int64_t ldo = 50;
        std::vector<float> out(static_cast<size_t>(rows * ldo), -7.0f);
        ops.tile(rows)(x.data(), in + 3, in, w, ncols, out.data(), ldo, ncols, w, 0);
        for (int r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < ldo; ++c) {
            if (c >= ncols) {
              EXPECT_EQ(out[r * ldo + c], -7.0f) << "written past ncols at " << r << "," << c;
              continue;
            }
            double want = 0;
            for (int64_t k = 0; k < in; ++k) {
              want += static_cast<double>(x[r * (in + 3) + k]) * w[k * ncols + c];
            }
            EXPECT_NEAR(out[r * ldo + c], want, 1e-5) << r << "," << c;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace bragg::engine::qwen3
