#include "train/kernels/linear_cross_entropy_cuda.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "train/kernels/linear_cross_entropy_cuda_kernels.h"

namespace bragg::train {
namespace {

Status CudaError(cudaError_t e, const char* what) {
  if (e == cudaSuccess) {
    return absl::OkStatus();
  }
  std::string msg = absl::StrCat("linear cross-entropy (CUDA): ", what, ": ", cudaGetErrorName(e),
                                 " ", cudaGetErrorString(e));
  if (e == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(absl::StrCat(msg, "; lower token_chunk"));
  }
  return absl::InternalError(msg);
}

Status CublasError(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) {
    return absl::OkStatus();
  }
  std::string msg =
      absl::StrCat("linear cross-entropy (CUDA): ", what, ": ", cublasGetStatusString(s));
  if (s == CUBLAS_STATUS_ALLOC_FAILED) {
    return absl::ResourceExhaustedError(msg);
  }
  return absl::InternalError(msg);
}

// A cuBLAS handle bound to one stream, in plain FP32 (no TF32: the CPU op is the reference).
// The caller's handle, or one of our own destroyed at scope exit.
class ScopedCublas {
 public:
  ScopedCublas() = default;
  ScopedCublas(const ScopedCublas&) = delete;
  ScopedCublas& operator=(const ScopedCublas&) = delete;
  ~ScopedCublas() {
    if (owned_) {
      cublasDestroy(handle_);
    }
  }
  Status Init(void* callers, cudaStream_t stream) {
    if (callers != nullptr) {
      handle_ = static_cast<cublasHandle_t>(callers);
    } else {
      BRAGG_RETURN_IF_ERROR(CublasError(cublasCreate(&handle_), "cublasCreate"));
      owned_ = true;
    }
    BRAGG_RETURN_IF_ERROR(CublasError(cublasSetStream(handle_, stream), "cublasSetStream"));
    return CublasError(cublasSetMathMode(handle_, CUBLAS_PEDANTIC_MATH), "cublasSetMathMode");
  }
  cublasHandle_t get() const { return handle_; }

 private:
  cublasHandle_t handle_ = nullptr;
  bool owned_ = false;
};

// Stream-ordered device memory, freed (on its stream) when it goes out of scope.
class ScopedDeviceBuffer {
 public:
  ScopedDeviceBuffer() = default;
  ScopedDeviceBuffer(const ScopedDeviceBuffer&) = delete;
  ScopedDeviceBuffer& operator=(const ScopedDeviceBuffer&) = delete;
  ~ScopedDeviceBuffer() {
    if (ptr_ != nullptr) {
      cudaFreeAsync(ptr_, stream_);
    }
  }
  Status Allocate(int64_t bytes, cudaStream_t stream) {
    stream_ = stream;
    return CudaError(
        cudaMallocAsync(&ptr_, static_cast<size_t>(std::max<int64_t>(bytes, 1)), stream),
        "cudaMallocAsync (workspace)");
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

Status CheckArgs(int64_t T, int64_t H, int64_t V, const LinearCrossEntropyCudaOptions& o) {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("linear cross-entropy (CUDA): ", parts...));
  };
  if (T < 0 || H <= 0 || V <= 0) {
    return bad("need T >= 0, H > 0 and V > 0, got T = ", T, ", H = ", H, ", V = ", V);
  }
  if (o.token_chunk <= 0) {
    return bad("token_chunk must be positive, got ", o.token_chunk);
  }
  if (!std::isfinite(o.temperature) || !(o.temperature > 0)) {
    return bad("temperature must be a positive float, got ", o.temperature);
  }
  // cuBLAS takes int dimensions and leading dimensions.
  if (H > INT32_MAX || V > INT32_MAX || std::min(o.token_chunk, T) > INT32_MAX) {
    return bad("H, V and token_chunk must fit in int32 (cuBLAS)");
  }
  return absl::OkStatus();
}

// Labels outside [0, V) named, as the CPU op does; synchronizes the stream.
Status CheckLabels(const int64_t* labels, int64_t T, int64_t V, unsigned long long* first_bad,
                   cudaStream_t stream) {
  unsigned long long none = static_cast<unsigned long long>(T), bad = none;
  BRAGG_RETURN_IF_ERROR(CudaError(
      cudaMemcpyAsync(first_bad, &none, sizeof(none), cudaMemcpyHostToDevice, stream), "memcpy"));
  BRAGG_RETURN_IF_ERROR(
      CudaError(cuda::LaunchCheckLabels(labels, T, V, first_bad, stream), "label check"));
  BRAGG_RETURN_IF_ERROR(CudaError(
      cudaMemcpyAsync(&bad, first_bad, sizeof(bad), cudaMemcpyDeviceToHost, stream), "memcpy"));
  BRAGG_RETURN_IF_ERROR(CudaError(cudaStreamSynchronize(stream), "label check"));
  if (bad == none) {
    return absl::OkStatus();
  }
  int64_t value = 0;
  BRAGG_RETURN_IF_ERROR(
      CudaError(cudaMemcpy(&value, labels + bad, sizeof(value), cudaMemcpyDeviceToHost), "memcpy"));
  return absl::InvalidArgumentError(absl::StrCat("linear cross-entropy (CUDA): labels[", bad,
                                                 "] = ", value,
                                                 " is outside the vocabulary (V = ", V, ")"));
}

// Row-major chunk logits [n, V] = h [n, H] W^T: column-major, that is logits^T [V, n] =
// (W^T [H, V])^T h^T [H, n].
Status ChunkLogits(cublasHandle_t blas, const float* h, const float* weight, int64_t n, int64_t H,
                   int64_t V, float* logits) {
  const float one = 1.0f, zero = 0.0f;
  return CublasError(
      cublasSgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(V), static_cast<int>(n),
                  static_cast<int>(H), &one, weight, static_cast<int>(H), h, static_cast<int>(H),
                  &zero, logits, static_cast<int>(V)),
      "SGEMM (logits)");
}

// The workspace: the chunk's logits, then (256-byte aligned, for the 8-byte atomic) the label
// check's flag.
int64_t LabelFlagOffset(int64_t T, int64_t V, const LinearCrossEntropyCudaOptions& o) {
  int64_t logits = std::min(o.token_chunk, T) * V * static_cast<int64_t>(sizeof(float));
  return (logits + 255) / 256 * 256;
}

}  // namespace

int64_t LinearCrossEntropyCudaWorkspaceBytes(int64_t T, int64_t V,
                                             const LinearCrossEntropyCudaOptions& o) {
  return LabelFlagOffset(T, V, o) + 256;
}

Status LinearCrossEntropyForwardCuda(const float* hidden, const float* weight,
                                     const int64_t* labels, int64_t T, int64_t H, int64_t V,
                                     const LinearCrossEntropyCudaOptions& o, float* logprobs,
                                     float* entropy, float* lse, cudaStream_t stream) {
  BRAGG_RETURN_IF_ERROR(CheckArgs(T, H, V, o));
  if (T == 0) {
    return absl::OkStatus();
  }
  ScopedDeviceBuffer ws;
  BRAGG_RETURN_IF_ERROR(ws.Allocate(LinearCrossEntropyCudaWorkspaceBytes(T, V, o), stream));
  float* logits = ws.as<float>();
  auto* first_bad = reinterpret_cast<unsigned long long*>(ws.as<char>() + LabelFlagOffset(T, V, o));
  BRAGG_RETURN_IF_ERROR(CheckLabels(labels, T, V, first_bad, stream));
  ScopedCublas blas;
  BRAGG_RETURN_IF_ERROR(blas.Init(o.cublas_handle, stream));
  for (int64_t r0 = 0; r0 < T; r0 += o.token_chunk) {
    const int64_t n = std::min(o.token_chunk, T - r0);
    BRAGG_RETURN_IF_ERROR(ChunkLogits(blas.get(), hidden + r0 * H, weight, n, H, V, logits));
    BRAGG_RETURN_IF_ERROR(
        CudaError(cuda::LaunchForwardRows(logits, n, V, labels + r0, o.temperature, logprobs + r0,
                                          entropy + r0, lse + r0, stream),
                  "forward row kernel"));
  }
  return CudaError(cudaStreamSynchronize(stream), "forward");
}

Status LinearCrossEntropyBackwardCuda(const float* hidden, const float* weight,
                                      const int64_t* labels, int64_t T, int64_t H, int64_t V,
                                      const LinearCrossEntropyCudaOptions& o, const float* lse,
                                      const float* entropy, const float* grad_logprobs,
                                      const float* grad_entropy, float* grad_hidden,
                                      float* grad_weight, cudaStream_t stream) {
  BRAGG_RETURN_IF_ERROR(CheckArgs(T, H, V, o));
  BRAGG_RETURN_IF_ERROR(
      CudaError(cudaMemsetAsync(grad_weight, 0, static_cast<size_t>(V * H) * sizeof(float), stream),
                "cudaMemsetAsync (grad_weight)"));
  if (T == 0) {
    return CudaError(cudaStreamSynchronize(stream), "backward");
  }
  ScopedDeviceBuffer ws;
  BRAGG_RETURN_IF_ERROR(ws.Allocate(LinearCrossEntropyCudaWorkspaceBytes(T, V, o), stream));
  float* g = ws.as<float>();
  auto* first_bad = reinterpret_cast<unsigned long long*>(ws.as<char>() + LabelFlagOffset(T, V, o));
  BRAGG_RETURN_IF_ERROR(CheckLabels(labels, T, V, first_bad, stream));
  ScopedCublas blas;
  BRAGG_RETURN_IF_ERROR(blas.Init(o.cublas_handle, stream));
  const float one = 1.0f, zero = 0.0f;
  for (int64_t r0 = 0; r0 < T; r0 += o.token_chunk) {
    const int64_t n = std::min(o.token_chunk, T - r0);
    const float* h = hidden + r0 * H;
    BRAGG_RETURN_IF_ERROR(ChunkLogits(blas.get(), h, weight, n, H, V, g));
    BRAGG_RETURN_IF_ERROR(CudaError(
        cuda::LaunchBackwardRows(g, n, V, labels + r0, o.temperature, lse + r0, entropy + r0,
                                 grad_logprobs ? grad_logprobs + r0 : nullptr,
                                 grad_entropy ? grad_entropy + r0 : nullptr, stream),
        "backward row kernel"));
    // grad_hidden rows [n, H] = G [n, V] W [V, H]; column-major: gh^T [H, n] = W^T [H, V] G^T.
    BRAGG_RETURN_IF_ERROR(CublasError(
        cublasSgemm(blas.get(), CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(H), static_cast<int>(n),
                    static_cast<int>(V), &one, weight, static_cast<int>(H), g, static_cast<int>(V),
                    &zero, grad_hidden + r0 * H, static_cast<int>(H)),
        "SGEMM (grad_hidden)"));
    // grad_weight [V, H] += G^T [V, n] h [n, H]; column-major: gw^T [H, V] += h^T [H, n] G.
    BRAGG_RETURN_IF_ERROR(CublasError(
        cublasSgemm(blas.get(), CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(H), static_cast<int>(V),
                    static_cast<int>(n), &one, h, static_cast<int>(H), g, static_cast<int>(V), &one,
                    grad_weight, static_cast<int>(H)),
        "SGEMM (grad_weight)"));
  }
  return CudaError(cudaStreamSynchronize(stream), "backward");
}

}  // namespace bragg::train
