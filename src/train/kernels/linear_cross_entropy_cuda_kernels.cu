#include <cfloat>
#include <cmath>

#include "train/kernels/linear_cross_entropy_cuda_kernels.h"

namespace bragg::train::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

__device__ double WarpSum(double v) {
  for (int o = 16; o > 0; o >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;
}

__device__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  return v;
}

// Block-wide reductions; every thread gets the result. `scratch` holds kWarps values.
__device__ float BlockMax(float v, float* scratch) {
  v = WarpMax(v);
  if (threadIdx.x % 32 == 0) {
    scratch[threadIdx.x / 32] = v;
  }
  __syncthreads();
  v = threadIdx.x < kWarps ? scratch[threadIdx.x] : -INFINITY;
  if (threadIdx.x < 32) {
    v = WarpMax(v);
    if (threadIdx.x == 0) {
      scratch[0] = v;
    }
  }
  __syncthreads();
  float out = scratch[0];
  __syncthreads();
  return out;
}

__device__ double BlockSum(double v, double* scratch) {
  v = WarpSum(v);
  if (threadIdx.x % 32 == 0) {
    scratch[threadIdx.x / 32] = v;
  }
  __syncthreads();
  v = threadIdx.x < kWarps ? scratch[threadIdx.x] : 0.0;
  if (threadIdx.x < 32) {
    v = WarpSum(v);
    if (threadIdx.x == 0) {
      scratch[0] = v;
    }
  }
  __syncthreads();
  double out = scratch[0];
  __syncthreads();
  return out;
}

__global__ void CheckLabelsKernel(const int64_t* labels, int64_t T, int64_t V,
                                  unsigned long long* first_bad) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < T;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t y = labels[i];
    if (y < 0 || y >= V) {
      atomicMin(first_bad, static_cast<unsigned long long>(i));
    }
  }
}

__global__ void ForwardRowsKernel(const float* logits, int64_t V, const int64_t* labels, float t,
                                  float* logprobs, float* entropy, float* lse_out) {
  __shared__ float fscratch[kWarps];
  __shared__ double dscratch[kWarps];
  const int64_t r = blockIdx.x;
  const float* row = logits + r * V;
  float m = -INFINITY;
  for (int64_t i = threadIdx.x; i < V; i += kThreads) {
    m = fmaxf(m, row[i] / t);
  }
  m = BlockMax(m, fscratch);
  double s = 0, w = 0;
  for (int64_t i = threadIdx.x; i < V; i += kThreads) {
    float d = row[i] / t - m;
    double e = exp(static_cast<double>(d));
    s += e;
    w += e * d;
  }
  s = BlockSum(s, dscratch);
  w = BlockSum(w, dscratch);
  if (threadIdx.x == 0) {
    double lse = m + log(s);
    logprobs[r] = static_cast<float>(static_cast<double>(row[labels[r]] / t) - lse);
    entropy[r] = static_cast<float>(log(s) - w / s);
    lse_out[r] = static_cast<float>(lse);
  }
}

__global__ void BackwardRowsKernel(float* logits, int64_t V, const int64_t* labels, float t,
                                   const float* lse, const float* entropy,
                                   const float* grad_logprobs, const float* grad_entropy) {
  const int64_t r = blockIdx.x;
  float* row = logits + r * V;
  const float l = lse[r], h = entropy[r];
  const float glp = grad_logprobs ? grad_logprobs[r] : 0.0f;
  const float gh = grad_entropy ? grad_entropy[r] : 0.0f;
  const int64_t y = labels[r];
  for (int64_t i = threadIdx.x; i < V; i += kThreads) {
    float logp = row[i] / t - l;
    float p = expf(logp);
    float g = -glp * p - gh * p * (logp + h);
    if (i == y) {
      g += glp;
    }
    row[i] = g / t;
  }
}

}  // namespace

cudaError_t LaunchCheckLabels(const int64_t* labels, int64_t T, int64_t V,
                              unsigned long long* first_bad, cudaStream_t stream) {
  if (T == 0) {
    return cudaSuccess;
  }
  int64_t blocks = (T + 255) / 256;
  CheckLabelsKernel<<<static_cast<unsigned>(blocks < 1024 ? blocks : 1024), 256, 0, stream>>>(
      labels, T, V, first_bad);
  return cudaGetLastError();
}

cudaError_t LaunchForwardRows(const float* logits, int64_t n, int64_t V, const int64_t* labels,
                              float t, float* logprobs, float* entropy, float* lse,
                              cudaStream_t stream) {
  if (n == 0) {
    return cudaSuccess;
  }
  ForwardRowsKernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(logits, V, labels, t,
                                                                       logprobs, entropy, lse);
  return cudaGetLastError();
}

cudaError_t LaunchBackwardRows(float* logits, int64_t n, int64_t V, const int64_t* labels, float t,
                               const float* lse, const float* entropy, const float* grad_logprobs,
                               const float* grad_entropy, cudaStream_t stream) {
  if (n == 0) {
    return cudaSuccess;
  }
  BackwardRowsKernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(
      logits, V, labels, t, lse, entropy, grad_logprobs, grad_entropy);
  return cudaGetLastError();
}

}  // namespace bragg::train::cuda
