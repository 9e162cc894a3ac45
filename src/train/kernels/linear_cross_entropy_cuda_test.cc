#include "train/kernels/linear_cross_entropy_cuda.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>

#include "train/kernels/linear_cross_entropy.h"

namespace bragg::train {
namespace {

// A device copy of a contiguous CPU tensor, freed at scope exit; Read() copies a device buffer
// of `like`'s shape back.
class DeviceTensor {
 public:
  explicit DeviceTensor(const torch::Tensor& host) : bytes_(host.numel() * host.element_size()) {
    EXPECT_EQ(cudaMalloc(&ptr_, std::max<size_t>(bytes_, 1)), cudaSuccess);
    torch::Tensor c = host.contiguous();
    EXPECT_EQ(cudaMemcpy(ptr_, c.data_ptr(), bytes_, cudaMemcpyHostToDevice), cudaSuccess);
    like_ = torch::empty_like(c);
  }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  ~DeviceTensor() { cudaFree(ptr_); }
  template <typename T>
  T* get() {
    return static_cast<T*>(ptr_);
  }
  torch::Tensor Read() {
    torch::Tensor out = torch::empty_like(like_);
    EXPECT_EQ(cudaMemcpy(out.data_ptr(), ptr_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }

 private:
  size_t bytes_;
  void* ptr_ = nullptr;
  torch::Tensor like_;
};

class LinearCrossEntropyCuda : public testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
      GTEST_SKIP() << "no CUDA device visible (cudaGetDeviceCount: "
                   << (e == cudaSuccess ? "0 devices" : cudaGetErrorString(e))
                   << "): the CUDA op runs only on a GPU machine (bench/train/lce_device.sh)";
    }
  }
};

double RelErr(const torch::Tensor& x, const torch::Tensor& y) {
  double scale = std::max(y.abs().max().item<double>(), 1e-30);
  return (x.to(torch::kFloat64) - y.to(torch::kFloat64)).abs().max().item<double>() / scale;
}

void CompareWithCpu(int64_t T, int64_t H, int64_t V, int64_t chunk, float temperature,
                    void* cublas_handle = nullptr) {
  SCOPED_TRACE(testing::Message() << "T " << T << " H " << H << " V " << V << " chunk " << chunk);
  torch::manual_seed(T + V);
  torch::Tensor hidden = torch::randn({T, H}) * 2.0;
  torch::Tensor weight = torch::randn({V, H}) / std::sqrt(static_cast<double>(H));
  torch::Tensor labels = torch::randint(0, V, {T}, torch::kInt64);
  torch::Tensor glp = torch::randn({T}), gent = torch::randn({T});

  torch::Tensor h = hidden.clone().requires_grad_(true), w = weight.clone().requires_grad_(true);
  LinearCrossEntropyOutput cpu = LinearCrossEntropy(h, w, labels, {256, 0, temperature, false});
  ((glp * cpu.logprobs).sum() + (gent * cpu.entropy).sum()).backward();

  DeviceTensor dh(hidden), dw(weight), dl(labels), dglp(glp), dgent(gent);
  DeviceTensor lp(torch::empty({T})), ent(torch::empty({T})), lse(torch::empty({T}));
  DeviceTensor gh(torch::empty({T, H})), gw(torch::empty({V, H}));
  LinearCrossEntropyCudaOptions o{chunk, temperature, cublas_handle};
  ASSERT_TRUE(LinearCrossEntropyForwardCuda(dh.get<float>(), dw.get<float>(), dl.get<int64_t>(), T,
                                            H, V, o, lp.get<float>(), ent.get<float>(),
                                            lse.get<float>(), nullptr)
                  .ok());
  EXPECT_LE(RelErr(lp.Read(), cpu.logprobs.detach()), 1e-5);
  EXPECT_LE(RelErr(ent.Read(), cpu.entropy.detach()), 1e-5);
  Status s =
      LinearCrossEntropyBackwardCuda(dh.get<float>(), dw.get<float>(), dl.get<int64_t>(), T, H, V,
                                     o, lse.get<float>(), ent.get<float>(), dglp.get<float>(),
                                     dgent.get<float>(), gh.get<float>(), gw.get<float>(), nullptr);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_LE(RelErr(gh.Read(), h.grad()), 1e-4);
  EXPECT_LE(RelErr(gw.Read(), w.grad()), 1e-4);
}

TEST_F(LinearCrossEntropyCuda, MatchesTheCpuOp) {
  CompareWithCpu(300, 64, 5000, 128, 0.8f);  // T not a multiple of the chunk
  cublasHandle_t blas = nullptr;
  ASSERT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
  CompareWithCpu(77, 32, 257, 1024, 1.0f, blas);  // one chunk (odd T x V), the caller's handle
  cublasDestroy(blas);
  CompareWithCpu(1024, 256, 151936, 512, 1.0f);  // Qwen's vocabulary
}

TEST_F(LinearCrossEntropyCuda, BadInputsAreNamed) {
  torch::Tensor hidden = torch::randn({20, 8}), weight = torch::randn({256, 8});
  torch::Tensor labels = torch::randint(0, 256, {20}, torch::kInt64);
  labels[17] = 300;
  DeviceTensor dh(hidden), dw(weight), dl(labels), out(torch::empty({3, 20}));
  float* o = out.get<float>();
  Status s = LinearCrossEntropyForwardCuda(dh.get<float>(), dw.get<float>(), dl.get<int64_t>(), 20,
                                           8, 256, {}, o, o + 20, o + 40, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              testing::HasSubstr("labels[17] = 300 is outside the vocabulary (V = 256)"));
  s = LinearCrossEntropyForwardCuda(dh.get<float>(), dw.get<float>(), dl.get<int64_t>(), 20, 8, 256,
                                    {0, 1.0f}, o, o + 20, o + 40, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  s = LinearCrossEntropyForwardCuda(dh.get<float>(), dw.get<float>(), dl.get<int64_t>(), 20, 8, 256,
                                    {32, 0.0f}, o, o + 20, o + 40, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(LinearCrossEntropyCuda, EmptyBatchZeroesGradWeight) {
  DeviceTensor dw(torch::randn({10, 4})), gw(torch::full({10, 4}, 7.0f));
  Status s =
      LinearCrossEntropyBackwardCuda(nullptr, dw.get<float>(), nullptr, 0, 4, 10, {}, nullptr,
                                     nullptr, nullptr, nullptr, nullptr, gw.get<float>(), nullptr);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(gw.Read().abs().sum().item<float>(), 0.0f);
}

}  // namespace
}  // namespace bragg::train
