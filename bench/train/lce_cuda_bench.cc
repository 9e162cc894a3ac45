// train_lce_cuda_bench: time and device memory of the CUDA fused linear cross-entropy (forward +
// backward) per token chunk, against the same op with one chunk of all T rows (the full [T, V]
// logits, the naive path's smallest footprint). Memory: the high-water mark of the device's
// default memory pool, from which the op takes its workspace (cudaMallocAsync), reset before
// each case; inputs, outputs and cuBLAS's own workspace are outside it. JSON on stdout, a table
// on stderr. Needs a GPU (exit 77 without one, as a ctest skip).

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "nlohmann/json.hpp"
#include "train/kernels/linear_cross_entropy_cuda.h"

namespace {

using bragg::train::LinearCrossEntropyCudaOptions;

#define CHECK_CUDA(expr)                                               \
  do {                                                                 \
    cudaError_t e_ = (expr);                                           \
    if (e_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                    \
    }                                                                  \
  } while (0)

template <typename T>
T* DeviceRandom(int64_t n, float scale, std::mt19937& rng, int64_t modulo = 0) {
  std::vector<T> host(n);
  std::normal_distribution<float> normal(0.0f, scale);
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, int64_t>) {
      host[i] = static_cast<int64_t>(rng() % modulo);
    } else {
      host[i] = normal(rng);
    }
  }
  T* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, n * sizeof(T)));
  CHECK_CUDA(cudaMemcpy(d, host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"train_lce_cuda_bench: CUDA fused linear cross-entropy, time and memory"};
  int64_t T = 16384, H = 4096, chunk = 1024;
  int iters = 3;
  std::vector<int64_t> vocabs{32768, 151936};
  app.add_option("--tokens", T, "T");
  app.add_option("--hidden", H, "H");
  app.add_option("--vocabs", vocabs, "vocabulary sizes")->delimiter(',');
  app.add_option("--token-chunk", chunk, "rows per chunk");
  app.add_option("--iters", iters, "timed iterations (after one warm-up)");
  CLI11_PARSE(app, argc, argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "SKIP: no CUDA device visible\n");
    return 77;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  cudaMemPool_t pool;
  CHECK_CUDA(cudaDeviceGetDefaultMemPool(&pool, 0));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  cublasHandle_t blas = nullptr;
  if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "cublasCreate failed\n");
    return 1;
  }

  nlohmann::json records = nlohmann::json::array();
  std::mt19937 rng(1);
  for (int64_t V : vocabs) {
    float* h = DeviceRandom<float>(T * H, 2.0f, rng);
    float* w = DeviceRandom<float>(V * H, 1.0f / std::sqrt(static_cast<float>(H)), rng);
    int64_t* labels = DeviceRandom<int64_t>(T, 0, rng, V);
    float* glp = DeviceRandom<float>(T, 1.0f, rng);
    float* gent = DeviceRandom<float>(T, 1.0f, rng);
    float *lp, *ent, *lse, *gh, *gw;
    CHECK_CUDA(cudaMalloc(&lp, T * 4));
    CHECK_CUDA(cudaMalloc(&ent, T * 4));
    CHECK_CUDA(cudaMalloc(&lse, T * 4));
    CHECK_CUDA(cudaMalloc(&gh, T * H * 4));
    CHECK_CUDA(cudaMalloc(&gw, V * H * 4));
    for (int64_t c : {chunk, T}) {
      LinearCrossEntropyCudaOptions o{c, 1.0f, blas};
      auto once = [&](float* fwd_ms, float* bwd_ms) {
        cudaEvent_t e0, e1, e2;
        CHECK_CUDA(cudaEventCreate(&e0));
        CHECK_CUDA(cudaEventCreate(&e1));
        CHECK_CUDA(cudaEventCreate(&e2));
        CHECK_CUDA(cudaEventRecord(e0, stream));
        bragg::Status s = bragg::train::LinearCrossEntropyForwardCuda(h, w, labels, T, H, V, o, lp,
                                                                      ent, lse, stream);
        CHECK_CUDA(cudaEventRecord(e1, stream));
        if (s.ok()) {
          s = bragg::train::LinearCrossEntropyBackwardCuda(h, w, labels, T, H, V, o, lse, ent, glp,
                                                           gent, gh, gw, stream);
        }
        CHECK_CUDA(cudaEventRecord(e2, stream));
        CHECK_CUDA(cudaEventSynchronize(e2));
        if (!s.ok()) {
          std::cerr << s << "\n";
          std::exit(1);
        }
        CHECK_CUDA(cudaEventElapsedTime(fwd_ms, e0, e1));
        CHECK_CUDA(cudaEventElapsedTime(bwd_ms, e1, e2));
      };
      float f = 0, b = 0, fs = 0, bs = 0;
      once(&f, &b);  // warm-up (cuBLAS heuristics, pool growth)
      uint64_t zero = 0;
      CHECK_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
      for (int i = 0; i < iters; ++i) {
        once(&f, &b);
        fs += f;
        bs += b;
      }
      uint64_t high = 0;
      CHECK_CUDA(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high));
      records.push_back({{"impl", c == T ? "one_chunk_full_logits" : "fused"},
                         {"device", prop.name},
                         {"T", T},
                         {"H", H},
                         {"V", V},
                         {"token_chunk", c},
                         {"pool_peak_bytes", high},
                         {"chunk_logits_bytes", std::min(c, T) * V * 4},
                         {"logits_TxVx4_bytes", T * V * 4},
                         {"forward_ms", fs / iters},
                         {"backward_ms", bs / iters}});
    }
    for (void* p : {(void*)h, (void*)w, (void*)labels, (void*)glp, (void*)gent, (void*)lp,
                    (void*)ent, (void*)lse, (void*)gh, (void*)gw}) {
      CHECK_CUDA(cudaFree(p));
    }
  }
  std::cout << nlohmann::json{{"bench", "train_lce_cuda"}, {"cases", records}}.dump(2) << std::endl;
  std::fprintf(stderr, "%-22s %6s %5s %7s %6s %12s %10s %10s\n", "impl", "T", "H", "V", "chunk",
               "pool MiB", "fwd ms", "bwd ms");
  for (const auto& r : records) {
    std::fprintf(stderr, "%-22s %6lld %5lld %7lld %6lld %12.1f %10.2f %10.2f\n",
                 r["impl"].get<std::string>().c_str(), (long long)r["T"].get<int64_t>(),
                 (long long)r["H"].get<int64_t>(), (long long)r["V"].get<int64_t>(),
                 (long long)r["token_chunk"].get<int64_t>(),
                 r["pool_peak_bytes"].get<uint64_t>() / 1048576.0, r["forward_ms"].get<double>(),
                 r["backward_ms"].get<double>());
  }
  return 0;
}
